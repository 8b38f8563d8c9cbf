"""Whether a step should draft at all, and how far: DSpark's expected-throughput test extended to the
drafter. It decides from earlier steps and R only, which the coming draft cannot shape: lossless."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicySettings
from dspark.engine.verify_policy import host_array
from dspark.policies.ranking import SpsFn, early_stop, expected_throughputs, ranked_candidates


def ewma(old: float | None, new: float, alpha: float) -> float:  # the first value starts it
    return new if old is None else old + alpha * (new - old)


def _interp(table: dict[int, float], x: int) -> float:
    """Linear between the keys around x, flat beyond both ends (plain Python: a handful of keys)."""
    if x in table:  # the hot path
        return table[x]
    known = sorted(table)
    right = bisect.bisect_right(known, x)
    if right in (0, len(known)):
        return table[known[0 if right == 0 else -1]]
    x0, x1 = known[right - 1], known[right]
    return table[x0] + (x - x0) / (x1 - x0) * (table[x1] - table[x0])


class DraftCost:
    """Seconds drafting R requests h positions takes: EWMAs per (R, h), interpolated between horizons
    at R, else between per-R EWMAs; flat past the ends (an unseen larger R is drafted, then measured)."""

    def __init__(self, alpha: float) -> None:
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
        return _interp(at_r, horizon) if at_r and horizon else _interp(self._seconds, num_requests)


def expected_rate(pool: np.ndarray, num_requests: int, forward_sps: SpsFn, fixed_s: float) -> float:
    """Algorithm 1's objective at its early stop, in tokens per second of steps that spend `fixed_s`
    besides the forward, for R requests like the `pool` rows (each stands for R / rows of them)."""

    def step_rate(batch: np.ndarray) -> np.ndarray:
        low = np.floor(batch).astype(np.int64)
        forward_s = 1.0 / forward_sps(np.arange(int(low[-1]) + 2))  # one lookup, every B reached
        frac = batch - low
        return 1.0 / (fixed_s + (1 - frac) * forward_s[low] + frac * forward_s[low + 1])

    values = ranked_candidates(pool)[0]
    theta = expected_throughputs(values, num_requests, step_rate, weight=num_requests / pool.shape[0])
    return float(theta[early_stop(theta)])


@dataclass
class _Exploration:  # the gate's exploration at one request count R
    interval: int  # skipped steps in a row before the next exploration
    skipped: int = 0  # skipped in a row so far
    explored: bool = False  # the last step at R was an exploration


class DraftingGate:
    """Drafts R requests h positions only when `expected_rate` over the first h confidences of recent
    drafted steps' rows (`memory_rows` of them, or those of `judge_steps` steps: one unlucky draft
    cannot switch drafting off) beats plain decoding's R / (other' + 1 / SPS(R)) by `min_gain`; per R,
    `explore_every` skipped steps in a row per step of its burst trigger a burst that renews a quarter
    of the rows (see docs/scheduler.md)."""

    def __init__(self, settings: PolicySettings = PolicySettings()) -> None:
        self.settings, self.cost = settings, DraftCost(settings.draft_cost_alpha)
        # The rest of a step besides forward and drafting (acceptance, cache commits), apart for
        # drafted steps: they accept more, and charging that to plain decoding favoured drafting.
        self.other_s = 0.0
        self.plain_other_s: float | None = None
        self._shapes: deque[tuple[int, int]] = deque()  # (rows, width) per remembered step, oldest first
        self._pool = np.zeros((0, 0))  # their rows, zero-padded to the widest
        self._rates: dict[tuple[int, int], tuple[int, float]] = {}  # (R, horizon) -> (evaluation, rate)
        # Per R: under closed loop R dips for a step whenever a request ends and its successor prefills.
        self._exploration: dict[int, _Exploration] = {}
        self._burst_left = self._evaluations = self.skipped_steps = 0

    def update(self, stats: StepStats, drift: float) -> None:
        """Learn a decode step's costs besides its forward, in drift-free units."""
        if stats.drafted:
            self.cost.observe(len(stats.verify_budgets), stats.draft_time_s / drift, stats.draft_horizon)
        other_s = (stats.step_time_s - stats.forward_time_s - stats.draft_time_s) / drift
        if other_s < 0:
            return
        if stats.drafted:
            self.other_s = ewma(self.other_s, other_s, self.settings.overhead_alpha)
        else:
            self.plain_other_s = ewma(self.plain_other_s, other_s, self.settings.overhead_alpha)

    def remember(self, confidences: np.ndarray | torch.Tensor) -> None:
        """Finite confidences [R, w] of a step that drafted."""
        confidences = host_array(confidences)
        if not confidences.size:
            return
        self._shapes.append(confidences.shape)
        total = self._pool.shape[0] + confidences.shape[0]
        while total - self._shapes[0][0] >= self.settings.memory_rows:
            total -= self._shapes.popleft()[0]
        width = max(w for _, w in self._shapes)
        kept = self._pool[self._pool.shape[0] + confidences.shape[0] - total :, :width]
        self._pool = np.zeros((total, width))  # np.pad: 16 us on a 64 x 5 pool, this: 1 us
        self._pool[: kept.shape[0], : kept.shape[1]] = kept
        self._pool[kept.shape[0] :, : confidences.shape[1]] = confidences

    def verified(self, draft_tokens: int) -> None:
        """A drafted step verified `draft_tokens`: none ends an exploration burst, whose fresh rows
        could only have said again that drafting does not pay."""
        if not draft_tokens:
            self._burst_left = 0

    def draft_horizon(self, num_requests: int, forward_sps: SpsFn, horizons: Sequence[int]) -> int:
        """The horizon among `horizons` with the highest expected rate, or 0 when none beats not
        drafting by `min_gain`. Forced drafting takes the widest."""
        s, widest = self.settings, max(horizons)
        few_rows = self._pool.shape[0] < s.memory_rows and len(self._shapes) < s.judge_steps
        if num_requests < 1 or self.cost.seconds(num_requests, widest) is None or few_rows:
            return widest
        if self._burst_left > 0:
            self._burst_left -= 1
            return widest
        # At one request a burst is memory_rows / 4 drafted steps: the skips before it scale with it,
        # so that exploring costs no larger share of the steps at one request than at many.
        burst = math.ceil(s.memory_rows / (4 * num_requests))
        at_r = self._exploration.setdefault(num_requests, _Exploration(s.explore_every * burst))
        if at_r.skipped >= at_r.interval:
            at_r.skipped, at_r.explored = 0, True
            self._burst_left = burst - 1
            return widest
        explored, at_r.explored = at_r.explored, False
        if self.plain_other_s is None:  # skip one step to measure it
            self.skipped_steps += 1
            return 0
        plain_sps = float(forward_sps(np.array([num_requests]))[0])
        without = num_requests / (self.plain_other_s + 1.0 / plain_sps)
        self._evaluations += 1
        if explored:
            self._rates.clear()
        width = self._pool.shape[1]  # horizons past it have no confidences to judge them by
        candidates = sorted({min(h, width) for h in horizons})
        rates = [self._rate(num_requests, h, forward_sps) for h in candidates]
        best = rates.index(max(rates))  # ties go to the cheaper, narrower one
        if rates[best] > without * (1.0 + s.min_gain):
            at_r.skipped, at_r.interval = 0, s.explore_every * burst
            # A wider horizon offered than the rows cover: draft it, so its positions get judged.
            return widest if widest > width else candidates[best]
        if explored:
            at_r.interval = min(2 * at_r.interval, 8 * s.explore_every * burst)
        at_r.skipped += 1
        self.skipped_steps += 1
        return 0

    def _rate(self, num_requests: int, horizon: int, forward_sps: SpsFn) -> float:
        """Expected rate drafting `horizon` positions for R requests (reused for `reuse_steps`)."""
        cached = self._rates.get((num_requests, horizon))
        if cached is not None and self._evaluations - cached[0] < self.settings.reuse_steps:
            return cached[1]
        fixed_s = self.other_s + self.cost.seconds(num_requests, horizon)
        rate = expected_rate(self._pool[:, :horizon], num_requests, forward_sps, fixed_s)
        self._rates[num_requests, horizon] = (self._evaluations, rate)
        return rate
