"""The step-rate curve the SPS policies schedule against: online refinement of an SPS profile
from the engine's own step timings, and the per-step table lookup.

A profile taken on an idle node, or before the hardware drifted (thermals, neighbours on the
node, a driver update), mis-states the step rate. `OnlineSps` keeps the profile as its prior
and learns a multiplicative step-time correction: one drift factor shared by every batch size,
times one factor per measured batch size for the shape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import numpy as np
import torch

from dspark.engine.outputs import StepStats
from dspark.sps_format import SpsCurve, SpsProfile, interp_flat, sps_of_array_or_float


class OnlineSps:
    """SPS(B) = prior SPS(B) / (drift * correction(B)), both learned from observed step times.

    `drift` (rate `drift_alpha`; 0 learns the corrections alone) follows every observation's error
    quickly, so a node that slows down while only some batch sizes run moves the estimate at all
    of them; the per-size log corrections (the curve's shape) move slowly, shared between the two
    grid points around B by closeness, like a running mean in which the prior counts as
    `prior_weight` observations but never slower than an EWMA of rate `alpha`. One observation
    moves either by at most a factor `max_jump` (a stalled step cannot wreck them). The dense
    `table()` is rebuilt at most once per `refresh_every` observations, off the per-step cost.
    """

    def __init__(
        self,
        prior: SpsProfile,
        alpha: float = 0.01,
        prior_weight: float = 4.0,
        max_jump: float = 2.0,
        refresh_every: int = 8,
        drift_alpha: float = 0.1,
    ) -> None:
        valid = {
            f"alpha must be in (0, 1], got {alpha}": 0 < alpha <= 1,
            f"prior_weight must be >= 0, got {prior_weight}": prior_weight >= 0,
            f"refresh_every must be >= 1, got {refresh_every}": refresh_every >= 1,
            f"drift_alpha must be in [0, 1], got {drift_alpha}": 0 <= drift_alpha <= 1,
            f"max_jump must be > 1, got {max_jump}": max_jump > 1,
        }
        if not all(valid.values()):
            raise ValueError("; ".join(rule for rule, ok in valid.items() if not ok))
        self.prior = prior
        self.alpha = alpha
        self.prior_weight = prior_weight
        self.max_log_jump = math.log(max_jump)
        self._grid = [float(b) for b in prior.batch_tokens()]
        self._grid_t = torch.tensor(self._grid, dtype=torch.float64)
        self.drift_alpha = drift_alpha
        self._log_drift = 0.0
        self._log_corr = [0.0] * len(self._grid)
        self._weight = [0.0] * len(self._grid)
        self._log_corr_t: torch.Tensor | None = None
        self.observations = 0
        self.refresh_every = refresh_every
        self._table: torch.Tensor | None = None
        self._table_age = 0
        self._prior_rates: list[float] = []

    def observe(self, batch_tokens: int, seconds: float) -> None:
        """Record that a forward of `batch_tokens` tokens took `seconds`."""
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step time must be a positive finite number of seconds, got {seconds}")
        log_ratio = math.log(seconds * self._prior_rate(batch_tokens))
        neighbours = self._neighbours(float(batch_tokens))
        error = log_ratio - self._log_drift - sum(s * self._log_corr[i] for i, s in neighbours)
        self._log_drift += self.drift_alpha * self._clamp(error)
        for i, share in neighbours:
            # Running mean with the prior as `prior_weight` pseudo-observations, floored at the EWMA rate.
            rate = max(self.alpha * share, share / (self._weight[i] + self.prior_weight + share))
            self._log_corr[i] += rate * self._clamp(log_ratio - self._log_drift - self._log_corr[i])
            self._weight[i] += share
        self._log_corr_t = None
        self.observations += 1
        self._table_age += 1

    def update(self, stats: StepStats) -> None:
        """Observe a step's forward. It also carried the step's prefill chunks: time it against all
        its tokens (timing it against the decode tokens alone taught small B the prefill's cost)."""
        self.observe(stats.verify_batch_tokens + stats.num_prefill_tokens, stats.forward_time_s)

    def _prior_rate(self, batch_tokens: int) -> float:
        """The prior's SPS at an integer B, from a cached list: its scalar lookup builds tensors,
        and indexing a tensor between two forwards (caches cold) takes 50 us."""
        if len(self._prior_rates) <= batch_tokens:
            self._prior_rates = self.prior.table(batch_tokens).tolist()
        return self._prior_rates[batch_tokens]

    def _clamp(self, log_step: float) -> float:
        return max(-self.max_log_jump, min(self.max_log_jump, log_step))

    def drift(self) -> float:
        """The step-time factor shared by every batch size (1.0 until something is observed)."""
        return math.exp(self._log_drift)

    def _neighbours(self, b: float) -> list[tuple[int, float]]:
        grid = self._grid
        if b <= grid[0]:
            return [(0, 1.0)]
        if b >= grid[-1]:
            return [(len(grid) - 1, 1.0)]
        right = bisect.bisect_right(grid, b)
        left = right - 1
        w = (b - grid[left]) / (grid[right] - grid[left])
        return [(i, s) for i, s in ((left, 1.0 - w), (right, w)) if s > 0]

    def sps(self, batch_tokens: torch.Tensor | np.ndarray | float) -> torch.Tensor | np.ndarray | float:
        """Refined steps per second (the input's kind back, like `SpsProfile.sps`)."""
        if not isinstance(batch_tokens, torch.Tensor):
            return sps_of_array_or_float(self.sps, batch_tokens)
        if self._log_corr_t is None:
            self._log_corr_t = torch.tensor(self._log_corr, dtype=torch.float64)
        correction = (interp_flat(batch_tokens, self._grid_t, self._log_corr_t) + self._log_drift).exp()
        return self.prior.sps(batch_tokens) / correction

    def table(self, max_batch_tokens: int) -> torch.Tensor:
        """Refined SPS at every integer B in [0, max_batch_tokens] (and maybe beyond), on the CPU."""
        stale = self._table_age >= self.refresh_every
        if self._table is None or self._table.numel() <= max_batch_tokens or stale:
            size = max(max_batch_tokens + 1, 0 if self._table is None else self._table.numel(), 64)
            self._table = self.sps(torch.arange(size, dtype=torch.float64))
            self._table_age = 0
        return self._table

    def corrections(self) -> list[float]:
        """Estimated / prior step time at each grid point (the drift alone where nothing was observed)."""
        return [math.exp(c + self._log_drift) for c in self._log_corr]


def table_lookup(curve: SpsCurve) -> Callable[[np.ndarray], np.ndarray]:
    """A fast SPS function for integer batch sizes (NumPy in and out), as the scheduler sees the
    curve: a dense per-B table (`table(max_b)`) when the curve keeps one, else its `sps`. The
    scheduler calls this every step.

    A table is read through its right envelope, SPS(B) = max over B' >= B of the measured
    SPS(B'): no forward is charged more than a larger one. On a shared CPU an inversion (B = 7
    timed slower than B = 8) is timing noise, and the early break of Algorithm 1 stopped at such
    a false cliff; where one is real a forward padded to B' would run at SPS(B'). Real cliffs,
    where the rate drops as B grows, stay as measured; so do the profile file and its plot.
    """
    table_fn = getattr(curve, "table", None)
    if table_fn is None:
        return lambda batch_tokens: np.asarray(curve.sps(np.asarray(batch_tokens, dtype=np.float64)))
    seen = envelope = None

    def lookup(batch_tokens: np.ndarray) -> np.ndarray:
        nonlocal seen, envelope
        batch = np.asarray(batch_tokens).astype(np.int64)
        table = table_fn(int(batch.max()))
        if table is not seen:  # a refined curve rebuilds its table now and then
            seen, envelope = table, np.maximum.accumulate(table.numpy()[::-1])[::-1]
        return envelope[batch]

    return lookup
