"""DSpark's hardware-aware verify-length policy (paper sections 3.2.2 and 5.2), composed of parts
that each learn from the engine's step statistics."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicyName, PolicySettings
from dspark.engine.verify_policy import Confidences
from dspark.policies.acceptance_scale import AcceptanceScale
from dspark.policies.confidence import ConfidencePolicy
from dspark.policies.drafting_gate import DraftingGate
from dspark.policies.ranking import SpsFn, global_argmax_lengths, prefix_greedy_lengths, topk_survival
from dspark.policies.sps_curve import OnlineSps, table_lookup
from dspark.sps_format import SpsProfile


class AsyncSplit:
    """Paper section 5.2: step t verifies the K = max(0, B* - R_t) candidates of highest survival,
    B* = R_{t-2} + K_{t-2} from a global argmax of Theta (no early break: it sees past jagged
    cliffs) over step t-2's confidences. Lossless: K depends on earlier steps and R_t only. Without
    two earlier steps with confidences, Algorithm 1 ranks the step (`warmup_steps` counts those)."""

    def __init__(self) -> None:
        self._targets: deque[int | None] = deque(maxlen=2)
        self.warmup_steps = 0

    def lengths(self, confidences: np.ndarray, step_rate: SpsFn) -> torch.Tensor:
        num_requests = confidences.shape[0]
        target = self._targets[0] if len(self._targets) == 2 else None
        # The capacity this step hands to step t+2 (computed now, consumed later: ZOS-friendly).
        self._targets.append(num_requests + int(global_argmax_lengths(confidences, step_rate).sum()))
        if target is None:
            self.warmup_steps += 1
            return prefix_greedy_lengths(confidences, step_rate)
        return topk_survival(confidences, max(0, target - num_requests))

    def skip(self) -> None:
        """A step without usable confidences or without drafting: no capacity from it."""
        self._targets.append(None)


class DSparkPolicy(ConfidencePolicy):
    """Ranks against whole engine steps, 1 / (other + draft(R, h) + 1 / SPS(B)): without the costs
    that do not depend on verify lengths, extra verification looks dearer than it is. Learns only
    over an `OnlineSps` curve (a plain profile stays fixed), in drift-free units: measured times
    divided by its drift, forward rates multiplied by it, so costs measured minutes apart compare."""

    name = PolicyName.DSPARK
    asynchronous = False  # rank by `AsyncSplit` rather than Algorithm 1

    def __init__(self, sps: SpsProfile | OnlineSps, settings: PolicySettings = PolicySettings()) -> None:
        self.sps = sps
        self.gate = DraftingGate(settings)
        self.acceptance = AcceptanceScale(settings)
        self.split = AsyncSplit() if self.asynchronous else None
        lookup = table_lookup(sps)
        self._forward_sps = (lambda b: lookup(b) * sps.drift()) if isinstance(sps, OnlineSps) else lookup
        self._longest: int | None = None  # longest verify length of the previous drafted step

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        """The gate's choice between not drafting and drafting h or h - 1 positions, h one past the
        previous step's longest verify length (all of gamma at first): drafting what will not be
        verified only costs time."""
        widest = gamma if self._longest is None else min(gamma, self._longest + 1)
        horizons = range(max(1, widest - 1), widest + 1)
        horizon = self.gate.draft_horizon(num_requests, self._forward_sps, horizons)
        if not horizon and self.split is not None:
            self.split.skip()
        return horizon

    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        fallbacks = self.fallbacks
        lengths = super().verify_lengths(confidences, gamma, num_requests)
        if self.fallbacks > fallbacks and self.split is not None:
            self.split.skip()  # no capacity from this step
        if num_requests:
            self._longest = int(lengths.max())
        return lengths

    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        confidences = self.acceptance.apply(confidences)
        self.gate.remember(confidences)
        num_requests, gamma = confidences.shape
        fixed_s = self.gate.other_s + (self.gate.cost.seconds(num_requests, gamma) or 0.0)
        step_rate = lambda b: 1.0 / (fixed_s + 1.0 / self._forward_sps(b))  # noqa: E731
        if self.split is None:
            return prefix_greedy_lengths(confidences, step_rate)
        return self.split.lengths(confidences, step_rate)

    def observe_step(self, stats: StepStats) -> None:
        if not isinstance(self.sps, OnlineSps):
            return
        self.sps.observe(stats.verify_batch_tokens, stats.forward_time_s)
        self.gate.update(stats, self.sps.drift())
        self.acceptance.update(stats)


class DSparkAsyncPolicy(DSparkPolicy):
    """The production variant: DSpark ranked by the asynchronous split."""

    name = PolicyName.DSPARK_ASYNC
    asynchronous = True
