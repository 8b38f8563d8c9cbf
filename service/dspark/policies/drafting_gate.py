"""Whether a step should draft at all: DSpark's expected-throughput test, extended to the drafter.

Where drafting costs a real share of the verification forward (a CPU, or a drafter large next to
its target) a step can be faster without it. The gate decides from earlier steps and the number
of requests only, which the coming draft cannot shape, so skipping keeps decoding lossless.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.engine.outputs import StepStats
from dspark.engine.survival import host_array
from dspark.policies.ranking import SpsFn, early_stop, expected_throughputs, ranked_candidates


def ewma(old: float | None, new: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first value starts it."""
    return new if old is None else old + alpha * (new - old)


class DraftCost:
    """Seconds one drafting call takes for R requests and a horizon of h positions: an EWMA per
    observed (R, h), interpolated between measured horizons at R, else between the per-R EWMAs,
    flat past either end (an unseen larger batch looks cheap, gets drafted once, then measured)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._seconds: dict[int, float] = {}
        self._by_horizon: dict[int, dict[int, float]] = {}  # R -> horizon -> seconds

    def observe(self, num_requests: int, seconds: float, horizon: int | None = None) -> None:
        if num_requests < 1 or not seconds > 0:
            return
        self._seconds[num_requests] = ewma(self._seconds.get(num_requests), seconds, self.alpha)
        if horizon:
            at_r = self._by_horizon.setdefault(num_requests, {})
            at_r[horizon] = ewma(at_r.get(horizon), seconds, self.alpha)

    def seconds(self, num_requests: int, horizon: int | None = None) -> float | None:
        """None until some drafting was measured."""
        if not self._seconds:
            return None
        at_r = self._by_horizon.get(num_requests)
        if at_r and horizon:
            exact = at_r.get(horizon)
            return exact if exact is not None else _interp(at_r, horizon)  # the first: the hot path
        if num_requests in self._seconds:
            return self._seconds[num_requests]
        return _interp(self._seconds, num_requests)


def _padded(rows: np.ndarray, width: int) -> np.ndarray:
    if rows.shape[1] == width:
        return rows
    padded = np.zeros((rows.shape[0], width))  # np.pad: 16 us on a 64 x 5 pool, this: 1 us
    padded[:, : rows.shape[1]] = rows
    return padded


def _interp(table: dict[int, float], x: int) -> float:
    """Linear between the known keys around x, flat beyond both ends (plain Python: a handful of
    keys, called on the hot path)."""
    known = sorted(table)
    right = bisect.bisect_right(known, x)
    if right == 0:
        return table[known[0]]
    if right == len(known):
        return table[known[-1]]
    x0, x1 = known[right - 1], known[right]
    return table[x0] + (x - x0) / (x1 - x0) * (table[x1] - table[x0])


@dataclass
class _Exploration:
    """The gate's exploration at one request count R."""

    interval: int  # skipped steps in a row before the next exploration
    skipped: int = 0  # skipped in a row so far
    explored: bool = False  # the last step at R was an exploration


