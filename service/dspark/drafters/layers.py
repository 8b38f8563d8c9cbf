"""Qwen3-style building blocks shared by the drafters: the decoder MLP and norms.

They come from transformers so the arithmetic (fp32 RMS, SwiGLU) is bit-for-bit the target's.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

__all__ = ["Qwen3MLP", "Qwen3RMSNorm"]


def make_mlp(config: PretrainedConfig) -> nn.Module:
    return Qwen3MLP(config)
