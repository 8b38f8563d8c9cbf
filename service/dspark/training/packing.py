"""Anchor-bounded packing: a fixed number of anchors per sequence, each a gamma-token block.

An anchor at position P (a response token, as at inference where the anchor is the target's last
sampled token) sees the target features of positions 0..P-1 and its own block only; block position
k (1..gamma) is trained to produce token P+k against p^t = softmax(lm_head(last[P+k-1])). The
blocks of one sequence share that sequence's context features (computed once); which key a query
may see is decided from token-level indices (sequence position vs the query's anchor, and the
query's block id), never from a per-block copy of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from dspark.training.features import Sequence


@dataclass
class PackedBatch:
    ctx_features: torch.Tensor  # [S, C, m*h] target features of positions 0..C-1
    ctx_tokens: torch.Tensor  # [S, C + 1] tokens 0..C (EAGLE-3 pairs feature i with token i+1)
    ctx_len: torch.Tensor  # [S] context entries actually present (max anchor of the sequence)
    anchor_pos: torch.Tensor  # [S, A] P; padding blocks have P = 0 and no valid position
    anchor_tokens: torch.Tensor  # [S, A]
    labels: torch.Tensor  # [S, A, G] tokens P+1..P+G (0 where invalid)
    valid: torch.Tensor  # [S, A, G] bool
    target_last: torch.Tensor  # [S, A, G, h] final hidden of positions P..P+G-1 (p^t = lm_head of it)
    domains: torch.Tensor  # [S]
    target_log_norm: torch.Tensor | None = None  # [S, A, G] their `Sequence.log_norm`, when set

    @property
    def block_positions(self) -> int:
        return int(self.valid.sum())

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return tensor.to(device, non_blocking=True) if tensor is not None else None


def sample_anchors(seq: Sequence, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchor positions P in [prompt_len, T-2] (at least one target token)."""
    first, last = seq.prompt_len, len(seq.tokens) - 2
    if last < first:
        return torch.empty(0, dtype=torch.long)
    candidates = torch.arange(first, last + 1)
    if len(candidates) <= count:
        return candidates
    pick = torch.randperm(len(candidates), generator=generator)[:count]
    return candidates[pick].sort().values


def pack(
    sequences: list[Sequence], anchors_per_sequence: int, block_size: int, generator: torch.Generator
) -> PackedBatch:
    """Pack the blocks of `sequences` (anchors drawn with `generator`) into dense per-sequence tensors."""
    anchors = [sample_anchors(s, anchors_per_sequence, generator) for s in sequences]
    n_seq, n_anchor, gamma = len(sequences), max(1, max(len(a) for a in anchors)), block_size
    ctx_lens = [int(a.max()) if len(a) else 0 for a in anchors]
    width = max(1, max(ctx_lens))
    feat_dim, hidden = sequences[0].features.shape[-1], sequences[0].last.shape[-1]
    # Token-level tensors are built on the host; the features stay where they are (the target's
    # device when computed online), gathered there with one index copy per sequence.
    device = sequences[0].features.device
    ctx_features = torch.zeros(n_seq, width, feat_dim, dtype=sequences[0].features.dtype, device=device)
    ctx_tokens = torch.zeros(n_seq, width + 1, dtype=torch.long)
    anchor_pos = torch.zeros(n_seq, n_anchor, dtype=torch.long)
    anchor_tokens = torch.zeros(n_seq, n_anchor, dtype=torch.long)
    labels = torch.zeros(n_seq, n_anchor, gamma, dtype=torch.long)
    valid = torch.zeros(n_seq, n_anchor, gamma, dtype=torch.bool)
    target_last = torch.zeros(n_seq, n_anchor, gamma, hidden, dtype=sequences[0].last.dtype, device=device)
    offsets = torch.arange(gamma)
    with_norm = all(seq.log_norm is not None for seq in sequences)
    log_norm = torch.zeros(n_seq, n_anchor, gamma, device=device) if with_norm else None
    for s, (seq, pos) in enumerate(zip(sequences, anchors, strict=True)):
        length = len(seq.tokens)
        c = ctx_lens[s]
        ctx_features[s, :c] = seq.features[:c]
        ctx_tokens[s, : c + 1] = seq.tokens[: c + 1]
        if not len(pos):
            continue
        a = len(pos)
        anchor_pos[s, :a] = pos
        anchor_tokens[s, :a] = seq.tokens[pos]
        targets = pos[:, None] + 1 + offsets  # [a, G] positions of the tokens to produce
        ok = targets < length
        labels[s, :a] = torch.where(ok, seq.tokens[targets.clamp(max=length - 1)], 0)
        valid[s, :a] = ok
        rows = (targets - 1).clamp(max=length - 1).to(device)
        ok_here = ok.to(device)
        target_last[s, :a] = seq.last[rows] * ok_here[..., None]
        if log_norm is not None:
            log_norm[s, :a] = seq.log_norm[rows] * ok_here
    return PackedBatch(
        ctx_features,
        ctx_tokens,
        torch.tensor(ctx_lens),
        anchor_pos,
        anchor_tokens,
        labels,
        valid,
        target_last,
        torch.tensor([seq.domain for seq in sequences]),
        log_norm,
    )


def block_attention_mask(batch: PackedBatch) -> torch.Tensor:
    """[S, A*G, C + A*G] bool: block query (anchor P, block b) sees context positions < P and the
    keys of its own block b (bidirectionally)."""
    n_seq, n_anchor, gamma = batch.valid.shape
    width, device = batch.ctx_features.shape[1], batch.valid.device
    q_anchor = batch.anchor_pos.repeat_interleave(gamma, dim=1)  # [S, Q]
    q_block = torch.arange(n_anchor, device=device).repeat_interleave(gamma)  # [Q]
    ctx = torch.arange(width, device=device)[None, None, :] < q_anchor[:, :, None]  # [S, Q, C]
    own = (q_block[:, None] == q_block[None, :]).expand(n_seq, -1, -1)  # [S, Q, Q]
    return torch.cat([ctx, own], dim=-1)
