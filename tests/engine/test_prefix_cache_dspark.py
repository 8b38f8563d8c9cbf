"""Prefix caching on the real target with the shipped DSpark drafter: multi-turn greedy output is
the uncached one, and the drafter's context of cache-hit tokens is right (its acceptance does not
collapse on hits, the failure vLLM #47930 describes)."""

from __future__ import annotations

import pytest
from dspark.builder import sibling_engine
from dspark.drafters.context_store import ContextStore
from dspark.drafters.ngram import NoDrafter
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy
from dspark.prompts.builtin import BUILTIN_PROMPTS
from transformers import AutoTokenizer

from tests.engine.helpers import engine_on, shipped_dspark_drafter

SYSTEM = (
    "You are a careful assistant for a software team. Answer briefly, give code when it helps, "
    "and explain the reasoning behind each step in plain words."
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def setup(smollm_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    plain = engine_on(smollm_dir, NoDrafter(), "none", tokenizer, max_num_seqs=4, prefix_caching=False)
    drafter = shipped_dspark_drafter(plain)
    return plain, drafter, tokenizer


def _chat(tokenizer, messages) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def test_multi_turn_greedy_output_is_the_uncached_one(setup):
    plain, drafter, tokenizer = setup
    cached = sibling_engine(plain, drafter.fresh_copy(), build_policy("static:4"), prefix_caching=True)
    questions = BUILTIN_PROMPTS["code"][:2] + BUILTIN_PROMPTS["chat"][:1]
    follow_ups = ["Make it shorter.", "Now explain why."]
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    hits = 0
    for turn in range(1 + len(follow_ups)):
        prompts = [_chat(tokenizer, c) for c in chats]
        want = plain.generate(prompts, GREEDY)
        got = cached.generate(prompts, GREEDY)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        hits += sum(r.stats.cached_tokens for r in got)
        for chat, result in zip(chats, got, strict=True):
            chat.append({"role": "assistant", "content": result.text})
            if turn < len(follow_ups):
                chat.append({"role": "user", "content": follow_ups[turn]})
    assert hits > 0 and sum(r.stats.draft_tokens for r in got) > 0


def _tau(results) -> float:
    return 1 + sum(r.stats.accepted_tokens for r in results) / sum(r.stats.rounds for r in results)


PASSAGES = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden porch "
    "and drinks his coffee slowly.",
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3), mul(4, 5))",
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen as a "
    "by-product of splitting water.",
]
TAU_PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tau_setup(setup):
    """Prompts with a long shared prefix, and tau over them without prefix caching (all misses)."""
    plain, drafter, tokenizer = setup
    ask = "Repeat this text exactly, word for word:\n\n"
    prompts = [
        _chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask + t}])
        for t in PASSAGES
    ]
    uncached = sibling_engine(plain, drafter.fresh_copy(), build_policy("full"), prefix_caching=False)
    miss = [uncached.generate([p], TAU_PARAMS)[0] for p in prompts]
    return prompts, miss


def _tau_on_hits(setup, tau_setup) -> float:
    """tau over each prompt's second run with prefix caching (its first run left it cached)."""
    plain, drafter, _ = setup
    prompts, miss = tau_setup
    cached = sibling_engine(plain, drafter.fresh_copy(), build_policy("full"), prefix_caching=True)
    hit = []
    for prompt in prompts:
        cached.generate([prompt], TAU_PARAMS)
        hit += cached.generate([prompt], TAU_PARAMS)
    assert all(r.stats.cached_tokens == (len(p) - 1) // 16 * 16 for r, p in zip(hit, prompts, strict=True))
    assert [r.token_ids for r in hit] == [r.token_ids for r in miss]
    return _tau(hit)


def test_drafter_tau_on_cache_hits_matches_misses(setup, tau_setup):
    miss, hit = _tau(tau_setup[1]), _tau_on_hits(setup, tau_setup)
    assert miss > 1.2  # the drafter is doing its job at all
    assert abs(hit - miss) <= 0.05 * miss, f"tau on hits {hit:.3f}, on misses {miss:.3f}"


def test_drafter_tau_on_prefix_store_hits_matches_misses(setup, tau_setup):
    """Each prompt's second run finds it in the prefix store (four other prompts took every slot in
    between): the drafter context kept with the stored prefix drafts as well as a fresh one."""
    plain, drafter, _ = setup
    prompts, miss = tau_setup
    cached = sibling_engine(plain, drafter.fresh_copy(), build_policy("full"), prefix_caching=True)
    fillers = [[t + 7] * 3 for t in range(cached.config.max_num_seqs)]
    hit = []
    for prompt in prompts:
        cached.generate([prompt], TAU_PARAMS)
        cached.generate(fillers, SamplingParams(temperature=0.0, max_tokens=1))
        request = cached.requests[cached.add_request(prompt, TAU_PARAMS)]
        while cached.has_unfinished_requests():
            cached.step()
        hit.append(request)
        assert request.prefix_source[0][0] == "stored"
        assert request.stats.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert [r.output_token_ids for r in hit] == [r.token_ids for r in miss]
    tau_hit = 1 + sum(r.stats.accepted_tokens for r in hit) / sum(r.stats.rounds for r in hit)
    tau_miss = _tau(miss)
    assert abs(tau_hit - tau_miss) <= 0.05 * tau_miss, f"tau on hits {tau_hit:.3f}, on misses {tau_miss:.3f}"


def test_empty_drafter_context_on_hits_would_fail(setup, tau_setup, monkeypatch):
    """The check above catches the #47930 failure: hit tokens counted, their context never written
    (left as zeros)."""

    def lengths_only(self, source, dest, length):
        self.reserve(dest, length)
        self.length[dest] = length

    monkeypatch.setattr(ContextStore, "copy_prefix", lengths_only)
    miss, hit = _tau(tau_setup[1]), _tau_on_hits(setup, tau_setup)
    assert hit < 0.95 * miss, f"tau on hits {hit:.3f}, on misses {miss:.3f}"


def test_missing_drafter_context_is_refused(setup, tau_setup, monkeypatch):
    """A drafter that skipped the cached tokens altogether is out of step with the target: refused."""
    monkeypatch.setattr(ContextStore, "copy_prefix", lambda self, source, dest, length: None)
    with pytest.raises(RuntimeError, match="committed tokens"):
        _tau_on_hits(setup, tau_setup)
