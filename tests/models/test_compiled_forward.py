"""The compiled target forward (inductor, CPU) against the eager one: same logits, layer outputs,
KV writes and greedy tokens, and clear behaviour where it cannot or should not compile."""

from __future__ import annotations

import logging

import pytest
import torch
from dspark.drafters.ngram import NgramDrafter, NoDrafter
from dspark.engine.config import EngineConfig
from dspark.engine.model_runner import ModelRunner
from dspark.engine.request import Request
from dspark.engine.sampling_params import SamplingParams
from dspark.engine.scheduler import StepPlan
from dspark.models import compiled_forward
from dspark.models.compiled_forward import CompiledForward, compiled_or_eager
from dspark.models.config import head_dim
from dspark.models.kv_cache import KVCache
from dspark.models.loader import load_target_model
from dspark.models.packed_linear import PackedLinear

from tests.conftest import write_tiny_model
from tests.engine.helpers import engine_on
from tests.models.test_packed_linear import needs_bf16

CPU = torch.device("cpu")
SLOTS, MAX_LEN, VOCAB, LAYERS = 6, 96, 96, (0, 1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("compiled") / "qwen3", "qwen3", seed=5, vocab_size=VOCAB)


def _cache(model, dtype=torch.float32) -> KVCache:
    """Every slot filled with the same random K/V: the cached context."""
    c = model.config
    cache = KVCache(c.num_hidden_layers, SLOTS, MAX_LEN, c.num_key_value_heads, head_dim(c), dtype, CPU)
    gen = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def _steps() -> list[tuple[StepPlan, list[list[int]]]]:
    """One decode; scattered decodes with drafts of 0-4 tokens (verification); decodes beside
    prompt chunks of 40 tokens (attended alone) and 7 tokens, the short one not finishing its prompt."""
    gen = torch.Generator().manual_seed(1)

    def request(i: int, slot: int, cached: int, prompt_len: int | None = None) -> Request:
        tokens = torch.randint(VOCAB, (prompt_len or cached + 1,), generator=gen).tolist()
        return Request(f"r{i}", tokens, SamplingParams(temperature=0.0), slot=slot, num_cached=cached)

    def drafts(n: int) -> list[list[int]]:
        return [torch.randint(VOCAB, (int(torch.randint(5, (1,), generator=gen)),), generator=gen).tolist()]

    single = StepPlan(decodes=[request(0, 2, 30)])
    scattered = StepPlan(decodes=[request(1, 5, 50), request(2, 0, 11), request(3, 3, 70)])
    mixed = StepPlan(
        decodes=[request(4, 1, 20)], prefills=[(request(5, 4, 0, 40), 40), (request(6, 2, 0, 20), 7)]
    )
    return [
        (single, [[]]),
        (scattered, [d for _ in range(3) for d in drafts(1)]),
        (mixed, [[7, 8]]),
    ]


def _run_steps(forward, model, dtype=torch.float32) -> list:
    """Every step of `_steps`, without and with layer outputs; the outputs and the cache after each."""
    cache = _cache(model, dtype)
    runner, results = ModelRunner(forward, cache, CPU), []
    for layers in ((), LAYERS):
        for plan, drafts in _steps():
            step = runner.run(plan, drafts, layers)
            results.append((step, cache.k.clone(), cache.v.clone()))
    return results


def test_compiled_steps_equal_eager_steps_in_fp32(tiny_dir):
    model = load_target_model(tiny_dir, torch.float32, CPU)
    close = dict(atol=1e-4, rtol=1e-4)
    eager, compiled = _run_steps(model, model), _run_steps(CompiledForward(model), model)
    for (want, want_k, want_v), (got, got_k, got_v) in zip(eager, compiled, strict=True):
        assert got.offsets == want.offsets and got.logit_starts == want.logit_starts
        torch.testing.assert_close(got.output.logits, want.output.logits, **close)
        assert (got.output.layer_hidden is None) == (want.output.layer_hidden is None)
        if want.output.layer_hidden is not None:
            torch.testing.assert_close(got.output.layer_hidden, want.output.layer_hidden, **close)
        torch.testing.assert_close(got_k, want_k, **close)
        torch.testing.assert_close(got_v, want_v, **close)


