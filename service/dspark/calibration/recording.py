"""Recording speculative rounds from the engine without touching its hot path.

`RecordingDrafter` wraps any drafter: it passes every call through and remembers, per `propose`,
the block's confidences and each request's accepted / drafted counters; `flush` (after the engine
step that verified the block) turns the counter deltas into rounds. Drafters are loaded without
their calibration file so the recorded confidences are the raw ones (`load_drafter(..., calibrated=False)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.calibration.rounds import RoundLog
from dspark.engine.drafter import DraftBlock, Drafter, WrappingDrafter
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.sampling_params import SamplingParams

# float32 sigmoid saturates at |logit| ~ 17; recovered logits are clipped there.
_EPS = 1e-7


@dataclass
class _Pending:
    requests: list[Request]
    accepted_before: list[int]
    drafted_before: list[int]
    confidences: torch.Tensor | None  # [R, gamma] on the drafter's device


class RecordingDrafter(WrappingDrafter):
    """Delegates to `inner`; records (raw confidence logits, verified, accepted) per request and round."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner)
        self._pending: list[_Pending] = []
        self._logits: list[np.ndarray] = []
        self._accepted: list[int] = []
        self._verified: list[int] = []
        self._requests: list[str] = []

    def fresh_copy(self) -> RecordingDrafter:
        return RecordingDrafter(self.inner.fresh_copy())

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        block = self.inner.propose(requests, sampling, horizon)
        self._pending.append(
            _Pending(
                list(requests),
                [r.stats.accepted_tokens for r in requests],
                [r.stats.draft_tokens for r in requests],
                block.confidences,
            )
        )
        return block

    def flush(self) -> None:
        """Turn the blocks verified since the last flush into rounds (call after each engine step)."""
        for pending in self._pending:
            if pending.confidences is None:
                logits = np.full((len(pending.requests), self.gamma), np.nan)
            else:
                c = pending.confidences.float().cpu().double().numpy().clip(_EPS, 1 - _EPS)
                logits = np.log(c) - np.log1p(-c)
            for i, request in enumerate(pending.requests):
                verified = request.stats.draft_tokens - pending.drafted_before[i]
                self._logits.append(logits[i])
                self._verified.append(verified)
                self._accepted.append(request.stats.accepted_tokens - pending.accepted_before[i])
                self._requests.append(request.request_id)
        self._pending.clear()

    def rounds(self, domain_of: Callable[[str], str] = lambda rid: rid.split("/", 1)[0]) -> RoundLog:
        """Everything recorded so far; a round's domain is its request id's prefix before '/'."""
        self.flush()
        logits = np.stack(self._logits) if self._logits else np.zeros((0, self.gamma))
        return RoundLog(
            logits,
            np.array(self._accepted, dtype=np.int64),
            np.array(self._verified, dtype=np.int64),
            np.array([domain_of(r) for r in self._requests], dtype=str),
            np.array(self._requests, dtype=str),
        )


def record_rounds(
    engine,
    drafter: RecordingDrafter,
    prompts: dict[str, list[list[int]]],
    params: Callable[[int], SamplingParams],
    progress: Callable[[int], None] | None = None,
) -> RoundLog:
    """Run every domain's prompts (token ids) through `engine` (whose drafter is `drafter`) to completion;
    request `i` of a domain gets `params(i)` and id `domain/i`."""
    if engine.drafter is not drafter:
        raise ValueError("the engine must draft with the recording drafter")
    for domain, token_lists in prompts.items():
        for i, ids in enumerate(token_lists):
            engine.add_request(ids, params(i), request_id=f"{domain}/{i}")
    while engine.has_unfinished_requests():
        finished = sum(out.finished for out in engine.step())
        drafter.flush()
        if progress and finished:
            progress(finished)
    return drafter.rounds()
