"""Qwen3-style building blocks shared by the drafters: rotary positions and the decoder MLP/norms.

Norm and MLP come from transformers so the arithmetic (fp32 RMS, SwiGLU) is bit-for-bit the
target's; rotary frequencies use transformers' rope initialisers but are kept in float32 outside
the module's buffers, so casting the drafter to bf16 never rounds them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

__all__ = ["Qwen3MLP", "Qwen3RMSNorm", "RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding:
    """cos/sin tables for arbitrary (per-request) position ids, any rope type transformers knows."""

    def __init__(self, config: PretrainedConfig) -> None:
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
            inv_freq = 1.0 / (base ** (steps / dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        # Built on the CPU even under a meta-device context; moved lazily to the positions' device.
        self._inv_freq = inv_freq.float()
        self._scaling = float(scaling)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int -> (cos, sin) [..., head_dim] in `dtype`."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._scaling).to(dtype), (emb.sin() * self._scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., seq, heads, head_dim] with cos/sin [..., seq, head_dim]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def make_mlp(config: PretrainedConfig) -> nn.Module:
    return Qwen3MLP(config)
