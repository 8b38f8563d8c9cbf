"""`ngram+<model>`: the acceptance tally, the per-request choice and the merged block."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from dspark.drafters.factory import load_drafter
from dspark.drafters.lookup_first import MODEL_ROW, AcceptanceTally, LookupFirstDrafter, expected_accepted
from dspark.drafters.ngram import longest_match
from dspark.engine.drafter import DraftBlock, Drafter
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors

from tests.drafters.helpers import FIXTURE, make_request, sampling_for

VOCAB = 16
REPEATING = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]  # lookup continues with 5, 6, 7, 3, ...
FRESH = [1, 2, 8, 9, 10, 11, 12, 13]  # no earlier occurrence of its last token


class ConstantDrafter(Drafter):
    """Drafts token 15 everywhere with a fixed distribution and confidences; records who asked."""

    name = "constant"
    gives_confidences = True

    def __init__(self, gamma: int = 4, confidence: float = 0.5) -> None:
        self.gamma, self.confidence, self.device = gamma, confidence, torch.device("cpu")
        self.asked: list[list[str]] = []

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        self.asked.append([r.request_id for r in requests])
        width = min(horizon or self.gamma, self.gamma)
        tokens = torch.full((len(requests), width), 15)
        probs = None if sampling.all_greedy else torch.full((len(requests), width, VOCAB), 1.0 / VOCAB)
        return DraftBlock(tokens, probs, torch.full((len(requests), width), self.confidence))


def test_the_tally_counts_accepted_positions_and_the_first_rejection_only():
    tally = AcceptanceTally(2, 4)
    tally.record(1, np.array([1, 2, 3, 4]), np.array([1, 2, 9, 4, 5]))
    np.testing.assert_allclose(tally.rates(1), [2 / 3, 2 / 3, 1 / 3, 1 / 2])
    tally.record(1, np.array([1, 2, 3, 4]), np.array([1]))  # one token produced: position 2 unknown
    np.testing.assert_allclose(tally.rates(1), [3 / 4, 2 / 3, 1 / 3, 1 / 2])
    np.testing.assert_allclose(tally.rates(MODEL_ROW), [0.5] * 4)
    assert expected_accepted(np.array([[0.5, 0.5, 1.0]]), np.array([2]))[0] == pytest.approx(0.75)


def test_lookups_win_where_they_are_accepted_and_the_model_drafts_the_rest():
    model = ConstantDrafter(confidence=0.4)
    drafter = LookupFirstDrafter(model)
    repeating = make_request("rep", REPEATING, len(REPEATING) - 1)
    fresh = make_request("fresh", FRESH, len(FRESH) - 1)
    # Each round the target goes on repeating: the lookup's proposals come true and its tally rises.
    for _ in range(4):
        block = drafter.propose([repeating, fresh], sampling_for([repeating, fresh]))
        repeating.output_token_ids.append(repeating.all_token_ids[-5])
        fresh.output_token_ids.append(14)
    assert drafter.tally.rates(3)[0] > 0.75
    assert model.asked[-1] == ["fresh"] and drafter.lookup_rows >= 1
    n, found = longest_match(np.asarray(repeating.all_token_ids[:-1]), 4, 3)
    assert block.tokens[0].tolist() == found.tolist() and block.tokens[1].tolist() == [15] * 4
    assert block.num_valid.tolist() == [4, 4] and block.probs is None  # all greedy: one-hot
    assert block.confidences[0].tolist() == pytest.approx(drafter.tally.rates(n).tolist(), abs=1e-6)
    assert block.confidences[1].tolist() == pytest.approx([0.4] * 4)


def test_sampled_model_rows_keep_their_distribution_and_lookup_rows_become_one_hot():
    drafter = LookupFirstDrafter(ConstantDrafter(confidence=0.01))
    drafter.tally.record(3, np.array([5, 6, 7]), np.array([5, 6, 7]))  # lookups came true before
    rows = [
        make_request("rep", REPEATING, len(REPEATING) - 1, temperature=1.0),
        make_request("fresh", FRESH, len(FRESH) - 1, temperature=1.0),
    ]
    block = drafter.propose(rows, sampling_for(rows), horizon=3)
    assert block.tokens.shape == (2, 3) and drafter.lookup_rows == 1
    one_hot = torch.nn.functional.one_hot(torch.tensor([5, 6, 7]), VOCAB).float()
    assert torch.equal(block.probs[0], one_hot)
    assert torch.allclose(block.probs[1], torch.full((3, VOCAB), 1.0 / VOCAB))


def test_a_model_that_is_accepted_more_keeps_drafting_repeating_text():
    model = ConstantDrafter(confidence=0.99)
    drafter = LookupFirstDrafter(model)
    rows = [make_request("rep", REPEATING, len(REPEATING) - 1)]
    drafter.propose(rows, sampling_for(rows))
    assert drafter.lookup_rows == 0 and model.asked == [["rep"]]


def test_the_factory_builds_lookup_first_over_a_model_and_refuses_a_lookup_after_the_plus(target):
    config = target.config
    drafter = load_drafter(f"ngram+{FIXTURE / 'draft_vanilla'}", config)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.name == f"ngram+{drafter.model.name}"
    assert drafter.gamma == drafter.model.gamma and drafter.gives_confidences
    for bad in ("ngram+ngram", "ngram+none"):
        with pytest.raises(ValueError, match="a model drafter"):
            load_drafter(bad, config)
