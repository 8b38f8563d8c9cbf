"""DSpark's hardware-aware verify-length policy (paper sections 3.2.2 and 5.2), composed of parts
that each learn from the engine's step statistics: gate, SPS curve, acceptance scale, async split."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicyName, PolicySettings
from dspark.engine.verify_policy import ConfidencePolicy, Confidences
from dspark.policies.drafting_gate import DraftingGate
from dspark.policies.ranking import SpsFn, global_argmax_lengths, prefix_greedy_lengths, topk_survival
from dspark.policies.sps_curve import OnlineSps, table_lookup
from dspark.sps_format import SpsProfile


class AcceptanceScale:
    """Per position k: accepted draft tokens over predicted survival, summed with forgetting per
    request round that verified, plus a prior at ratio 1: over-confident live survival verifies too much."""

    def __init__(self, settings: PolicySettings = PolicySettings()) -> None:
        self.settings = settings
        self._predicted, self._accepted = np.zeros(0), np.zeros(0)

    def observe(self, predicted: Sequence[float], accepted: Sequence[int], rounds: int = 1) -> None:
        """One drafted step's survival and accepted tokens per position; `rounds` requests verified."""
        if not predicted or not all(math.isfinite(p) and p >= 0 for p in predicted):
            return
        forget = self.settings.acceptance_decay ** max(rounds, 1)
        self._predicted = _grown(self._predicted, len(predicted)) * forget
        self._accepted = _grown(self._accepted, len(predicted)) * forget
        self._predicted[: len(predicted)] += predicted
        counts = np.asarray(list(accepted)[: len(predicted)], dtype=np.float64)
        self._accepted[: counts.size] += counts

    def update(self, stats: StepStats) -> None:
        if stats.drafted:
            rounds = sum(budget > 0 for budget in stats.verify_budgets)
            self.observe(stats.predicted_per_position, stats.accepted_per_position, rounds)

    def factors(self, width: int) -> np.ndarray:
        """[width] observed / predicted survival per position (1 where nothing was verified)."""
        pred, acc = _grown(self._predicted, width)[:width], _grown(self._accepted, width)[:width]
        prior = self.settings.acceptance_prior_tokens
        return (acc + prior) / (pred + prior)

    def apply(self, confidences: np.ndarray) -> np.ndarray:
        """Confidences [R, w] whose survival is the input's times `factors`, in [0, 1] and non-increasing."""
        survival = np.cumprod(confidences, axis=1) * self.factors(confidences.shape[1])
        survival = np.minimum.accumulate(np.clip(survival, 0.0, 1.0), axis=1)
        before = np.concatenate([np.ones((survival.shape[0], 1)), survival[:, :-1]], axis=1)
        return np.where(before > 0, survival / np.maximum(before, 1e-300), 0.0)


def _grown(values: np.ndarray, width: int) -> np.ndarray:
    return values if values.size >= width else np.pad(values, (0, width - values.size))


class AsyncSplit:
    """Paper section 5.2: step t verifies the K = max(0, B* - R_t) candidates of highest survival,
    B* = R_{t-2} + K_{t-2} from a global argmax of Theta over step t-2's confidences (lossless: K
    depends on earlier steps and R_t only); else Algorithm 1 ranks the step (`warmup_steps`)."""

    def __init__(self) -> None:
        self._targets: deque[int | None] = deque([None, None], maxlen=2)  # B* of steps t-2, t-1
        self.warmup_steps = 0

    def lengths(self, confidences: np.ndarray, step_rate: SpsFn) -> torch.Tensor:
        target, num_requests = self._targets[0], confidences.shape[0]
        # The capacity this step hands to step t+2 (computed now, consumed later: ZOS-friendly).
        self._targets.append(num_requests + int(global_argmax_lengths(confidences, step_rate).sum()))
        if target is None:
            self.warmup_steps += 1
            return prefix_greedy_lengths(confidences, step_rate)
        return topk_survival(confidences, max(0, target - num_requests))

    def skip(self) -> None:  # a step without usable confidences or drafting gives no capacity
        self._targets.append(None)


class DSparkPolicy(ConfidencePolicy):
    """Ranks against whole engine steps, 1 / (other + draft(R, h) + 1 / SPS(B)): without the costs
    that verify lengths do not change, verifying more looks dearer than it is. Learns only over an
    `OnlineSps` curve, in drift-free units (times divided by its drift, rates multiplied by it)."""

    name = PolicyName.DSPARK
    asynchronous = False  # rank by `AsyncSplit` rather than Algorithm 1

    def __init__(self, sps: SpsProfile | OnlineSps, settings: PolicySettings = PolicySettings()) -> None:
        self.sps, self.gate, self.acceptance = sps, DraftingGate(settings), AcceptanceScale(settings)
        self.split = AsyncSplit() if self.asynchronous else None
        lookup = table_lookup(sps)
        self._forward_sps = (lambda b: lookup(b) * sps.drift()) if isinstance(sps, OnlineSps) else lookup
        self._longest: int | None = None  # longest verify length of the previous drafted step

    def max_length(self, gamma: int, num_requests: int = 1) -> int:
        """The gate's choice between not drafting and drafting h or h - 1 positions, h one past the
        previous longest verify length (gamma at first): drafting what is not verified costs time."""
        widest = gamma if self._longest is None else min(gamma, self._longest + 1)
        horizons = range(max(1, widest - 1), widest + 1)
        horizon = self.gate.draft_horizon(num_requests, self._forward_sps, horizons)
        if not horizon and self.split:
            self.split.skip()
        return horizon

    def verify_lengths(self, confidences: Confidences, gamma: int, num_requests: int) -> torch.Tensor:
        fallbacks = self.fallbacks
        lengths = super().verify_lengths(confidences, gamma, num_requests)
        if self.fallbacks > fallbacks and self.split:
            self.split.skip()
        if num_requests:
            self._longest = int(lengths.max())
            self.gate.verified(int(lengths.sum()))
        return lengths

    def _lengths(self, confidences: np.ndarray) -> torch.Tensor:
        confidences = self.acceptance.apply(confidences)
        self.gate.remember(confidences)
        fixed_s = self.gate.other_s + (self.gate.cost.seconds(*confidences.shape) or 0.0)
        step_rate = lambda b: 1.0 / (fixed_s + 1.0 / self._forward_sps(b))  # noqa: E731
        return (self.split.lengths if self.split else prefix_greedy_lengths)(confidences, step_rate)

    def observe_step(self, stats: StepStats) -> None:
        if isinstance(self.sps, OnlineSps):
            self.sps.observe(stats.verify_batch_tokens, stats.forward_time_s)
            self.gate.update(stats, self.sps.drift())
            self.acceptance.update(stats)


class DSparkAsyncPolicy(DSparkPolicy):
    name = PolicyName.DSPARK_ASYNC  # the production variant
    asynchronous = True
