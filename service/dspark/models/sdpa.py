"""Scaled dot-product attention for the target and the drafters: kept off cuDNN's backend, and
off the math backend where a mask and grouped-query attention meet on a GPU; short rows on the
CPU run the kernel of `cpu_attention`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dspark.models.cpu_attention import short_attention

# cuDNN's SDPA plans every new shape on the host: 2-4 ms a call on an H200 (docs/gpu.md), against
# about 30 us of GPU work. Decode and verification shapes change every step as contexts grow, so a
# plan is never reused; the other backends launch at once.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def without_cudnn_attention():
    """A context in which `F.scaled_dot_product_attention` never picks the cuDNN backend."""
    return sdpa_kernel(_BACKENDS)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """GQA attention: q [B, H, n, hd], k/v [B, KVH, L, hd], mask [B, 1, n or 1, L] (True = attend).

    On the CPU, rows of up to `cpu_attention.MAX_QUERY_ROWS` queries (decode, short verification
    blocks) go to the short-row kernel, which is about twice as fast as SDPA for one row.

    With a mask on a GPU the query heads that share a KV head are folded into the query axis:
    SDPA's memory-efficient kernel takes masks but not GQA, so `enable_gqa` with a mask falls back
    to the math backend, a dozen kernels and about 0.35 ms of host time a call on an H200
    (docs/gpu.md), 30 calls a verification forward.
    """
    if mask is not None and q.is_cuda and q.shape[1] != k.shape[1]:
        return folded_gqa_attention(q, k, v, mask)
    if not is_causal:
        out = short_attention(q, k, v, mask)
        if out is not None:
            return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)


def fold_query_heads(
    q: torch.Tensor, mask: torch.Tensor | None, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, H, n, hd] and mask [B, 1, n or 1, L] as [B, KVH, group * n, hd] and [B, 1, group * n, L]:
    each KV head's query heads stacked along the query axis (query head h reads kv head h // group,
    as enable_gqa does), so plain attention over the KV heads computes GQA."""
    rows, heads, n, hd = q.shape
    group = heads // kv_heads
    if mask is not None:
        mask = mask.expand(rows, 1, n, mask.shape[-1]).repeat(1, 1, group, 1)
    return q.reshape(rows, kv_heads, group * n, hd), mask


def folded_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Masked GQA attention as SDPA over folded query heads (`fold_query_heads`; the same result)."""
    queries, mask = fold_query_heads(q, mask, k.shape[1])
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask)
    return out.reshape(q.shape)  # the memory-efficient kernel returns it sequence-major
