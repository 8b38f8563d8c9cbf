"""Penalties, min_p, logit_bias, min_tokens, n > 1 and per-request speculation through the whole engine:
speculative decoding follows the processed target distribution exactly (tiny target), greedy
output with penalties equals plain decoding, and a request with speculation off reproduces its
plain output while its neighbours speculate."""

from __future__ import annotations

import pytest
import torch
from dspark.builder import sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine.sampling_params import SamplingParams
from transformers import AutoModelForCausalLM

from tests.conftest import write_tiny_model
from tests.engine.helpers import (
    DistributionDrafter,
    ScriptedDrafter,
    engine_on,
    reference_logits,
    reference_probs,
)

V = 8
PROMPT = [1, 5, 2, 7]
N = 36_000  # E[TV] <= 0.5 * sqrt(V / N) = 0.0075 for V = 8, as the plain sampling tests


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny8") / "llama", "llama", seed=5, vocab_size=V)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def exact_marginals(hf, prompt: list[int], params: SamplingParams) -> list[torch.Tensor]:
    """Distributions of output tokens 0, 1, 2 under the processed target, from the reference
    processing of every possible output prefix."""
    marginals, prefixes = [], {(): 1.0}
    for _ in range(3):
        dist, nxt = torch.zeros(V), {}
        seqs = list(prefixes)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]
        for s, row in zip(seqs, logits, strict=True):
            p_row = reference_probs(reference_logits(row, prompt, list(s), params), params)
            dist += prefixes[s] * p_row
            for t in range(V):
                if p_row[t] > 0:
                    nxt[(*s, t)] = prefixes[s] * p_row[t].item()
        marginals.append(dist)
        prefixes = nxt
    return marginals


def total_variations(tokens: torch.Tensor, exact: list[torch.Tensor]) -> list[float]:
    n = tokens.shape[0]
    return [
        0.5 * (torch.bincount(tokens[:, k], minlength=V).float() / n - exact[k]).abs().sum().item()
        for k in range(3)
    ]


CASES = {
    "presence-frequency": SamplingParams(presence_penalty=1.2, frequency_penalty=0.9),
    "repetition": SamplingParams(repetition_penalty=2.5, temperature=0.8),
    "min_p": SamplingParams(min_p=0.2),
    "logit_bias": SamplingParams(logit_bias={3: 2.5, 6: -100.0, 0: 1.0}),
    # Tokens 2 and 5 are masked at output positions 0 and 1 only (and end the request at 2).
    "min_tokens": SamplingParams(min_tokens=2, stop_token_ids=[2, 5]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_follows_the_processed_target(tiny8, name):
    path, hf = tiny8
    params = CASES[name].model_copy(update={"max_tokens": 3, "ignore_eos": True})
    exact = exact_marginals(hf, PROMPT, params)
    # Drafts from the unprocessed marginals: verification alone must move them to the processed target.
    plain_params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=params.temperature)
    plain_marginals = exact_marginals(hf, PROMPT, plain_params)
    assert sum(0.5 * (a - b).abs().sum().item() for a, b in zip(exact, plain_marginals, strict=True)) > 0.1
    drafter = DistributionDrafter(torch.stack(plain_marginals[1:]).log())
    engine = engine_on(path, drafter, "static:2", max_num_seqs=1024, max_batch_tokens=8192)
    results = engine.generate([PROMPT] * N, params)
    tvs = total_variations(torch.tensor([r.token_ids for r in results]), exact)
    print(f"{name}: TV per output token {[round(t, 4) for t in tvs]}")
    assert max(tvs) < 0.01, tvs
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert accepted > 0.2 * sum(r.stats.draft_tokens for r in results)  # blocks were accepted past k=0


def test_parallel_samples_follow_the_target_and_are_reproducible(tiny8):
    """n = 4 samples per seeded request (seeds derived from the request's): together they follow
    the processed target, and the same seed gives the same samples."""
    path, hf = tiny8
    params = SamplingParams(max_tokens=3, ignore_eos=True, presence_penalty=0.8, seed=0)
    exact = exact_marginals(hf, PROMPT, params)
    n = 4
    children = [
        c for group in range(N // n) for c in params.model_copy(update={"seed": group * n}).for_samples(n)
    ]
    assert len({c.seed for c in children}) == N
    drafter = DistributionDrafter(torch.stack(exact[1:]).log())
    engine = engine_on(path, drafter, "static:2", max_num_seqs=1024, max_batch_tokens=8192)
    tokens = torch.tensor([r.token_ids for r in engine.generate([PROMPT] * N, children)])
    tvs = total_variations(tokens, exact)
    print(f"n=4: TV per output token {[round(t, 4) for t in tvs]}")
    assert max(tvs) < 0.01, tvs
    again = engine.generate([PROMPT] * (2 * n), children[: 2 * n])
    assert [r.token_ids for r in again] == tokens[: 2 * n].tolist()
    assert (
        len({tuple(t) for t in tokens[:n].tolist()}) > 1
        or len({tuple(t) for t in tokens[n : 2 * n].tolist()}) > 1
    )


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny64") / "llama", "llama", seed=3)


PENALISED = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.7),
    SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5
    ),
    SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={7: 4.0}, frequency_penalty=2.0
    ),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
]
PROMPTS = [[3, 9, 12, 40], [5, 5, 5], [60, 2, 33, 17, 8], [1]]


