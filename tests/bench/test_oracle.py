"""The oracle bound of `dspark bench serve`: verifies exactly what the target accepts, losslessly."""

from __future__ import annotations

import pytest
from dspark.bench.oracle import OracleEngine
from dspark.builder import sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy

from tests.engine.helpers import ScriptedDrafter, engine_on

PROMPTS = [[3, 17, 42, 5], [9, 9, 1], [60, 2, 33, 7, 11], [4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_dirs):
    return engine_on(tiny_dirs["llama"], NoDrafter(), "none", max_num_seqs=8)


def test_oracle_verifies_only_accepted_tokens_and_keeps_greedy_output(plain):
    expected = [r.token_ids for r in plain.generate(PROMPTS, GREEDY)]
    continuations = {tuple(p): o for p, o in zip(PROMPTS, expected, strict=True)}

    def scripted() -> ScriptedDrafter:  # the same corrupted drafts for both engines
        return ScriptedDrafter(7, continuations, corrupt=0.3, vocab=plain.model.config.vocab_size)

    oracle = OracleEngine.of(sibling_engine(plain, scripted(), plain.policy))
    assert oracle.policy.name == "oracle"
    results = oracle.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert all(r.stats.draft_tokens == r.stats.accepted_tokens for r in results)
    assert sum(r.stats.accepted_tokens for r in results) > 0
    assert oracle.untimed_s > 0

    # The whole block on the same drafts accepts as much, but verifies rejected tokens too.
    full = sibling_engine(plain, scripted(), build_policy("full"))
    wasted = full.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in wasted] == expected
    assert [r.stats.accepted_tokens for r in wasted] == [r.stats.accepted_tokens for r in results]
    assert sum(r.stats.draft_tokens for r in wasted) > sum(r.stats.accepted_tokens for r in wasted)


def test_oracle_refuses_sampled_requests(plain):
    oracle = OracleEngine.of(plain)
    with pytest.raises(ValueError, match="greedy"):
        oracle.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=4))
    assert not oracle.has_unfinished_requests()
