"""Serving at once: the eager forward steps while the compiled forward and the attention kernel are
built in the background; switching between steps changes no output, and no step compiles after it."""

from __future__ import annotations

import threading

import pytest
import torch
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.sampling_params import SamplingParams
from dspark.models import cpu_attention
from dspark.models.background_build import BackgroundBuild
from dspark.models.compiled_forward import CompiledForward, forward_kind
from dspark.models.config import head_dim
from dspark.models.forward_batch import ForwardBatch
from dspark.models.kv_cache import KVCache
from dspark.models.loader import load_target_model
from torch._dynamo.utils import counters

from tests.conftest import write_tiny_model
from tests.engine.helpers import engine_on

CPU = torch.device("cpu")
VOCAB = 96
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 80)), [2, 7, 1, 8, 2, 8, 1, 8]]


class LayerReadingNgram(NgramDrafter):
    """n-gram drafts that take two target layers' outputs, as model drafters do: steps then run the
    forward's every-layer graphs as well as its logits-only ones."""

    target_layers = (0, 1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("background") / "qwen3", "qwen3", seed=5, vocab_size=VOCAB
    )


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv("DSPARK_COMPILE", "1")  # the suite runs eagerly by default


@pytest.fixture
def held_compile(monkeypatch) -> threading.Event:
    """Hold the background compile until the test sets the returned event."""
    gate, original = threading.Event(), BackgroundBuild._compiled_forward

    def held(self):
        gate.wait(600)
        return original(self)

    monkeypatch.setattr(BackgroundBuild, "_compiled_forward", held)
    return gate


def test_switching_to_the_compiled_forward_mid_stream_keeps_greedy_outputs(tiny_dir, compiling, held_compile):
    eager = engine_on(tiny_dir, LayerReadingNgram(4), "static:4", compile=False)
    expected = [r.token_ids for r in eager.generate(PROMPTS, GREEDY)]

    engine = engine_on(tiny_dir, LayerReadingNgram(4), "static:4", build_in_background=True)
    requests = [engine.requests[engine.add_request(p, GREEDY)] for p in PROMPTS]
    for _ in range(4):
        engine.step()
    assert forward_kind(engine.runner.forward) == "eager"
    assert all(0 < len(r.output_token_ids) < GREEDY.max_tokens for r in requests)  # mid-stream

    held_compile.set()
    assert engine.wait_for_background_build(600)
    assert forward_kind(engine.runner.forward) == "compiled" and engine.background is None
    assert cpu_attention.short_attention_kernel() is not None, "the kernel must build where the suite runs"
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected


def test_no_step_compiles_after_the_switch(tiny_dir, compiling, monkeypatch):
    """Unfrozen, a shape class the warm-up missed would compile in a step; it must miss none: decodes,
    verification of every width, prompt chunks ending anywhere, prefix hits, greedy and sampled."""
    monkeypatch.setattr(CompiledForward, "freeze", lambda self: None)
    engine = engine_on(
        tiny_dir, LayerReadingNgram(4), "static:4", build_in_background=True, max_batch_tokens=16
    )
    assert engine.wait_for_background_build(600)
    assert forward_kind(engine.runner.forward) == "compiled"
    graphs = counters["stats"]["unique_graphs"]

    prompts = [[5], *PROMPTS, PROMPTS[1] + [9, 9, 9], list(range(1, 34))]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=1)
    engine.generate(prompts, [GREEDY, sampled] * 3)
    engine.generate(prompts[1:3], SamplingParams(temperature=0.0, max_tokens=1))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_frozen_forward_runs_a_shape_it_never_compiled_eagerly(tiny_dir, compiling):
    model = load_target_model(tiny_dir, torch.float32, CPU)
    c = model.config
    cache = KVCache(c.num_hidden_layers, 2, 32, c.num_key_value_heads, head_dim(c), torch.float32, CPU)
    compiled = CompiledForward(model)
    compiled.warm_up(cache, ())  # no every-layer graph
    graphs = counters["stats"]["unique_graphs"]

    tokens = torch.tensor([4, 8, 15], dtype=torch.int64)
    batch = ForwardBatch.build([0], [0], [3], [0, 1, 2], CPU)
    got = compiled(tokens, batch, cache, hidden_layers=(0, 1))
    assert counters["stats"]["unique_graphs"] == graphs
    want = model(tokens, batch, cache, (0, 1))
    # Attention may take another path than the eager model's (the short-row kernel takes head dim 8
    # where it is built for 256-bit vectors): equal within fp32 rounding, as the compiled forward.
    close = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.logits, want.logits, **close)
    torch.testing.assert_close(got.layer_hidden, want.layer_hidden, **close)
