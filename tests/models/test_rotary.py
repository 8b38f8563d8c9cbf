"""Rotary embedding: the sign-folded tables against transformers' formulation."""

from __future__ import annotations

import pytest
import torch
from dspark.models.rotary import RotaryEmbedding, apply_rotary
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rope",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotation_is_bit_identical_to_transformers(dtype, rope):
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    if rope is not None:
        config.rope_parameters = {**rope, "rope_theta": 10000.0}
    positions = torch.tensor([0, 3, 7, 120, 4000])
    q = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    k = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    cos, sin = RotaryEmbedding(config)(positions, dtype)
    assert torch.equal(apply_rotary(q, cos, sin), want_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), want_k[0].transpose(0, 1))
    assert not torch.equal(apply_rotary(q, cos, sin), q)


def test_tables_broadcast_over_heads_for_any_position_shape():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cos, sin = RotaryEmbedding(config)(torch.arange(6).view(2, 3), torch.float32)
    assert cos.shape == sin.shape == (2, 3, 1, 16)
    assert torch.equal(sin[..., :8], -sin[..., 8:])