def test_greedy_with_penalties_equals_plain_decoding(tiny64):
    plain = engine_on(tiny64, NoDrafter(), "none", max_num_seqs=32)
    # One prompt per case (the scripted drafter looks continuations up by prompt).
    cases = [([*p, 10 + j], sp) for p in PROMPTS for j, sp in enumerate(PENALISED)]
    expected = [plain.generate([p], sp)[0].token_ids for p, sp in cases]
    for sp, want in zip([c[1] for c in cases], expected, strict=True):
        assert len(want) == sp.max_tokens
    assert all(expected[i] != expected[i + 3] for i in range(3))  # the penalties change the output
    scripted = ScriptedDrafter(
        5, {tuple(p): o for (p, _), o in zip(cases, expected, strict=True)}, corrupt=0.2, vocab=64
    )
    engine = sibling_engine(plain, scripted, _policy("static:4"), max_batch_tokens=128)
    noise = [SamplingParams(temperature=1.0, max_tokens=9, seed=1, frequency_penalty=1.0)]
    results = engine.generate([p for p, _ in cases] + [PROMPTS[0]], [sp for _, sp in cases] + noise)
    assert [r.token_ids for r in results[: len(cases)]] == expected
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_speculation_off_reproduces_plain_output_inside_a_speculating_batch(tiny64):
    plain = engine_on(tiny64, NoDrafter(), "none", max_num_seqs=8)
    off = [
        SamplingParams(temperature=0.9, max_tokens=20, seed=11, max_draft_tokens=0, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=20, max_draft_tokens=0, repetition_penalty=1.3, ignore_eos=True
        ),
    ]
    expected = [
        plain.generate([PROMPTS[0]], sp.model_copy(update={"max_draft_tokens": None}))[0] for sp in off
    ]
    speculate = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=20, seed=4, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, max_draft_tokens=1, ignore_eos=True),
    ]
    reference = {tuple(PROMPTS[0]): expected[1].token_ids}
    engine = sibling_engine(plain, ScriptedDrafter(4, reference, corrupt=0.1, vocab=64), _policy("static:4"))
    results = engine.generate([PROMPTS[0]] * 5, off + speculate)
    for got, want in zip(results[:2], expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.stats.draft_tokens == 0 and got.stats.rounds == len(got.token_ids) - 1
    assert results[2].stats.draft_tokens > 0 and results[3].stats.draft_tokens > 0
    capped = results[4].stats
    assert 0 < capped.draft_tokens <= capped.rounds and capped.drafts == capped.draft_tokens


def _policy(spec: str):
    from dspark.policies.factory import build_policy

    return build_policy(spec)
