"""Rotary position embeddings, with transformers' implementations of the scaled RoPE variants."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dspark.models.config import head_dim


class RotaryEmbedding(torch.nn.Module):
    """cos/sin for arbitrary (ragged) position ids."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = head_dim(config)
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.scaling = 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
