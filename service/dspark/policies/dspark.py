"""DSpark's hardware-aware verify-length policy (paper sections 3.2.2 and 5.2), composed of parts
that each learn from the engine's step statistics: drafting gate, SPS curve, acceptance scale, and
the synchronous or asynchronous split."""

from __future__ import annotations

import numpy as np
import torch

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicyName, PolicySettings
from dspark.engine.verify_policy import ConfidenceGuard, Confidences, VerifyChoice, VerifyPolicy
from dspark.policies.acceptance import AcceptanceScale
from dspark.policies.drafting_gate import DraftingGate
from dspark.policies.split import AsyncSplit, SynchronousSplit, VerifySplit
from dspark.policies.sps_curve import OnlineSps, table_lookup
from dspark.sps_format import SpsProfile


class DSparkPolicy(VerifyPolicy):
    """Ranks against whole engine steps, 1 / (other + draft(R, h) + 1 / SPS(B)): without the costs
    that verify lengths do not change, verifying more looks dearer than it is. Learns only over an
    `OnlineSps` curve, in drift-free units (times divided by its drift, rates multiplied by it)."""

    def __init__(
        self,
        sps: SpsProfile | OnlineSps,
        split: VerifySplit,
        gate: DraftingGate,
        acceptance: AcceptanceScale,
        name: str = PolicyName.DSPARK,
    ) -> None:
        self.sps, self.split, self.gate, self.acceptance, self.name = sps, split, gate, acceptance, name
        self.guard = ConfidenceGuard(name)
        lookup = table_lookup(sps)
        self._forward_sps = (lambda b: lookup(b) * sps.drift()) if isinstance(sps, OnlineSps) else lookup
        self._longest: int | None = None  # longest verify length of the previous drafted step

    @property
    def fallbacks(self) -> int:
        return self.guard.fallbacks

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        """The gate's choice between not drafting and drafting h or h - 1 positions, h one past the
        previous longest verify length (gamma at first): drafting what is not verified costs time."""
        widest = gamma if self._longest is None else min(gamma, self._longest + 1)
        horizons = range(max(1, widest - 1), widest + 1)
        horizon = self.gate.draft_horizon(num_requests, self._forward_sps, horizons)
        if not horizon:
            self.split.skip()
        return horizon

    def choose(self, confidences: Confidences, gamma: int, num_requests: int) -> VerifyChoice:
        choice = self.guard.choose(confidences, gamma, num_requests, self._lengths)
        if choice.fallback:
            self.split.skip()
        if num_requests:
            self._longest = int(choice.lengths.max())
            self.gate.verified(int(choice.lengths.sum()))
        return choice

    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        confidences = self.acceptance.apply(confidences)
        self.gate.remember(confidences)
        fixed_s = self.gate.other_s + (self.gate.cost.seconds(*confidences.shape) or 0.0)
        step_rate = lambda b: 1.0 / (fixed_s + 1.0 / self._forward_sps(b))  # noqa: E731
        return self.split.lengths(confidences, step_rate)

    def observe_step(self, stats: StepStats) -> None:
        if isinstance(self.sps, OnlineSps):
            self.sps.observe(stats.verify_batch_tokens, stats.forward_time_s)
            self.gate.update(stats, self.sps.drift())
            self.acceptance.update(stats)


def dspark_policy(
    sps: SpsProfile | OnlineSps, settings: PolicySettings = PolicySettings(), asynchronous: bool = False
) -> DSparkPolicy:
    """`dspark` (Algorithm 1 each step), or `dspark-async` (the production variant: the async split)."""
    split = AsyncSplit() if asynchronous else SynchronousSplit()
    name = PolicyName.DSPARK_ASYNC if asynchronous else PolicyName.DSPARK
    return DSparkPolicy(sps, split, DraftingGate(settings), AcceptanceScale(settings), name)


def dspark_async_policy(
    sps: SpsProfile | OnlineSps, settings: PolicySettings = PolicySettings()
) -> DSparkPolicy:
    return dspark_policy(sps, settings, asynchronous=True)