@needs_bf16
def test_compiled_bf16_with_packed_linears_is_as_close_to_fp32_as_eager_bf16(tiny_dir):
    """Inductor keeps fused intermediates in fp32 where eager rounds each op to bf16, so the two
    bf16 forwards differ in the last bits; the compiled one must not be further from fp32."""
    bf16 = load_target_model(tiny_dir, torch.bfloat16, CPU)
    assert any(isinstance(m, PackedLinear) for m in bf16.modules())  # the opaque packed-matmul op is used
    fp32 = load_target_model(tiny_dir, torch.float32, CPU)
    reference = _run_steps(fp32, fp32)
    eager, compiled = (
        _run_steps(bf16, bf16, torch.bfloat16),
        _run_steps(CompiledForward(bf16), bf16, torch.bfloat16),
    )

    def error(outputs) -> float:  # mean absolute logit error over every step
        pairs = zip(outputs, reference, strict=True)
        return torch.cat(
            [(o.output.logits - r.output.logits).abs().flatten() for (o, *_), (r, *_) in pairs]
        ).mean()

    eager_error, compiled_error = error(eager), error(compiled)
    print(
        f"mean |logit error| against fp32: eager bf16 {eager_error:.4f}, compiled bf16 {compiled_error:.4f}"
    )
    assert 0 < compiled_error <= 1.25 * eager_error


def test_compiled_engine_decodes_and_speculates_greedily_as_the_eager_engine(tiny_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65], list(range(40, 80)), [2, 7, 1, 8, 2, 8, 1, 8]]

    def outputs(compile: bool, drafter) -> list[list[int]]:
        engine = engine_on(tiny_dir, drafter, "static:4" if drafter.gamma else "none", compile=compile)
        assert isinstance(engine.runner.forward, CompiledForward) == compile
        return [r.token_ids for r in engine.generate(prompts, params)]

    eager = outputs(False, NoDrafter())
    assert outputs(True, NoDrafter()) == eager
    assert outputs(True, NgramDrafter(4)) == eager


def test_compile_is_refused_on_cuda_and_follows_the_environment_by_default(monkeypatch):
    with pytest.raises(ValueError, match="compile applies to the CPU"):
        EngineConfig(compile=True).compiles(torch.device("cuda"))
    assert not EngineConfig().compiles(torch.device("cuda"))
    assert not EngineConfig(compile=False).compiles(CPU)
    monkeypatch.setenv("DSPARK_COMPILE", "0")
    assert not EngineConfig().compiles(CPU)
    monkeypatch.setenv("DSPARK_COMPILE", "1")
    assert EngineConfig().compiles(CPU)
    monkeypatch.delenv("DSPARK_COMPILE")
    assert EngineConfig().compiles(CPU)


def test_a_failed_compile_falls_back_to_eager_or_is_an_error_when_required(tiny_dir, monkeypatch, caplog):
    model = load_target_model(tiny_dir, torch.float32, CPU)

    def no_compiler(self, cache, hidden_layers):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled_forward.CompiledForward, "warm_up", no_compiler)
    with caplog.at_level(logging.WARNING, logger="dspark.models.compiled_forward"):
        assert compiled_or_eager(model, _cache(model), LAYERS, required=False) is model
    assert "running the target's forward eagerly: compiling it failed (InvalidCxxCompiler" in caplog.text
    with pytest.raises(ValueError, match="cannot compile the target's forward: InvalidCxxCompiler"):
        compiled_or_eager(model, _cache(model), LAYERS, required=True)


def test_warm_up_borrows_one_slot_and_returns_it(tiny_dir):
    model = load_target_model(tiny_dir, torch.float32, CPU)
    cache = _cache(model)
    free = cache.free_slots
    CompiledForward(model).warm_up(cache, LAYERS)
    assert cache.free_slots == free
