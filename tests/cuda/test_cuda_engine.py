"""The engine on a GPU: the same losslessness checks in CUDA fp32, and a bf16 run (GPU machines only)."""

from __future__ import annotations

import pytest
import torch
from dspark.builder import engine_from_config, sibling_engine
from dspark.drafters.ngram import NgramDrafter, NoDrafter
from dspark.engine import llm_engine
from dspark.engine.config import EngineConfig
from dspark.engine.sampling_params import SamplingParams
from dspark.models.sdpa import folded_gqa_attention
from dspark.models.static_batch import key_buckets
from dspark.policies.factory import build_policy
from dspark.profiling.synthetic import synthetic_profile
from torch.nn.attention import SDPBackend, sdpa_kernel

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)"
)


def test_greedy_speculation_equals_plain_on_cuda(smollm_dir):
    plain = engine_from_config(EngineConfig(drafter="none", policy="none", dtype="float32", device="cuda"))
    prompts = [
        plain.tokenizer.encode(t) for t in ("def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,")
    ]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    spec = sibling_engine(plain, NgramDrafter(7, device="cuda"), build_policy("static:5"))
    assert [r.token_ids for r in spec.generate(prompts, params)] == expected
    assert [spec.generate([p], params)[0].token_ids for p in prompts] == expected


def test_bf16_engine_generates_on_cuda(smollm_dir):
    engine = engine_from_config(EngineConfig(drafter="ngram", policy="static:4", device="cuda"))
    assert engine.dtype == torch.bfloat16
    result = engine.generate(
        [engine.tokenizer.encode("Hello")], SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    )[0]
    assert len(result.token_ids) > 0 and engine.cache.k.is_cuda


def test_sampled_decoding_runs_with_seeds_on_cuda(smollm_dir):
    engine = engine_from_config(EngineConfig(drafter="none", policy="none", device="cuda"))
    p = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    assert engine.generate([p], params)[0].token_ids == engine.generate([p], params)[0].token_ids


def test_bench_decode_runs_every_system_on_cuda(smollm_dir):
    from dspark.bench.decode import run_decode_bench

    config = EngineConfig(drafter="dspark", policy="dspark", device="cuda")
    results = run_decode_bench(config, {"code": ["def add(a, b):"]}, 16, 4, include_hf=False, repeats=1)
    assert {m.system for m in results} >= {"engine plain", "engine ngram (static:4)"} and len(results) == 3
    assert all(m.tokens > 0 for m in results)


@pytest.mark.parametrize("policy", ["full", "dspark", "dspark-async"])
def test_shipped_dspark_drafter_keeps_greedy_output_on_cuda(smollm_dir, policy):
    """The drafter's deferred context writes, the scheduler and the ragged verify on the GPU."""
    base = engine_from_config(EngineConfig(drafter="dspark", policy="none", dtype="float32", device="cuda"))
    texts = (
        "def fibonacci(n):",
        "Explain why the sky is blue in two sentences.",
        "12 * 7 =",
        "import numpy as np\n",
    )
    prompts = [base.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = [
        r.token_ids for r in sibling_engine(base, NoDrafter(), build_policy("none")).generate(prompts, params)
    ]
    spec = sibling_engine(
        base, base.drafter, build_policy(policy, sps=synthetic_profile(max_batch_tokens=512))
    )
    results = spec.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.draft_tokens for r in results) > 0


def test_masked_gqa_attention_runs_on_the_memory_efficient_kernel():
    """The math backend's host time per call made verification forwards slow (docs/gpu.md)."""
    q = torch.randn(4, 9, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, 3, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.rand(4, 1, 8, 300, device="cuda") < 0.7
    mask[..., 0] = True
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # raises if the kernel cannot take these inputs
        out = folded_gqa_attention(q, k, v, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_cuda_graph_steps_equal_eager_steps_on_cuda(smollm_dir, monkeypatch):
    """Captured decode, verification and DSpark propose graphs give the eager engine's greedy tokens,
    with batches inside and outside the buckets (2 of 3 requests fit (1, 2)) and contexts growing
    across key-length buckets (16, 32, 64, ...)."""
    monkeypatch.setattr(llm_engine, "key_buckets", lambda max_len: key_buckets(max_len, smallest=16))
    config = EngineConfig(
        drafter="dspark", policy="none", dtype="float32", device="cuda", max_num_seqs=3, cuda_graphs=False
    )
    eager = engine_from_config(config)
    prompts = [
        eager.tokenizer.encode(t) for t in ("def fibonacci(n):", "12 * 7 =", "The sky is blue because")
    ]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 24, 40)]
    for drafter, policy in ((NoDrafter(), "none"), (eager.drafter, "full")):
        off = sibling_engine(eager, drafter, build_policy(policy))
        # A drafter of its own: the graphs' engine gives it static shapes.
        on = sibling_engine(
            eager, drafter.fresh_copy(), build_policy(policy), cuda_graphs=True, cuda_graph_batch_sizes=(1, 2)
        )
        key_lens = on.static_runner.key_lens
        assert key_lens == key_buckets(on.max_model_len, smallest=16)
        assert on.static_runner.graphs.num_graphs == 2 * (2 if drafter.gamma else 1) * len(key_lens)
        expected = [r.token_ids for r in off.generate(prompts, params)]
        assert [r.token_ids for r in on.generate(prompts, params)] == expected
        assert on.static_runner.num_static_steps > 0
