"""The padded static-shape step (what CUDA graphs replay) against the eager ragged step, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dspark.drafters.factory import load_drafter
from dspark.drafters.ngram import NgramDrafter, NoDrafter
from dspark.engine import llm_engine
from dspark.engine.drafter import Drafter
from dspark.engine.model_runner import ModelRunner
from dspark.engine.request import Request
from dspark.engine.sampling_params import SamplingParams
from dspark.engine.scheduler import StepPlan
from dspark.engine.static_runner import StaticStepRunner, step_activation_bytes
from dspark.models.config import head_dim, load_target_config
from dspark.models.cuda_graphs import check_graph_memory
from dspark.models.kv_cache import KVCache
from dspark.models.loader import load_target_model
from dspark.models.static_batch import DEFAULT_BATCH_BUCKETS, batch_buckets, bucket_for, key_buckets

from tests.conftest import write_tiny_model
from tests.drafters.helpers import FIXTURE
from tests.engine.helpers import engine_on

MAX_LEN, GAMMA, LAYERS = 96, 4, (0, 1)
KEY_LENS = key_buckets(MAX_LEN, smallest=24)  # 24, 48, 96
SLOTS = DEFAULT_BATCH_BUCKETS[-1]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("static") / "qwen3", "qwen3", seed=3, vocab_size=96)
    return path, load_target_model(path, torch.float32, CPU)


def _cache(model) -> KVCache:
    """Every slot (and the scratch slot, the last) filled with random K/V: the cached context."""
    c = model.config
    shape = (c.num_hidden_layers, SLOTS + 1, MAX_LEN, c.num_key_value_heads, head_dim(c))
    cache = KVCache(*shape, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def _step(
    num_requests: int, draft_len: int, seed: int, max_cached: int = MAX_LEN - GAMMA - 2
) -> tuple[StepPlan, list[list[int]]]:
    """Decodes on scattered slots at scattered positions up to max_cached, draft lengths
    0..draft_len per request."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(SLOTS, generator=gen)[:num_requests].tolist()
    requests, drafts = [], []
    for i, slot in enumerate(slots):
        cached = int(torch.randint(1, max_cached + 1, (1,), generator=gen))
        tokens = torch.randint(96, (cached + 1,), generator=gen).tolist()
        requests.append(
            Request(f"r{i}", tokens, SamplingParams(temperature=0.0), slot=slot, num_cached=cached)
        )
        n = draft_len if i == 0 else int(torch.randint(draft_len + 1, (1,), generator=gen))
        drafts.append(torch.randint(96, (n,), generator=gen).tolist())
    return StepPlan(decodes=requests), drafts


def _runner(model, cache, buckets=DEFAULT_BATCH_BUCKETS) -> StaticStepRunner:
    return StaticStepRunner(model, cache, SLOTS, buckets, (1, 1 + GAMMA), KEY_LENS, LAYERS, CPU)


