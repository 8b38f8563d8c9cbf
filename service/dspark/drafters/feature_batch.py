"""Flattening the per-request feature chunks that `Drafter.commit` receives into one batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.drafters.context_store import ContextStore
from dspark.engine.request import Request


@dataclass
class CommittedChunk:
    """All committed tokens of one `commit` call: features [N, F] and where each belongs."""

    features: torch.Tensor
    rows: torch.Tensor  # [N] store row of each token
    positions: torch.Tensor  # [N] its position in its request


def gather_commit(
    store: ContextStore,
    requests: Sequence[Request],
    features: Sequence[torch.Tensor | None],
    feature_size: int,
) -> CommittedChunk | None:
    """Validate the chunks, advance each request's committed length, and return them as one batch."""
    if len(requests) != len(features):
        raise ValueError(f"commit got {len(requests)} requests but {len(features)} feature tensors")
    chunks, rows, positions = [], [], []
    row_of = store.rows([r.request_id for r in requests])
    for request, row, feats in zip(requests, row_of, features, strict=True):
        if feats is None or feats.shape[0] == 0:
            continue
        if feats.dim() != 2 or feats.shape[1] != feature_size:
            raise ValueError(
                f"request {request.request_id!r}: features must be [n_tokens, {feature_size}] "
                f"(len(target_layers) * hidden), got {tuple(feats.shape)}"
            )
        start = store.length[request.request_id]
        store.length[request.request_id] = start + feats.shape[0]
        store.reserve(request.request_id, start + feats.shape[0])
        chunks.append(feats)
        rows.extend([row] * feats.shape[0])
        positions.extend(range(start, start + feats.shape[0]))
    if not chunks:
        return None
    device = store.device
    return CommittedChunk(
        torch.cat(chunks).to(device),
        torch.tensor(rows, device=device),
        torch.tensor(positions, device=device),
    )


def check_in_sync(store: ContextStore, requests: Sequence[Request]) -> list[int]:
    """Committed lengths, which must equal the target's cached lengths (the anchor's position)."""
    lengths = [store.length[r.request_id] for r in requests]
    for request, length in zip(requests, lengths, strict=True):
        if length != request.num_cached:
            raise RuntimeError(
                f"drafter saw {length} committed tokens of request {request.request_id!r} "
                f"but the target has cached {request.num_cached}"
            )
        if length == 0:
            raise RuntimeError(f"request {request.request_id!r} has no committed context to draft from")
    return lengths
