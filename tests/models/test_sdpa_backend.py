"""Attention in the target and the drafters never runs on cuDNN's SDPA backend (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dspark.drafters.draft_attention import DraftAttention
from dspark.models import sdpa
from dspark.models.cpu_attention import DecodeAttention, short_attention_kernel
from dspark.models.loader import load_target_model
from dspark.models.sdpa import folded_gqa_attention
from transformers import Qwen3Config

from tests.models.test_transformer_matches_hf import CPU, forward, new_cache


@pytest.fixture(params=["kernel", "sdpa"])
def cpu_attention_path(request, monkeypatch) -> str:
    """Each test runs on both CPU attention paths: the short-row kernel where it builds and takes
    the head dim (AVX2 builds take head dim 8, AVX-512 ones do not), and SDPA forced."""
    monkeypatch.setenv("DSPARK_CPU_ATTENTION", request.param)
    short_attention_kernel.cache_clear()
    yield request.param
    short_attention_kernel.cache_clear()


def record_cudnn_flag(monkeypatch) -> list[bool]:
    """The cuDNN SDPA flag at every attention call, whichever backend the rows take: SDPA itself,
    the short-row kernel and the one-call decode path."""
    seen = []

    def recording(real):
        def call(*args, **kwargs):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording(F.scaled_dot_product_attention))
    monkeypatch.setattr(sdpa, "short_attention", recording(sdpa.short_attention))
    monkeypatch.setattr(DecodeAttention, "__call__", recording(DecodeAttention.__call__))
    return seen


def test_target_attention_runs_without_cudnn(tiny_dirs, monkeypatch, cpu_attention_path):
    model = load_target_model(tiny_dirs["llama"], torch.float32, CPU)
    seen = record_cudnn_flag(monkeypatch)
    forward(model, new_cache(model), [(0, 0, [1, 2, 3, 4, 5])])  # a prefill chunk
    forward(model, new_cache(model), [(1, 0, [7])])  # one request's decode
    assert len(seen) >= 2 and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored outside the forward


def test_draft_attention_runs_without_cudnn(monkeypatch, cpu_attention_path):
    config = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    attention = DraftAttention(config)
    seen = record_cudnn_flag(monkeypatch)
    q, kv = torch.randn(2, 3, 4, 8), torch.randn(2, 5, 2, 8)
    out = attention.attend(q, kv, kv, torch.ones(2, 3, 5, dtype=torch.bool))
    assert out.shape == (2, 3, 32) and seen and not any(seen)


def test_forced_sdpa_path_calls_sdpa(tiny_dirs, monkeypatch):
    """`DSPARK_CPU_ATTENTION=sdpa` reaches SDPA for decode rows too, so the tests above cover it."""
    monkeypatch.setenv("DSPARK_CPU_ATTENTION", "sdpa")
    short_attention_kernel.cache_clear()
    calls, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = load_target_model(tiny_dirs["llama"], torch.float32, CPU)
    forward(model, new_cache(model), [(1, 0, [7])])
    short_attention_kernel.cache_clear()
    assert len(calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("queries_in_mask", [4, 1])
def test_folded_gqa_attention_equals_sdpa_with_gqa(queries_in_mask):
    """What the GPU runs for masked GQA (memory-efficient kernel) gives SDPA's enable_gqa result."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 9, 4, 16), torch.randn(3, 3, 10, 16), torch.randn(3, 3, 10, 16)
    mask = torch.rand(3, 1, queries_in_mask, 10) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(folded_gqa_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)
