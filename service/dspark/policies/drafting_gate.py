"""Whether a step should draft at all: DSpark's expected-throughput test, extended to the drafter.

The paper's scheduler picks verify lengths after drafting, because a GPU drafts almost for
free. Where drafting costs about as much as the verification forward (a CPU, or a drafter
large next to its target) a step can be faster without it; this gate compares the two
before the drafter runs. Everything it uses comes from earlier steps (recent calibrated
confidences, measured drafting and step times) and the number of requests, none of which the
coming draft shapes, so skipping a step's drafting keeps decoding lossless: that step simply
verifies no draft tokens.
"""

from __future__ import annotations

from collections import deque

import torch

from dspark.policies.prefix_scheduler import SpsFn, schedule_prefix_greedy, survival_probabilities


class DraftCost:
    """Seconds one drafting call takes for R requests: an EWMA per observed R, interpolated
    linearly between observed R (flat past either end, so an unseen larger batch looks cheap,
    gets drafted once, and is then measured)."""

    alpha = 0.2

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def observe(self, num_requests: int, seconds: float) -> None:
        if num_requests < 1 or not seconds > 0:
            return
        old = self._seconds.get(num_requests)
        self._seconds[num_requests] = seconds if old is None else old + self.alpha * (seconds - old)

    def seconds(self, num_requests: int) -> float | None:
        """None until some drafting was measured."""
        if not self._seconds:
            return None
        if num_requests in self._seconds:
            return self._seconds[num_requests]
        known = sorted(self._seconds)
        x = torch.tensor(known, dtype=torch.float64)
        y = torch.tensor([self._seconds[r] for r in known], dtype=torch.float64)
        i = int(torch.searchsorted(x, float(num_requests)))
        if i == 0:
            return float(y[0])
        if i == len(known):
            return float(y[-1])
        w = (num_requests - x[i - 1]) / (x[i] - x[i - 1])
        return float(y[i - 1] + w * (y[i] - y[i - 1]))


class DraftingGate:
    """Drafts a step only when R requests are expected to decode faster with drafting.

    With drafting, Algorithm 1 on recent confidence rows (the last steps' rows, cycled to R
    rows) gives the expected tokens tau_d and verify batch B_d; the step takes
    other + draft(R) + 1 / SPS(B_d). Without, R tokens in other + 1 / SPS(R). Unknown costs
    or no confidences yet: draft (that is how they get measured). After `explore_every`
    skipped steps in a row one step drafts anyway, to refresh the confidences and cost.
    """

    def __init__(self, explore_every: int = 32, memory_steps: int = 8) -> None:
        self.cost = DraftCost()
        self.explore_every = explore_every
        self._rows: deque[torch.Tensor] = deque(maxlen=memory_steps)
        self._skipped_in_a_row = 0
        self.skipped_steps = 0

    def remember(self, confidences: torch.Tensor) -> None:
        """Finite confidences [R, w] of a step that drafted."""
        if confidences.numel():
            self._rows.append(confidences.detach().to("cpu", torch.float64))

    def should_draft(self, num_requests: int, forward_sps: SpsFn, other_s: float) -> bool:
        draft_s = self.cost.seconds(num_requests)
        if (
            num_requests < 1
            or draft_s is None
            or not self._rows
            or self._skipped_in_a_row >= self.explore_every
        ):
            self._skipped_in_a_row = 0
            return True
        rows = self._recent_rows(num_requests)
        with_draft = self.expected_rate(rows, forward_sps, other_s + draft_s)
        without = num_requests / (other_s + 1.0 / float(forward_sps(torch.tensor([num_requests]))[0]))
        if with_draft > without:
            self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        self.skipped_steps += 1
        return False

    @staticmethod
    def expected_rate(confidences: torch.Tensor, forward_sps: SpsFn, fixed_s: float) -> float:
        """Expected tokens per second of a step that spends `fixed_s` besides its forward and
        verifies Algorithm 1's choice on `confidences` [R, w]."""

        def step_rate(b: torch.Tensor) -> torch.Tensor:
            return 1.0 / (fixed_s + 1.0 / forward_sps(b))

        lengths = schedule_prefix_greedy(confidences, step_rate)
        survival = survival_probabilities(confidences)
        verified = torch.arange(confidences.shape[1])[None, :] < lengths[:, None]
        tokens = confidences.shape[0] + float(survival[verified].sum())
        batch = torch.tensor([confidences.shape[0] + int(lengths.sum())])
        return tokens * float(step_rate(batch)[0])

    def _recent_rows(self, num_requests: int) -> torch.Tensor:
        width = max(c.shape[1] for c in self._rows)
        rows = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1])) for c in self._rows])
        index = torch.arange(num_requests) % rows.shape[0]
        return rows.flip(0)[index]  # newest first
