"""DSpark's hardware-aware verify-length policy (paper sections 3.2.2 and 5.2), built from parts:
a ranking (Algorithm 1, or the asynchronous split), the drafting gate, the live acceptance scale,
the online SPS refinement and the step's costs outside the forward. Each part learns from the
engine's step statistics in its own `update()`; the policy only wires them together."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicyName, PolicySettings
from dspark.engine.verify_policy import Confidences
from dspark.policies.acceptance_scale import AcceptanceScale
from dspark.policies.confidence import ConfidencePolicy
from dspark.policies.drafting_gate import DraftingGate, ewma
from dspark.policies.ranking import SpsFn, global_argmax_lengths, prefix_greedy_lengths, topk_survival
from dspark.policies.sps_curve import OnlineSps, table_lookup
from dspark.sps_format import SpsCurve, SpsProfile


def as_sps_curve(
    sps: SpsProfile | OnlineSps | SpsCurve, refine: bool = True, settings: PolicySettings | None = None
) -> SpsCurve:
    """A profile becomes an `OnlineSps` (so measured step times refine it) unless refine=False."""
    if isinstance(sps, SpsProfile) and refine:
        s = settings or PolicySettings()
        return OnlineSps(
            sps, s.sps_alpha, s.sps_prior_weight, s.sps_max_jump, s.sps_refresh_every, s.sps_drift_alpha
        )
    if not hasattr(sps, "sps"):
        raise TypeError(f"expected an SPS profile or curve, got {type(sps).__name__}")
    return sps


class StepCosts:
    """A decode step's seconds besides its forward and drafting (acceptance, cache commits), as
    EWMAs in drift-free units: `other_s` over drafted steps, `plain_other_s` over undrafted ones
    (None until one is measured). Drafted steps accept more; charging that to plain decoding
    biased the gate towards drafting."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.other_s = 0.0
        self.plain_other_s: float | None = None

    def update(self, stats: StepStats, drift: float) -> None:
        other_s = (stats.step_time_s - stats.forward_time_s - stats.draft_time_s) / drift
        if stats.num_prefill_tokens or other_s < 0:  # prefills add their own cache commits
            return
        if stats.drafted:
            self.other_s = ewma(self.other_s, other_s, self.alpha)
        else:
            self.plain_other_s = ewma(self.plain_other_s, other_s, self.alpha)


class Algorithm1:
    """The greedy prefix ranking with early break, on this step's confidences."""

    def lengths(self, confidences: np.ndarray, step_rate: SpsFn) -> torch.Tensor:
        return prefix_greedy_lengths(confidences, step_rate)

    def skip(self) -> None:
        """A step without usable confidences or without drafting: nothing to remember."""


class AsyncSplit:
    """Capacity from two steps ago, top-K of the current survival (paper section 5.2).

    Step t keeps B* = R_{t-2} + K_{t-2} from a global argmax of Theta over step t-2's confidences
    (no early break, so it sees past jagged SPS cliffs) and verifies the K = max(0, B* - R_t)
    candidates of its own confidences with the highest survival. Lossless: K depends only on
    earlier steps and R_t, and a token's rank only on values ranked above it. Without two earlier
    steps with confidences the step is ranked by Algorithm 1 (`warmup_steps` counts those).
    """

    lag = 2

    def __init__(self) -> None:
        self._targets: deque[int | None] = deque(maxlen=self.lag)
        self.warmup_steps = 0

    def lengths(self, confidences: np.ndarray, step_rate: SpsFn) -> torch.Tensor:
        num_requests = confidences.shape[0]
        target = self._targets[0] if len(self._targets) == self.lag else None
        # The capacity this step hands to step t+2 (computed now, consumed later: ZOS-friendly).
        self._targets.append(num_requests + int(global_argmax_lengths(confidences, step_rate).sum()))
        if target is None:
            self.warmup_steps += 1
            return prefix_greedy_lengths(confidences, step_rate)
        return topk_survival(confidences, max(0, target - num_requests))

    def skip(self) -> None:
        self._targets.append(None)


