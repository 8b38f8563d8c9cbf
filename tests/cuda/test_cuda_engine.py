"""The engine on a GPU: the same losslessness checks in CUDA fp32, and a bf16 run (GPU machines only)."""

from __future__ import annotations

import pytest
import torch
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (runs on GPU machines)"
)


def test_greedy_speculation_equals_plain_on_cuda(smollm_dir):
    plain = LLMEngine.from_config(EngineConfig(drafter="none", policy="none", dtype="float32", device="cuda"))
    prompts = [
        plain.tokenizer.encode(t) for t in ("def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,")
    ]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    spec = plain.sibling(NgramDrafter(7, device="cuda"), build_policy("static:5"))
    assert [r.token_ids for r in spec.generate(prompts, params)] == expected
    assert [spec.generate([p], params)[0].token_ids for p in prompts] == expected


def test_bf16_engine_generates_on_cuda(smollm_dir):
    engine = LLMEngine.from_config(EngineConfig(drafter="ngram", policy="static:4", device="cuda"))
    assert engine.dtype == torch.bfloat16
    result = engine.generate(
        [engine.tokenizer.encode("Hello")], SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    )[0]
    assert len(result.token_ids) > 0 and engine.cache.k.is_cuda


def test_sampled_decoding_runs_with_seeds_on_cuda(smollm_dir):
    engine = LLMEngine.from_config(EngineConfig(drafter="none", policy="none", device="cuda"))
    p = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    assert engine.generate([p], params)[0].token_ids == engine.generate([p], params)[0].token_ids


def test_bench_decode_runs_every_system_on_cuda(smollm_dir):
    from dspark.bench.decode import run_decode_bench

    config = EngineConfig(drafter="dspark", policy="dspark", device="cuda")
    results = run_decode_bench(config, {"code": ["def add(a, b):"]}, 16, 4, include_hf=False, repeats=1)
    assert {m.system for m in results} >= {"engine plain", "engine ngram (static:4)"} and len(results) == 3
    assert all(m.tokens > 0 for m in results)