class DraftingGate:
    """Drafts a step only when R requests are expected to decode faster with drafting.

    With drafting h positions: Algorithm 1's objective at its early stop over the first h
    confidences of recent drafted steps' rows (a pool of at least `memory_rows`, each weighted
    R / rows, so one unlucky draft cannot switch drafting off), in a step of
    other + draft(R, h) + 1 / SPS(R + admitted). Without: R tokens in other' + 1 / SPS(R), other'
    measured on undrafted steps. Drafting must promise `min_gain` more, so that noise near
    break-even does not flip the decision. Unknown costs or a short pool: draft; no undrafted step
    measured yet: skip one. Per request count R, `explore_every` skipped steps in a row trigger a
    burst that renews a quarter of the pool; an exploration that changes nothing doubles the
    interval (up to 8x). A horizon's expected rate is reused for `reuse_steps` evaluations.
    docs/scheduler.md gives the reasons and measurements.
    """

    def __init__(
        self,
        explore_every: int = 32,
        memory_rows: int = 64,
        min_gain: float = 0.01,
        reuse_steps: int = 4,
        cost_alpha: float = 0.2,
    ) -> None:
        self.cost = DraftCost(cost_alpha)
        self.min_gain = min_gain
        self.explore_every = explore_every
        self.memory_rows = memory_rows
        self.reuse_steps = reuse_steps
        self._shapes: deque[tuple[int, int]] = deque()  # (rows, width) per remembered step, oldest first
        self._pool = np.zeros((0, 0))  # their rows, zero-padded to the widest
        self._rates: dict[tuple[int, int], tuple[int, float]] = {}  # (R, horizon) -> (evaluation, rate)
        self._evaluations = 0
        # Per request count R: a load's exploration says nothing about another's, and under closed
        # loop R dips for a step whenever a request ends and its successor prefills.
        self._exploration: dict[int, _Exploration] = {}
        self._burst_left = 0
        self.skipped_steps = 0

    def update(self, stats: StepStats, drift: float) -> None:
        """Learn a drafted step's drafting time (in drift-free units) for its R and horizon."""
        if stats.drafted:
            self.cost.observe(len(stats.verify_budgets), stats.draft_time_s / drift, stats.draft_horizon)

    def remember(self, confidences: np.ndarray | torch.Tensor) -> None:
        """Finite confidences [R, w] of a step that drafted."""
        confidences = host_array(confidences)
        if not confidences.size:
            return
        self._shapes.append((confidences.shape[0], confidences.shape[1]))
        total = self._pool.shape[0] + confidences.shape[0]
        while total - self._shapes[0][0] >= self.memory_rows:
            total -= self._shapes.popleft()[0]
        dropped = self._pool.shape[0] + confidences.shape[0] - total
        width = max(w for _, w in self._shapes)
        kept = self._pool[dropped:, :width]  # columns past `width` only padded dropped rows
        self._pool = np.concatenate([_padded(kept, width), _padded(confidences, width)])

    def draft_horizon(
        self,
        num_requests: int,
        forward_sps: SpsFn,
        other_s: float,
        plain_other_s: float | None,
        horizons: Sequence[int],
    ) -> int:
        """The horizon among `horizons` with the highest expected rate, or 0 when no horizon beats
        not drafting by `min_gain`. `other_s`: the rest of a drafted step besides drafting and the
        forward; `plain_other_s`: the same for an undrafted step, None until one is measured (the
        gate then skips one step to measure it). Forced drafting takes the widest horizon."""
        widest = max(horizons)
        if num_requests < 1 or self.cost.seconds(num_requests, widest) is None:
            return widest
        if self._pool.shape[0] < self.memory_rows:  # too little evidence yet
            return widest
        if self._burst_left > 0:
            self._burst_left -= 1
            return widest
        at_r = self._exploration.get(num_requests)
        if at_r is None:
            at_r = self._exploration[num_requests] = _Exploration(self.explore_every)
        if at_r.skipped >= at_r.interval:
            at_r.skipped, at_r.explored = 0, True
            self._burst_left = math.ceil(self.memory_rows / (4 * num_requests)) - 1
            return widest
        explored, at_r.explored = at_r.explored, False
        if plain_other_s is None:
            self.skipped_steps += 1
            return 0
        without = num_requests / (plain_other_s + 1.0 / float(forward_sps(np.array([num_requests]))[0]))
        self._evaluations += 1
        if explored:
            self._rates.clear()
        # Horizons past the remembered rows' width have no confidences to judge them by.
        width = self._pool.shape[1]
        best, best_rate = 0, without * (1.0 + self.min_gain)
        for h in sorted({min(h, width) for h in horizons}):  # ties go to the cheaper, narrower one
            rate = self._rate(num_requests, h, forward_sps, other_s)
            if rate > best_rate:
                best, best_rate = h, rate
        if best:
            at_r.skipped, at_r.interval = 0, self.explore_every
            # A wider horizon offered than the rows cover: draft it, so its positions get judged.
            return widest if widest > width else best
        if explored:
            at_r.interval = min(2 * at_r.interval, 8 * self.explore_every)
        at_r.skipped += 1
        self.skipped_steps += 1
        return 0

    def _rate(self, num_requests: int, horizon: int, forward_sps: SpsFn, other_s: float) -> float:
        """Expected rate drafting `horizon` positions for R requests (reused for `reuse_steps`)."""
        cached = self._rates.get((num_requests, horizon))
        if cached is not None and self._evaluations - cached[0] < self.reuse_steps:
            return cached[1]
        values = ranked_candidates(self._pool[:, :horizon])[0]
        fixed_s = other_s + self.cost.seconds(num_requests, horizon)
        rate = self.ranked_rate(values, self._pool.shape[0], num_requests, forward_sps, fixed_s)
        self._rates[num_requests, horizon] = (self._evaluations, rate)
        return rate

    @staticmethod
    def ranked_rate(
        survival: np.ndarray, rows: int, num_requests: int, forward_sps: SpsFn, fixed_s: float
    ) -> float:
        """Expected tokens per second of a step of `num_requests` requests like the pool's rows
        (given by their ranked survival values, `ranked_candidates`, and their count) that spends
        `fixed_s` besides its forward and verifies by Algorithm 1: its objective and early stop
        with rows weighted R / rows, so batch sizes are fractional and the forward time is
        interpolated between the integers around them."""

        def step_rate(batch: np.ndarray) -> np.ndarray:
            low = np.floor(batch).astype(np.int64)
            forward_s = 1.0 / forward_sps(np.arange(int(low[-1]) + 2))  # one lookup, every B reached
            frac = batch - low
            return 1.0 / (fixed_s + (1 - frac) * forward_s[low] + frac * forward_s[low + 1])

        theta = expected_throughputs(survival, num_requests, step_rate, weight=num_requests / rows)
        return float(theta[early_stop(theta)])
