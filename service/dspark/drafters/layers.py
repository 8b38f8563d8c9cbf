"""The drafters' decoder MLP: transformers' Qwen3 SwiGLU, so the arithmetic is the target's."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP


def make_mlp(config: PretrainedConfig) -> nn.Module:
    return Qwen3MLP(config)
