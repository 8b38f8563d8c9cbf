"""Prompt-lookup (n-gram) drafter: continue the latest earlier occurrence of the trailing n-gram."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from dspark.engine.drafter import DraftBlock, Drafter
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors

MAX_NGRAM = 3  # the longest trailing n-gram looked up


def longest_match(
    tokens: np.ndarray, gamma: int, max_ngram: int, min_ngram: int = 1
) -> tuple[int, np.ndarray]:
    """(n, continuation): the longest trailing n-gram with an earlier occurrence and up to `gamma`
    tokens that followed its latest one; (0, empty) when no n >= min_ngram matches."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # every n-gram that has a successor
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = hits[-1] + n
            return n, tokens[start : start + gamma]
    return 0, tokens[:0]


class NgramDrafter(Drafter):
    """Deterministic drafts (one-hot draft distributions), so verification stays lossless."""

    name = "ngram"

    def __init__(self, gamma: int, max_ngram: int = MAX_NGRAM, device: torch.device | str = "cpu") -> None:
        self.gamma = gamma
        self.max_ngram = max_ngram
        self.device = torch.device(device)

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        tokens = np.zeros((len(requests), self.gamma), dtype=np.int64)
        valid = np.zeros(len(requests), dtype=np.int64)
        for i, request in enumerate(requests):
            _, found = longest_match(np.asarray(request.all_token_ids), self.gamma, self.max_ngram)
            tokens[i, : len(found)] = found
            valid[i] = len(found)
        return DraftBlock(
            tokens=torch.from_numpy(tokens).to(self.device),
            probs=None,
            confidences=None,
            num_valid=torch.from_numpy(valid).to(self.device),
        )


class NoDrafter(Drafter):
    """Plain decoding."""

    name = "none"
    gamma = 0

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        return DraftBlock(tokens=torch.zeros((len(requests), 0), dtype=torch.int64), probs=None)