class DSparkPolicy(ConfidencePolicy):
    """Ranks against the rate of whole engine steps: 1 / (other + draft(R, h) + 1 / SPS(B)).

    Drafting and acceptance costs do not depend on the verify lengths; leaving them out would
    overstate the cost of extra verification. Confidences are rescaled by `AcceptanceScale`, and
    the `DraftingGate` skips drafting where a step is expected to be faster without it; all from
    earlier steps, so verify lengths stay lossless. Measured times are divided by the SPS curve's
    drift and forward rates multiplied by it: decisions run in drift-free units, so a cost
    measured while the node was slow does not mislead after it sped up.
    """

    name = PolicyName.DSPARK

    def __init__(
        self,
        sps: SpsProfile | OnlineSps | SpsCurve,
        refine: bool = True,
        settings: PolicySettings | None = None,
        ranking: Algorithm1 | AsyncSplit | None = None,
    ) -> None:
        super().__init__()
        s = self.settings = settings or PolicySettings()
        self.sps = as_sps_curve(sps, refine, s)
        self.costs = StepCosts(s.overhead_alpha)
        self.gate = DraftingGate(
            s.explore_every, s.memory_rows, s.min_gain, s.reuse_steps, s.draft_cost_alpha
        )
        self.acceptance = AcceptanceScale(s.acceptance_decay, s.acceptance_prior_tokens)
        self.ranking = ranking or Algorithm1()
        self._forward_sps = table_lookup(self.sps)
        if isinstance(self.sps, OnlineSps):
            lookup, curve = self._forward_sps, self.sps
            self._forward_sps = lambda b: lookup(b) * curve.drift()
        self._longest: int | None = None  # longest verify length of the previous drafted step

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        """0 when the gate finds this step faster without drafting; else the horizon h or h - 1,
        whichever the gate expects to be faster, where h is one past the previous step's longest
        verify length (all of gamma at first): drafting what will not be verified only costs
        time, so the horizon can grow by one per step and shrink when its last position does not
        pay for itself. Both depend on earlier steps only, so verify lengths stay lossless."""
        widest = gamma if self._longest is None else min(gamma, self._longest + 1)
        horizons = range(max(1, widest - 1), widest + 1)
        horizon = self.gate.draft_horizon(
            num_requests, self._forward_sps, self.costs.other_s, self.costs.plain_other_s, horizons
        )
        if not horizon:
            self.ranking.skip()
        return horizon

    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        lengths = super().verify_lengths(confidences, gamma, num_requests)
        if num_requests:
            self._longest = int(lengths.max())
        return lengths

    def _prepare(self, confidences: np.ndarray) -> np.ndarray:
        confidences = self.acceptance.apply(confidences)
        self.gate.remember(confidences)
        return confidences

    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        num_requests, gamma = confidences.shape
        fixed_s = self.costs.other_s + (self.gate.cost.seconds(num_requests, gamma) or 0.0)
        return self.ranking.lengths(confidences, lambda b: 1.0 / (fixed_s + 1.0 / self._forward_sps(b)))

    def _on_fallback(self) -> None:
        self.ranking.skip()

    def observe_step(self, stats: StepStats) -> None:
        if not isinstance(self.sps, OnlineSps):  # a fixed curve (refine=False) learns nothing
            return
        self.sps.update(stats)
        drift = self.sps.drift()
        self.gate.update(stats, drift)
        self.acceptance.update(stats)
        self.costs.update(stats, drift)


class DSparkAsyncPolicy(DSparkPolicy):
    """The production variant: DSpark with the asynchronous split as its ranking (`AsyncSplit`)."""

    name = PolicyName.DSPARK_ASYNC

    def __init__(
        self,
        sps: SpsProfile | OnlineSps | SpsCurve,
        refine: bool = True,
        settings: PolicySettings | None = None,
    ) -> None:
        super().__init__(sps, refine, settings, AsyncSplit())
