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
    where = torch.tensor([rows, positions], device=device)  # one host-to-device copy for both
    return CommittedChunk(torch.cat(chunks).to(device), where[0], where[1])


class PendingCommits:
    """Committed chunks whose drafter context is not computed yet, merged into one batch on `take`.

    A drafter's context is read only when it drafts, and under load the scheduler drafts on few
    steps; computing it at every commit spent a dozen small operations per step (about 2% of a
    CPU step at 8 requests). Deferred, the work runs once per drafted step, batched over the
    steps since. Rows released meanwhile (and perhaps given to a new request) are dropped from
    the chunks committed before their release.
    """

    def __init__(self, max_tokens: int = 4096) -> None:
        self.max_tokens = max_tokens  # bounds the memory held between drafted steps
        self.num_tokens = 0
        self._chunks: list[CommittedChunk] = []
        self._released: list[tuple[int, int]] = []  # (row, chunks committed before its release)

    def add(self, chunk: CommittedChunk) -> bool:
        """Queue a chunk; True when enough is queued that the caller should `take` it now."""
        self._chunks.append(chunk)
        self.num_tokens += chunk.rows.numel()
        return self.num_tokens >= self.max_tokens

    def release(self, row: int) -> None:
        if self._chunks:
            self._released.append((row, len(self._chunks)))

    def take(self) -> CommittedChunk | None:
        """Everything queued (minus released rows) as one chunk, in commit order; the queue empties."""
        chunks, released = self._chunks, self._released
        self._chunks, self._released, self.num_tokens = [], [], 0
        if not chunks:
            return None
        if len(chunks) == 1 and not released:  # the usual drafted step: nothing to merge or drop
            return chunks[0]
        merged = CommittedChunk(
            torch.cat([c.features for c in chunks]),
            torch.cat([c.rows for c in chunks]),
            torch.cat([c.positions for c in chunks]),
        )
        if not released:
            return merged
        rows = merged.rows
        order = torch.repeat_interleave(
            torch.arange(len(chunks), device=rows.device),
            torch.tensor([c.rows.numel() for c in chunks], device=rows.device),
        )
        stale = torch.zeros_like(rows, dtype=torch.bool)
        for row, before in released:
            stale |= (rows == row) & (order < before)
        keep = ~stale
        return CommittedChunk(merged.features[keep], rows[keep], merged.positions[keep])


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
