"""The shipped DSpark drafter with the confidence scheduler in the engine: still lossless."""

from __future__ import annotations

import pytest
from dspark.builder import sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine.policy_spec import PolicySettings
from dspark.engine.prompt import encode_prompt
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy
from dspark.profiling.synthetic import synthetic_profile
from dspark.prompts.builtin import BUILTIN_PROMPTS
from transformers import AutoTokenizer

from tests.engine.helpers import engine_on, shipped_dspark_drafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def engines(smollm_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    plain = engine_on(smollm_dir, NoDrafter(), "none", tokenizer, max_num_seqs=8)
    drafter = shipped_dspark_drafter(plain)
    prompts = [encode_prompt(tokenizer, t) for t in BUILTIN_PROMPTS["code"][:3] + BUILTIN_PROMPTS["math"][:3]]
    return plain, drafter, prompts


@pytest.mark.parametrize("policy", ["dspark", "dspark-async", "threshold:0.3", "full"])
def test_dspark_drafter_and_policies_keep_greedy_output(engines, policy):
    plain, drafter, prompts = engines
    expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    engine = sibling_engine(plain, drafter, build_policy(policy, sps=synthetic_profile(max_batch_tokens=512)))
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert drafter.gamma == 7 and sum(r.stats.rounds for r in results) > 0


def test_dspark_drafter_samples_with_seeds(engines):
    plain, drafter, prompts = engines
    engine = sibling_engine(plain, drafter, build_policy("full"))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=3)
    first = engine.generate(prompts[:2], params)
    assert all(len(r.token_ids) > 0 for r in first)
    assert sum(r.stats.draft_tokens for r in first) > 0


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_steps_the_gate_skips_keep_greedy_output(engines, policy):
    """Drafting that looks too slow to pay is skipped on most steps; outputs stay identical."""
    plain, drafter, prompts = engines
    expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    # Exploring every 2 skipped steps mixes drafted and skipped ones; one row is enough evidence.
    settings = PolicySettings(explore_every=2, memory_rows=1)
    verify_policy = build_policy(policy, sps=synthetic_profile(max_batch_tokens=512), settings=settings)
    for r in range(1, 9):
        verify_policy.gate.cost.observe(r, 100.0)
    engine = sibling_engine(plain, drafter, verify_policy)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert verify_policy.gate.skipped_steps > 0
    assert sum(r.stats.draft_tokens for r in results) > 0  # the exploring steps drafted
