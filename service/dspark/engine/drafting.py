"""The draft phase of a step: propose a block, let the policy choose verify lengths, trim them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.engine.drafter import DraftBlock, Drafter
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.structured import forbidden_drafts
from dspark.engine.verify_policy import VerifyPolicy, host_array, survival_probabilities


@dataclass
class Draft:
    """This step's drafts for the decoding requests and how much of each is verified."""

    block: DraftBlock
    lengths: list[int]  # l_r per decoding request: the draft tokens it verifies
    carried: list[int] | None = None  # draft tokens its forward carries: l_r, or fewer (`cut_at_grammars`)
    # block.tokens on the host, at least max(lengths) wide (`token_lists`): read once per step, for
    # the forward's inputs and the accepted tokens alike (each read is a device-to-host copy).
    host_tokens: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.carried is None:
            self.carried = list(self.lengths)

    def token_lists(self) -> list[list[int]]:
        """Each decode's draft tokens on the host (rows at least max(lengths) long)."""
        if self.host_tokens is None:
            width = max(self.lengths, default=0)
            self.host_tokens = self.block.tokens[:, :width].tolist() if width else [[] for _ in self.lengths]
        return self.host_tokens


@dataclass
class DraftReport:
    """What the draft phase measured, for the step's statistics."""

    drafted: bool = False  # the drafter ran
    horizon: int = 0  # positions drafted per request
    draft_time_s: float = 0.0
    schedule_time_s: float = 0.0  # the policy's choice and the clipping after it
    policy_fallback: bool = False
    predicted_accepted_tokens: float | None = None
    predicted_per_position: list[float] = field(default_factory=list)


def draft(
    drafter: Drafter, policy: VerifyPolicy, decodes: list[Request], horizon: int, device: torch.device
) -> tuple[Draft, DraftReport]:
    """Draft up to `horizon` tokens per decode and choose how many of each to verify."""
    t0 = time.perf_counter()
    caps = [r.params.max_draft_tokens for r in decodes]  # per request; None: the policy decides
    if None not in caps:
        horizon = min(horizon, max(caps, default=0))
    if horizon == 0:  # nothing to decode, the policy does not draft, or no request speculates
        empty = torch.zeros((len(decodes), 0), dtype=torch.int64, device=device)
        return Draft(DraftBlock(empty, None), [0] * len(decodes)), DraftReport()
    block = drafter.propose(decodes, SamplingTensors.for_requests(decodes, device, drafting=True), horizon)
    t1 = time.perf_counter()
    width = min(horizon, block.tokens.shape[1])
    # On the host once, for the policy and the statistics below (one device copy per step).
    confidences = host_array(block.confidences[:, :width]) if block.confidences is not None else None
    choice = policy.choose(confidences, width, len(decodes))
    report = DraftReport(True, width, t1 - t0, policy_fallback=choice.fallback)
    lengths, carried = trimmed_lengths(choice.lengths.cpu().numpy(), block, decodes)
    if confidences is not None:  # what the confidence head expects to be accepted
        survival = survival_probabilities(confidences)
        verified = np.arange(survival.shape[1]) < lengths[:, None]
        per_position = np.where(verified, survival, 0.0).sum(axis=0)
        report.predicted_accepted_tokens = float(per_position.sum())
        report.predicted_per_position = per_position.tolist()
    report.schedule_time_s = time.perf_counter() - t1
    result = Draft(block, lengths.tolist(), carried)
    result.token_lists()  # read now, at the confidences' sync point: the device is idle by now
    return result, report


def trimmed_lengths(
    lengths: np.ndarray, block: DraftBlock, decodes: Sequence[Request]
) -> tuple[np.ndarray, list[int]]:
    """The policy's lengths within what each request can verify: the block's valid drafts, room for
    the bonus token, the request's own cap, and its grammar (`cut_at_grammars`); with the drafts each
    forward carries."""
    if block.num_valid is not None:
        lengths = np.minimum(lengths, block.num_valid.cpu().numpy())
    lengths = np.maximum(np.minimum(lengths, verify_limits(decodes)), 0)
    verified, carried = cut_at_grammars(decodes, block.tokens, lengths.tolist())
    return np.array(verified, dtype=np.int64), carried


def cut_at_grammars(
    decodes: Sequence[Request], tokens: torch.Tensor, lengths: list[int]
) -> tuple[list[int], list[int]]:
    """(verify lengths, draft tokens each forward carries) once every structured request's grammar
    has checked its drafts: where it forbids draft k < l_r, the request verifies drafts 0..k and
    its forward carries drafts 0..k-1 only.

    Lossless: draft k has zero probability under the constrained target, so verification rejects
    it whatever the later rows hold, and the token drawn in its place (from the residual of row k,
    or row k's argmax) needs only row k, which a forward over the anchor and drafts 0..k-1 gives.
    Cutting the verify length to k instead would draw that token from row k itself, not from the
    residual, which is wrong for sampled drafts."""
    forbidden = forbidden_drafts([r.grammar for r in decodes], tokens, lengths)
    verified = [n if k is None else k + 1 for n, k in zip(lengths, forbidden, strict=True)]
    carried = [n if k is None else k for n, k in zip(lengths, forbidden, strict=True)]
    return verified, carried


def verify_limits(decodes: Sequence[Request]) -> list[int]:
    """The most draft tokens each request may verify this step: room for the bonus token within
    max_tokens, and the request's own cap (`max_draft_tokens`, 0 = no speculation)."""
    return [
        r.remaining_tokens - 1
        if (cap := r.params.max_draft_tokens) is None
        else min(r.remaining_tokens - 1, cap)
        for r in decodes
    ]


def draft_lists(draft: Draft) -> list[list[int]]:
    """Each decode's draft tokens that its forward carries, as the runner feeds them."""
    if not draft.carried or max(draft.carried) == 0:
        return [[] for _ in draft.carried]
    return [row[:n] for row, n in zip(draft.token_lists(), draft.carried, strict=True)]
