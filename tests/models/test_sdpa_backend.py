"""Attention in the target and the drafters never runs on cuDNN's SDPA backend (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dspark.drafters.draft_attention import DraftAttention
from dspark.models.loader import load_target_model
from dspark.models.sdpa import folded_gqa_attention
from transformers import Qwen3Config

from tests.models.test_transformer_matches_hf import CPU, forward, new_cache


def record_cudnn_flag(monkeypatch) -> list[bool]:
    seen, real = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def test_target_attention_runs_without_cudnn(tiny_dirs, monkeypatch):
    model = load_target_model(tiny_dirs["llama"], torch.float32, CPU)
    seen = record_cudnn_flag(monkeypatch)
    forward(model, new_cache(model), [(0, 0, [1, 2, 3, 4, 5])])  # a prefill chunk
    forward(model, new_cache(model), [(1, 0, [7])])  # one request's decode
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored outside the forward


def test_draft_attention_runs_without_cudnn(monkeypatch):
    config = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    attention = DraftAttention(config)
    seen = record_cudnn_flag(monkeypatch)
    q, kv = torch.randn(2, 3, 4, 8), torch.randn(2, 5, 2, 8)
    out = attention.attend(q, kv, kv, torch.ones(2, 3, 5, dtype=torch.bool))
    assert out.shape == (2, 3, 32) and seen == [False]


@pytest.mark.parametrize("queries_in_mask", [4, 1])
def test_folded_gqa_attention_equals_sdpa_with_gqa(queries_in_mask):
    """What the GPU runs for masked GQA (memory-efficient kernel) gives SDPA's enable_gqa result."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 9, 4, 16), torch.randn(3, 3, 10, 16), torch.randn(3, 3, 10, 16)
    mask = torch.rand(3, 1, queries_in_mask, 10) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(folded_gqa_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)
