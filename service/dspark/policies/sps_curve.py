"""The step-rate curve the DSpark policies rank against: an SPS profile refined online from the
engine's own step timings, and the scheduler's per-step lookup of it."""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch

from dspark.engine.policy_spec import PolicySettings
from dspark.policies.ranking import SpsFn
from dspark.sps_format import SpsProfile, interp_flat, sps_of_array_or_float


class OnlineSps:
    """SPS(B) = prior SPS(B) / (drift * correction(B)), learned from observed step times (an idle or
    older node's profile mis-states the rate): the drift, shared by every B, follows each observation
    quickly, so a slowdown seen at some sizes moves all; the grid points' corrections move slowly."""

    def __init__(self, prior: SpsProfile, settings: PolicySettings = PolicySettings()) -> None:
        self.prior, self.settings = prior, settings
        self.max_log_jump = math.log(settings.sps_max_jump)
        self._grid = [float(b) for b in prior.batch_tokens()]
        self._log_drift = 0.0
        self._log_corr, self._weight = [0.0] * len(self._grid), [0.0] * len(self._grid)
        self.observations = self._table_age = 0  # observations in all, and since the table's rebuild
        self._table = torch.zeros(0)
        self._prior_rates: list[float] = []

    def observe(self, batch_tokens: int, seconds: float) -> None:
        """Record that a forward of `batch_tokens` tokens took `seconds`."""
        if batch_tokens < 1 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"need batch_tokens >= 1 and seconds > 0, finite; got {batch_tokens}, {seconds}")
        if len(self._prior_rates) <= batch_tokens:  # a list: indexing a tensor between forwards takes 50 us
            self._prior_rates = self.prior.table(batch_tokens).tolist()
        s, log_ratio = self.settings, math.log(seconds * self._prior_rates[batch_tokens])
        neighbours = self._neighbours(float(batch_tokens))
        error = log_ratio - self._log_drift - sum(w * self._log_corr[i] for i, w in neighbours)
        self._log_drift += s.sps_drift_alpha * self._clamp(error)
        for i, share in neighbours:
            # Running mean with the prior as `sps_prior_weight` pseudo-observations, floored at the EWMA rate.
            rate = max(s.sps_alpha * share, share / (self._weight[i] + s.sps_prior_weight + share))
            self._log_corr[i] += rate * self._clamp(log_ratio - self._log_drift - self._log_corr[i])
            self._weight[i] += share
        self.observations += 1
        self._table_age += 1

    def _clamp(self, log_step: float) -> float:
        """At most a factor `sps_max_jump` per observation: a stalled step cannot wreck the curve."""
        return max(-self.max_log_jump, min(self.max_log_jump, log_step))

    def _neighbours(self, b: float) -> list[tuple[int, float]]:
        """(grid index, share) of the grid points around b."""
        grid = self._grid
        if b <= grid[0] or b >= grid[-1]:
            return [(0 if b <= grid[0] else len(grid) - 1, 1.0)]
        right = bisect.bisect_right(grid, b)
        w = (b - grid[right - 1]) / (grid[right] - grid[right - 1])
        return [(i, s) for i, s in ((right - 1, 1.0 - w), (right, w)) if s > 0]

    def drift(self) -> float:
        """The step-time factor shared by every batch size (1.0 until something is observed)."""
        return math.exp(self._log_drift)

    def sps(self, batch_tokens: torch.Tensor | np.ndarray | float) -> torch.Tensor | np.ndarray | float:
        """Refined steps per second (the input's kind back, like `SpsProfile.sps`)."""
        if not isinstance(batch_tokens, torch.Tensor):
            return sps_of_array_or_float(self.sps, batch_tokens)
        grid, log_corr = (torch.tensor(v, dtype=torch.float64) for v in (self._grid, self._log_corr))
        correction = (interp_flat(batch_tokens, grid, log_corr) + self._log_drift).exp()
        return self.prior.sps(batch_tokens) / correction

    def table(self, max_batch_tokens: int) -> torch.Tensor:
        """Refined SPS at every integer B in [0, max_batch_tokens] (and maybe beyond), on the CPU."""
        stale = self._table_age >= self.settings.sps_refresh_every
        if self._table.numel() <= max_batch_tokens or stale:
            size = max(max_batch_tokens + 1, self._table.numel(), 64)
            self._table = self.sps(torch.arange(size, dtype=torch.float64))
            self._table_age = 0
        return self._table


def table_lookup(curve: SpsProfile | OnlineSps) -> SpsFn:
    """SPS at integer batch sizes (NumPy in and out) from the curve's `table()`, read through its right
    envelope max over B' >= B of SPS(B'): an inversion is timing noise that stopped Algorithm 1's early
    break, and where one is real a forward padded to B' runs at SPS(B'). Cliffs stay as measured."""
    seen = envelope = None

    def lookup(batch_tokens: np.ndarray) -> np.ndarray:
        nonlocal seen, envelope
        batch = np.asarray(batch_tokens).astype(np.int64)
        table = curve.table(int(batch.max()))
        if table is not seen:  # a refined curve rebuilds its table now and then
            seen, envelope = table, np.maximum.accumulate(table.numpy()[::-1])[::-1]
        return envelope[batch]

    return lookup
