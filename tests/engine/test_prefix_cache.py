"""Automatic prefix caching: reused KV gives exactly the outputs a full prefill gives, in every way a
cached prefix can be reached (a finished request's slot taken over, a copy out of a running slot)
and lost (its slot reused), under speculation that rolls back rejected tokens."""

from __future__ import annotations

import pytest
import torch
from dspark.drafters.ngram import NoDrafter
from dspark.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from dspark.engine.request import Request
from dspark.engine.sampling_params import SamplingParams
from dspark.models.kv_cache import KVCache

from tests.engine.helpers import ScriptedDrafter, engine_on
from tests.engine.test_engine_lossless import TINY_VOCAB, analytic_marginals, tiny8  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompt(seed: int, length: int, vocab: int = 64) -> list[int]:
    return torch.randint(vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompt: list[int], params: SamplingParams = GREEDY) -> Request:
    rid = engine.add_request(prompt, params)
    request = engine.requests[rid]
    engine.step()
    request.admission_stats = engine.last_step_stats
    while rid in engine.requests:
        engine.step()
    return request


class _Limited(NoDrafter):
    def __init__(self, limit: int | None) -> None:
        self.limit = limit

    def context_limit(self, slot: int) -> int | None:
        return self.limit


def _index(limit: int | None = None) -> PrefixCache:
    kv = KVCache(1, 4, 64, 1, 2, torch.float32, torch.device("cpu"))
    return PrefixCache(kv, _Limited(limit))


def test_index_finds_the_longest_whole_block_prefix():
    cache = _index()
    held = Request("a", list(range(40)), GREEDY, slot=3, num_cached=40)
    cache.update(held)
    hit = cache.lookup(list(range(40)) + [7])
    assert hit is not None and (hit.holder, hit.length) == (3, 32)  # whole blocks only
    # The last prompt token is always left to compute: 32 tokens match, but only 16 may be reused.
    assert cache.lookup(list(range(32))).length == 16
    assert cache.lookup([1] + list(range(1, 40))) is None
    cache.truncate(3, 16)
    assert cache.lookup(list(range(40))).length == 16
    # A drafter holding less context of the slot caps the hit.
    limited = _index(limit=20)
    limited.update(held)
    assert limited.lookup(list(range(40))).length == 16


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return tiny_dirs["llama"]


def test_multi_turn_takes_over_the_finished_slot(tiny):
    cached = engine_on(tiny, NoDrafter(), "none", max_num_seqs=2)
    plain = engine_on(tiny, NoDrafter(), "none", max_num_seqs=2, prefix_caching=False)
    prompt, last_slot = _prompt(0, 40), None
    for turn in range(3):
        got, want = _run(cached, prompt), _run(plain, prompt)
        assert got.output_token_ids == want.output_token_ids
        # Turns after the first: the previous turn's slot holds this prompt up to the new message
        # (all but the answer's last token, which was never fed to the target).
        reusable = (len(prompt) - 5 - 1) // BLOCK_SIZE * BLOCK_SIZE if turn else 0
        assert got.stats.cached_tokens == reusable
        assert (got.prefix_source[0] if turn else None) == last_slot
        assert got.admission_stats.prefix_cache_queries == len(prompt)
        assert got.admission_stats.prefix_cache_hits == reusable
        assert got.admission_stats.num_prefill_tokens == len(prompt) - reusable
        last_slot = cached.cache._free[-1]  # the slot this turn left behind (the last freed one)
        prompt = prompt + got.output_token_ids + _prompt(turn + 1, 5)


def test_prefix_copied_from_a_running_request_and_its_slot_reused_midway(tiny):
    """B copies A's prefix while A runs; A ends and its slot goes to C (overwriting it) while B still
    decodes: B's output is its plain one."""
    cached = engine_on(tiny, NoDrafter(), "none", max_num_seqs=2)
    plain = engine_on(tiny, NoDrafter(), "none", max_num_seqs=2, prefix_caching=False)
    shared = _prompt(1, 48)
    a_prompt, b_prompt, c_prompt = shared + [1, 2], shared + [3, 4, 5], _prompt(2, 30)
    a = cached.requests[cached.add_request(a_prompt, SamplingParams(temperature=0.0, max_tokens=3))]
    cached.step()  # A prefilled
    a_slot = a.slot
    b = cached.requests[cached.add_request(b_prompt, SamplingParams(temperature=0.0, max_tokens=20))]
    cached.step()
    assert b.stats.cached_tokens == 48 and b.prefix_source[0] != b.slot
    while a.request_id in cached.requests:
        cached.step()
    c = cached.requests[cached.add_request(c_prompt, GREEDY)]
    cached.step()
    assert c.slot == a_slot and c.stats.cached_tokens == 0
    while cached.has_unfinished_requests():
        cached.step()
    for request, prompt in ((a, a_prompt), (b, b_prompt), (c, c_prompt)):
        assert request.output_token_ids == _run(plain, prompt, request.params).output_token_ids


