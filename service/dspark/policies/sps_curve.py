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
    """SPS(B) = prior SPS(B) / (drift * correction(B)), both learned from observed step times: a
    profile taken on an idle node, or before the hardware drifted, mis-states the step rate. The
    drift, one factor for every B, follows each observation quickly, so a node that slows down
    while only some sizes run moves the estimate at all of them; the corrections at the profile's
    grid points (the curve's shape) move slowly. `table()` is rebuilt every `sps_refresh_every`."""

    def __init__(self, prior: SpsProfile, settings: PolicySettings = PolicySettings()) -> None:
        self.prior = prior
        self.settings = settings
        self.max_log_jump = math.log(settings.sps_max_jump)
        self._grid = [float(b) for b in prior.batch_tokens()]
        self._log_drift = 0.0
        self._log_corr = [0.0] * len(self._grid)
        self._weight = [0.0] * len(self._grid)
        self.observations = 0
        self._table: torch.Tensor | None = None
        self._table_age = 0
        self._prior_rates: list[float] = []

    def observe(self, batch_tokens: int, seconds: float) -> None:
        """Record that a forward of `batch_tokens` tokens took `seconds`."""
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step time must be a positive finite number of seconds, got {seconds}")
        s = self.settings
        log_ratio = math.log(seconds * self._prior_rate(batch_tokens))
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

    def _prior_rate(self, batch_tokens: int) -> float:
        """The prior's SPS at an integer B, from a cached list: its scalar lookup builds tensors,
        and indexing a tensor between two forwards (caches cold) takes 50 us."""
        if len(self._prior_rates) <= batch_tokens:
            self._prior_rates = self.prior.table(batch_tokens).tolist()
        return self._prior_rates[batch_tokens]

    def _clamp(self, log_step: float) -> float:
        """At most a factor `sps_max_jump` per observation: a stalled step cannot wreck the curve."""
        return max(-self.max_log_jump, min(self.max_log_jump, log_step))

    def _neighbours(self, b: float) -> list[tuple[int, float]]:
        """(grid index, share) of the grid points around b."""
        grid = self._grid
        if b <= grid[0]:
            return [(0, 1.0)]
        if b >= grid[-1]:
            return [(len(grid) - 1, 1.0)]
        right = bisect.bisect_right(grid, b)
        w = (b - grid[right - 1]) / (grid[right] - grid[right - 1])
        return [(i, s) for i, s in ((right - 1, 1.0 - w), (right, w)) if s > 0]

    def drift(self) -> float:
        """The step-time factor shared by every batch size (1.0 until something is observed)."""
        return math.exp(self._log_drift)

    def corrections(self) -> list[float]:
        """Estimated / prior step time at each grid point (the drift alone where nothing was observed)."""
        return [math.exp(c + self._log_drift) for c in self._log_corr]

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
        if self._table is None or self._table.numel() <= max_batch_tokens or stale:
            size = max(max_batch_tokens + 1, 0 if self._table is None else self._table.numel(), 64)
            self._table = self.sps(torch.arange(size, dtype=torch.float64))
            self._table_age = 0
        return self._table


def table_lookup(curve: SpsProfile | OnlineSps) -> SpsFn:
    """SPS at integer batch sizes (NumPy in and out) from the curve's dense `table()`, read through
    its right envelope SPS(B) = max over B' >= B of SPS(B'): no forward is charged more than a
    larger one. On a shared CPU an inversion (B = 7 timed slower than B = 8) is timing noise at
    which Algorithm 1's early break stopped; where one is real, a forward padded to B' runs at
    SPS(B'). Real cliffs stay as measured; so do the profile file and its plot."""
    seen = envelope = None

    def lookup(batch_tokens: np.ndarray) -> np.ndarray:
        nonlocal seen, envelope
        batch = np.asarray(batch_tokens).astype(np.int64)
        table = curve.table(int(batch.max()))
        if table is not seen:  # a refined curve rebuilds its table now and then
            seen, envelope = table, np.maximum.accumulate(table.numpy()[::-1])[::-1]
        return envelope[batch]

    return lookup
