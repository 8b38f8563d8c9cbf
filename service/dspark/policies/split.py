"""How the DSpark policy turns a step's confidences into verify lengths: synchronously by Algorithm 1,
or asynchronously from a capacity that earlier steps fixed (paper section 5.2)."""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np
import torch

from dspark.policies.ranking import SpsFn, global_argmax_lengths, prefix_greedy_lengths, topk_survival


class VerifySplit(Protocol):
    def lengths(self, confidences: np.ndarray, step_rate: SpsFn) -> torch.Tensor:
        """Verify lengths [R] for finite confidences [R, w] against the step rate."""

    def skip(self) -> None:
        """A step without usable confidences, or without drafting."""


class SynchronousSplit:
    """Algorithm 1 over this step's confidences: causal by its early break."""

    def lengths(self, confidences: np.ndarray, step_rate: SpsFn) -> torch.Tensor:
        return prefix_greedy_lengths(confidences, step_rate)

    def skip(self) -> None:  # nothing carries over between steps
        pass


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