@pytest.mark.parametrize("store_gib", [0.0, 0.01])
def test_prefix_pushed_out_of_the_slots_lives_on_in_the_store(tiny, store_gib):
    cached = engine_on(tiny, NoDrafter(), "none", max_num_seqs=2, prefix_cache_gib=store_gib)
    prompt = _prompt(3, 40)
    first = _run(cached, prompt)
    # Two other requests take both slots: the least recently used one (holding `prompt`) last.
    _run(cached, _prompt(4, 20))
    cached.generate([_prompt(5, 20), _prompt(6, 20)], GREEDY)
    again = _run(cached, prompt)
    if store_gib:  # the whole prompt was stored, and comes back from the store
        assert again.stats.cached_tokens == 32 and again.prefix_source[0] == ("stored", 0)
    else:
        assert again.stats.cached_tokens == 0
    assert again.output_token_ids == first.output_token_ids


def test_rejected_draft_tokens_never_corrupt_a_block_another_request_reads(tiny):
    """A speculates with many rejections (its rolled-back tokens sit in its slot past num_cached)
    while new requests copy or take over its cached prefix at every step: all outputs are plain."""
    plain = engine_on(tiny, NoDrafter(), "none", max_num_seqs=8, prefix_caching=False)
    base = _prompt(7, 33)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    reference = _run(plain, base, long).output_token_ids
    vocab = plain.model.config.vocab_size
    drafter = ScriptedDrafter(4, {tuple(base): reference}, corrupt=0.5, vocab=vocab)
    cached = engine_on(tiny, drafter, "static:4", max_num_seqs=8)
    a = cached.requests[cached.add_request(base, long)]
    readers, step = [], 0
    while a.request_id in cached.requests:
        cached.step()
        step += 1
        if step % 3 == 0 and len(a.output_token_ids) > 1:  # prompt + some output + a new tail
            prompt = base + a.output_token_ids[:-1] + [step % vocab]
            readers.append((prompt, cached.requests[cached.add_request(prompt, GREEDY)]))
    while cached.has_unfinished_requests():
        cached.step()
    assert a.output_token_ids == reference
    assert a.stats.accepted_tokens < a.stats.draft_tokens  # rollbacks happened
    assert sum(r.stats.cached_tokens > len(base) for _, r in readers) >= 2
    for prompt, request in readers:
        assert request.output_token_ids == _run(plain, prompt).output_token_ids


def test_sampled_outputs_with_cache_hits_follow_the_target_distribution(tiny8):  # noqa: F811
    """Most requests start from a cached prefix (a finished slot taken over or a running one
    copied): their sampled outputs follow the target's distribution exactly."""
    from tests.engine.helpers import DistributionDrafter

    path, hf = tiny8
    prompt = _prompt(8, 20, TINY_VOCAB)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    exact = analytic_marginals(hf, prompt, params)
    n = 36_000  # as the lossless tests: E[TV] <= 0.0075 for V = 8
    engine = engine_on(
        path,
        DistributionDrafter(torch.stack([exact[1], exact[2]]).log()),
        "static:2",
        max_num_seqs=256,
        max_batch_tokens=2048,
    )
    ids = [engine.add_request(prompt, params) for _ in range(n)]
    tracked = [engine.requests[i] for i in ids]
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(r.stats.cached_tokens == 16 for r in tracked) > 0.9 * n
    tokens = torch.tensor([r.output_token_ids for r in tracked])
    for k in range(3):
        counts = torch.bincount(tokens[:, k], minlength=TINY_VOCAB).float()
        tv = 0.5 * (counts / n - exact[k]).abs().sum().item()
        assert tv < 0.01, f"output token {k}: TV {tv:.4f}"


def test_no_prefix_caching_turns_it_off_everywhere(tiny, monkeypatch):
    from click.testing import CliRunner
    from dspark.cli import main

    off = engine_on(tiny, NoDrafter(), "none", prefix_caching=False)
    prompt = _prompt(9, 40)
    _run(off, prompt)
    again = _run(off, prompt)
    assert again.stats.cached_tokens == 0 and again.admission_stats.prefix_cache_queries == 0
    for flags, shown in (([], "prefix_caching: true"), (["--no-prefix-caching"], "prefix_caching: false")):
        result = CliRunner().invoke(main, ["serve", "--print-config", *flags])
        assert result.exit_code == 0, result.output
        assert shown in result.output
    monkeypatch.setenv("DSPARK_PREFIX_CACHING", "false")
    assert "prefix_caching: false" in CliRunner().invoke(main, ["serve", "--print-config"]).output


def test_prefix_cache_counters_follow_the_step_stats():
    from dspark.engine.outputs import StepStats
    from dspark.serving.metrics import ServingMetrics

    metrics = ServingMetrics("m")
    metrics.observe_step(StepStats(prefix_cache_queries=50, prefix_cache_hits=32))
    metrics.observe_step(StepStats(prefix_cache_queries=20, prefix_cache_hits=0))
    text = metrics.render().decode()
    assert 'vllm:prefix_cache_queries_total{model_name="m"} 70.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 32.0' in text