def _assert_same_step(
    model, num_requests: int, draft_len: int, seed: int, max_cached: int = MAX_LEN - GAMMA - 2
) -> None:
    plan, drafts = _step(num_requests, draft_len, seed, max_cached)
    eager_cache, static_cache = _cache(model), _cache(model)
    eager = ModelRunner(model, eager_cache, CPU).run(plan, drafts, LAYERS)
    runner = _runner(model, static_cache)
    longest = max(r.num_cached + 1 + len(d) for r, d in zip(plan.decodes, drafts, strict=True))
    assert runner.bucket(plan, drafts)[2] == bucket_for(longest, KEY_LENS)  # the shortest that holds it
    static = runner.run(plan, drafts)
    assert static is not None
    assert static.offsets == eager.offsets and static.logit_starts == eager.logit_starts
    torch.testing.assert_close(static.output.logits, eager.output.logits, atol=2e-5, rtol=1e-5)
    assert torch.equal(static.output.logits.argmax(-1), eager.output.logits.argmax(-1))
    torch.testing.assert_close(static.output.layer_hidden, eager.output.layer_hidden, atol=2e-5, rtol=1e-5)
    # The requests' new K/V landed where the eager step puts them; padding touched only the scratch slot.
    torch.testing.assert_close(static_cache.k[:, :SLOTS], eager_cache.k[:, :SLOTS], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static_cache.v[:, :SLOTS], eager_cache.v[:, :SLOTS], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", DEFAULT_BATCH_BUCKETS)
@pytest.mark.parametrize("draft_len", [0, GAMMA], ids=["decode", "verify"])
def test_full_bucket_equals_eager(tiny, rows, draft_len):
    _assert_same_step(tiny[1], rows, draft_len, seed=rows)


@pytest.mark.parametrize("num_requests", [3, 5, 27, 100])
@pytest.mark.parametrize("draft_len", [0, 2, GAMMA], ids=["decode", "short-verify", "verify"])
def test_padded_bucket_equals_eager(tiny, num_requests, draft_len):
    """Padding rows (to the next bucket) and padding tokens (to 1 + gamma) change nothing real."""
    _assert_same_step(tiny[1], num_requests, draft_len, seed=1000 + num_requests)


@pytest.mark.parametrize("max_cached", [KEY_LENS[0] - 1 - GAMMA, KEY_LENS[1] - 1 - GAMMA, KEY_LENS[1]])
@pytest.mark.parametrize("draft_len", [0, GAMMA], ids=["decode", "verify"])
def test_every_key_length_bucket_equals_eager(tiny, max_cached, draft_len):
    """Steps whose contexts fit a shorter key-length bucket attend over that prefix of the cache only."""
    _assert_same_step(tiny[1], 5, draft_len, seed=7 * max_cached, max_cached=max_cached)


def test_key_buckets_double_up_to_max_len():
    assert key_buckets(2048) == (128, 256, 512, 1024, 2048)
    assert key_buckets(1000) == (128, 256, 512, 1000)
    assert key_buckets(96) == (96,)


def test_steps_outside_every_bucket_are_left_to_the_eager_runner(tiny):
    model = tiny[1]
    runner = _runner(model, _cache(model), buckets=(1, 2, 4))
    assert runner.run(*_step(5, GAMMA, seed=0)) is None  # more requests than the largest bucket
    plan, drafts = _step(2, GAMMA, seed=1)
    drafts[0] = drafts[0] + [1]  # longer than 1 + gamma tokens
    assert runner.run(plan, drafts) is None
    request = plan.decodes[0]
    assert runner.run(StepPlan(decodes=plan.decodes[1:], prefills=[(request, 4)]), drafts[1:]) is None
    assert runner.run(*_step(3, GAMMA, seed=2)) is not None


def test_buckets_are_capped_by_max_num_seqs():
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6, (1, 2, 4)) == (1, 2, 4)  # a batch of 5 or 6 runs eagerly
    assert bucket_for(9, (1, 8, 16)) == 16 and bucket_for(17, (1, 8, 16)) is None


def test_a_bucket_set_that_does_not_fit_is_refused_with_the_numbers(tiny):
    config = tiny[1].config
    need = step_activation_bytes(config, 4096, 33, 131072, 2, 3)
    with pytest.raises(ValueError, match=r"need about \d+\.\d\d GiB .* only 8\.00 GiB of device memory"):
        check_graph_memory(need, 8 * 2**30, "step buckets up to 4096 requests x 33 tokens")
    check_graph_memory(step_activation_bytes(config, 1, 1, 96, 4, 0), 8 * 2**30, "one bucket")


def _dspark(target_dir: Path) -> Drafter:
    config = load_target_config(target_dir)
    return load_drafter(str(FIXTURE / "draft_gated"), config)


@pytest.mark.parametrize(
    "drafter,policy,target",
    [
        (lambda _: NoDrafter(), "none", None),
        (lambda _: NgramDrafter(GAMMA), f"static:{GAMMA}", None),
        (_dspark, "static:5", FIXTURE / "target"),
    ],
    ids=["plain", "ngram", "dspark"],
)
def test_engine_generation_equals_eager(tiny, drafter, policy, target, monkeypatch):
    """Greedy generation with the static path forced on equals the eager engine's, including steps with
    prompt chunks, steps outside every bucket (5 and 6 running requests), which run eagerly, and
    contexts growing across key-length buckets."""
    monkeypatch.setattr(llm_engine, "key_buckets", lambda max_len: key_buckets(max_len, smallest=16))
    path = target or tiny[0]
    prompts = [[(7 * i + j) % 90 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    # Different lengths: the batch shrinks from 6 (eager) through 4..1 (buckets) as requests finish.
    params = [SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    results = {}
    for graphs in (False, True):
        engine = engine_on(
            path,
            drafter(path),
            policy,
            max_num_seqs=6,
            max_model_len=MAX_LEN,
            cuda_graphs=graphs,
            cuda_graph_batch_sizes=(1, 2, 4),
            prefix_caching=False,
        )
        assert (engine.static_runner is not None) == graphs
        assert not graphs or engine.static_runner.key_lens == (16, 32, 64, MAX_LEN)
        results[graphs] = [r.token_ids for r in engine.generate(prompts, params)]
        if graphs:
            assert engine.static_runner.num_static_steps > 0
    assert results[True] == results[False]
    assert [len(tokens) for tokens in results[True]] == [8 + 5 * i for i in range(6)]
