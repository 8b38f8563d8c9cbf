"""Qwen3 attention (GQA, q_norm/k_norm) split into query / key-value / attend steps.

Drafters need the pieces separately: DSpark computes context keys/values from projected target
features once per committed token and caches them, then attends block queries over
[cached context ; block]. Tensors are sequence-major: [batch, seq, heads, head_dim].
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from dspark.models.norm import RMSNorm
from dspark.models.rotary import apply_rotary
from dspark.models.sdpa import attention, without_cudnn_attention


class DraftAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, input_size: int | None = None, qk_norm: bool = True) -> None:
        super().__init__()
        d_in = input_size or config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(d_in, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else nn.Identity()

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., S, d_in] -> rotated queries [..., S, H, hd]."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        return apply_rotary(self.q_norm(q), cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., S, d_in] -> rotated keys and values [..., S, KVH, hd]."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rotary(self.k_norm(k), cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Q, H, hd], k/v [B, S, KVH, hd], mask [B, Q or 1, S] (True = attend) -> [B, Q, d]."""
        with without_cudnn_attention():
            out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None])
        return self.o_proj(out.transpose(1, 2).flatten(-2))
