"""A decode / verification step padded to a fixed [rows, width] shape, for CUDA-graph replay.

Every tensor is a view of a static buffer, so one captured graph serves every step of its bucket:
padding tokens write their K/V to a scratch slot and their outputs are dropped, and each row
attends over the first `key_len` entries of its slot (a key-length bucket at or above the
batch's longest context) under a mask built inside the graph from the positions, so no shape
depends on the step's own context lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.models.sdpa import attention

# Request-count buckets; the step of R requests is padded to the smallest bucket >= R.
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The shortest key-length bucket. Attention in a padded step reads every key of its bucket, so
# buckets doubling up to max_len keep that read within 2x of the longest context, not max_len.
MIN_KEY_BUCKET = 128


@dataclass
class PaddedBatch:
    """`rows` requests x `width` tokens, flattened row-major; the model's `logit_rows` is every token."""

    rows: int
    width: int
    positions: torch.Tensor  # [rows * width] int64; padding tokens: 0
    token_slots: torch.Tensor  # [rows * width] int64; padding tokens: the scratch slot
    row_slots: torch.Tensor  # [rows] int64; padding rows: the scratch slot
    scratch_slot: int  # a KV slot no request owns
    key_len: int
    logit_rows: slice = field(default_factory=lambda: slice(None))
    mask: torch.Tensor | None = None  # [rows, 1, width, key_len], from `with_mask`

    def with_mask(self) -> PaddedBatch:
        """Real queries see keys up to their own position; padding queries see key 0 only, so no
        softmax row is empty. Built from the buffers, so it is part of the captured graph."""
        keys = torch.arange(self.key_len, device=self.positions.device)
        pos = self.positions.view(self.rows, self.width, 1)
        valid = (self.token_slots != self.scratch_slot).view(self.rows, self.width, 1)
        self.mask = torch.where(valid, keys <= pos, keys == 0)[:, None]
        return self


def attend_padded(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PaddedBatch
) -> torch.Tensor:
    """q [rows * width, H, hd] -> [rows * width, H, hd]: one masked SDPA over the rows' gathered slots."""
    queries = q.view(batch.rows, batch.width, *q.shape[1:]).transpose(1, 2)
    # Sliced before the gather, so only the bucket's keys are copied: [rows, KVH, key_len, hd].
    keys = k_cache[:, :, : batch.key_len][batch.row_slots]
    values = v_cache[:, :, : batch.key_len][batch.row_slots]
    out = attention(queries, keys, values, batch.mask)
    return out.transpose(1, 2).reshape(q.shape)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None when n exceeds every bucket."""
    return next((b for b in buckets if b >= n), None)


def key_buckets(max_len: int, smallest: int = MIN_KEY_BUCKET) -> tuple[int, ...]:
    """Key-length (context) buckets: powers of two from `smallest` below max_len, then max_len."""
    buckets = []
    while smallest < max_len:
        buckets.append(smallest)
        smallest *= 2
    return (*buckets, max_len)


def batch_buckets(max_num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS) -> tuple[int, ...]:
    """The buckets below max_num_seqs; buckets at or above it become max_num_seqs itself, so a full
    batch is padded no further than the cache's slots."""
    kept = {b for b in buckets if b < max_num_seqs}
    if max(buckets) >= max_num_seqs:
        kept.add(max_num_seqs)
    return tuple(sorted(kept))
