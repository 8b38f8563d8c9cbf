"""Rotary position embeddings for the target and the drafters, any rope type transformers knows."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dspark.models.config import head_dim


class RotaryEmbedding:
    """cos/sin tables for arbitrary (ragged, per-request) position ids.

    Frequencies stay float32 outside any module's buffers, so casting a model to bf16 never rounds
    them; they are built on the CPU even under a meta-device context and follow the positions'
    device.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = head_dim(config)
            steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
            inv_freq, scaling = 1.0 / (base ** (steps / dim)), 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        self._inv_freq = inv_freq.float()
        self._scaling = float(scaling)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> (cos, sin) [..., 1, head_dim] in `dtype`, for `apply_rotary`.

        The head axis is already there to broadcast over, and sin's first half is negated: that
        sign is rotate_half's, moved into the table once per forward instead of once per layer.
        """
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[..., None, None].float() * self._inv_freq
        cos, sin = freqs.cos() * self._scaling, freqs.sin() * self._scaling
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., heads, head_dim] by tables from `RotaryEmbedding`.

    Bit for bit transformers' `x * cos + rotate_half(x) * sin`: rotate_half(x) is roll(x, half)
    with the first half negated, and that negation lives in the table. Four kernels instead of
    nine, and this runs on every layer's queries and keys.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
