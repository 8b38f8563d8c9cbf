"""Lossless verification: the output distribution equals the target's, for any draft distribution."""

from __future__ import annotations

import math

import pytest
import torch
from dspark.engine.sampler import SamplingTensors, logits_to_probs, sample
from dspark.engine.sampling_params import SamplingParams
from dspark.engine.verifier import verify_draft_tokens

VOCAB = 6
TV_LIMIT = 0.01


def draws_needed(vocab: int, noise_tv: float) -> int:
    """Draws so that the expected empirical TV of an unbiased sampler is below `noise_tv`.

    E|p_hat - p| <= sqrt(p (1 - p) / N) per bin, so E[TV] <= 0.5 * sum_i sqrt(p_i / N) <= 0.5 * sqrt(vocab / N).
    With noise_tv = TV_LIMIT / 2, a true bias of 0.03 shows as an empirical TV >= 0.03 - noise > 0.01.
    """
    return math.ceil(vocab / (2 * noise_tv) ** 2)


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def simulate(target_logits, draft_logits, params: SamplingParams, lengths: int, n: int, seed: int):
    """n independent rounds: draft `lengths` tokens from q, verify against p; return emitted tokens.

    target_logits [G + 1, V] (the same context every round, so positions are i.i.d. here: p_k = p).
    """
    torch.manual_seed(seed)
    gamma = draft_logits.shape[0]
    st = SamplingTensors.from_params([params] * n)
    q = logits_to_probs(draft_logits.expand(n, gamma, VOCAB).contiguous(), st)
    p = logits_to_probs(target_logits.expand(n, gamma + 1, VOCAB).contiguous(), st)
    tokens = sample(q, [None] * n)
    accepted, nxt = verify_draft_tokens(tokens, q, p, torch.full((n,), lengths), [None] * n)
    # emitted sequence: accepted drafts then next token; its first token is x_1
    first = torch.where(accepted > 0, tokens[:, 0], nxt)
    second = torch.where(accepted > 1, tokens[:, 1], nxt)  # valid where accepted >= 1
    return first, second, accepted, p[0, 0], p[0, 1]


CASES = {
    "well-matched": lambda t: t + 0.3 * torch.randn_like(t),
    "badly-matched": lambda t: -t,
}


@pytest.mark.parametrize("match", list(CASES))
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4, top_p=0.9)],
    ids=["plain", "topk-topp"],
)
def test_emitted_tokens_follow_the_target_distribution(match, params):
    n = draws_needed(VOCAB, TV_LIMIT / 2)
    assert n >= 60_000
    g = torch.Generator().manual_seed(7)
    target = torch.randn(3, VOCAB, generator=g) * 1.5
    draft = CASES[match](target[:2])
    first, second, accepted, p1, p2 = simulate(target, draft, params, lengths=2, n=n, seed=11)
    assert tv(torch.bincount(first, minlength=VOCAB).float(), p1) < TV_LIMIT
    # x_2 given that x_1 came from an accepted draft (its context is the same fixed one here)
    mask = accepted >= 1
    if mask.sum() >= 2_000:  # a draft with (almost) disjoint support is never accepted at position 1
        assert tv(torch.bincount(second[mask], minlength=VOCAB).float(), p2) < TV_LIMIT * math.sqrt(
            n / mask.sum()
        )
    rate = accepted.float().mean().item() / 2
    assert (rate > 0.5) if match == "well-matched" else (rate < 0.5)


def test_a_biased_sampler_would_fail_the_check():
    """The test has power: a 0.03 TV bias is caught at this sample size."""
    n = draws_needed(VOCAB, TV_LIMIT / 2)
    p = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)), -1)
    biased = p.clone()
    biased[0] += 0.03
    biased[1] -= 0.03
    biased = biased.clamp_min(0) / biased.clamp_min(0).sum()
    counts = torch.bincount(torch.multinomial(biased, n, replacement=True), minlength=VOCAB).float()
    assert tv(counts, p) > TV_LIMIT


def test_greedy_accepts_while_draft_equals_argmax():
    target = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]).log()
    st = SamplingTensors.from_params([SamplingParams(temperature=0)] * 3)
    p = logits_to_probs(target.expand(3, 4, 3).contiguous(), st)
    drafts = torch.tensor([[1, 0, 2], [1, 2, 2], [0, 0, 2]])
    accepted, nxt = verify_draft_tokens(drafts, None, p, torch.tensor([3, 3, 3]), [None] * 3)
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [2, 0, 1]  # bonus after 3, target argmax at the first mismatch


def test_zero_length_is_a_plain_decode_step():
    p = torch.softmax(torch.randn(4, 3, 5), -1)
    accepted, _ = verify_draft_tokens(
        torch.zeros(4, 2, dtype=torch.long), None, p, torch.zeros(4, dtype=torch.long), [None] * 4
    )
    assert accepted.tolist() == [0, 0, 0, 0]


def test_greedy_fast_path_equals_the_general_rule():
    from dspark.engine.verifier import verify_greedy

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 5, 4, generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.where(
        torch.rand(64, 4, generator=g) < 0.7, argmax[:, :4], torch.randint(0, 4, (64, 4), generator=g)
    )
    lengths = torch.randint(0, 5, (64,), generator=g)
    st = SamplingTensors.from_params([SamplingParams(temperature=0)] * 64)
    general = verify_draft_tokens(drafts, None, logits_to_probs(logits, st), lengths, [None] * 64)
    fast = verify_greedy(drafts, argmax, lengths)
    assert torch.equal(general[0], fast[0]) and torch.equal(general[1], fast[1])
    assert 0 < fast[0].float().mean() < 4
