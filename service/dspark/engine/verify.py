"""The verify phase of a step: accepted draft tokens of the decodes, first tokens of prompts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.drafting import Draft
from dspark.engine.model_runner import StepForward
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors, sample
from dspark.engine.scheduler import StepPlan
from dspark.engine.target_logits import ProcessedRows, process_rows, target_argmax, target_probs
from dspark.engine.verifier import verify_draft_tokens, verify_greedy


@dataclass
class Verified:
    """What the target decided this step."""

    accepted: list[int]  # per decode: draft tokens accepted
    new_tokens: list[list[int]]  # per decode: the accepted drafts and the target's next token
    row_logits: torch.Tensor | None  # [R, max carried + 1, V] the decodes' verification logits
    first_tokens: list[tuple[Request, int, int]]  # (request, token, logit row) per completed prompt


def verify(plan: StepPlan, draft: Draft, forward: StepForward, device: torch.device) -> Verified:
    """Verify the decodes' drafts, then sample the first token of every prompt this step completes."""
    accepted, new_tokens, row_logits = [], [], None
    decodes = plan.decodes
    if decodes:
        width = max(draft.lengths)
        # A row whose grammar cut its forward at draft k never reads past row k (draft k is
        # rejected), so the rows stop at the longest forward: width + 1, or width when cut.
        row_logits = verification_logits(
            forward.output.logits, forward.logit_starts[: len(decodes)], draft.carried, max(draft.carried)
        )
        accepted, nexts = _verify_decodes(decodes, draft, row_logits, width, device)
        drafted = draft.token_lists()
        new_tokens = [drafted[i][:n] + [nexts[i]] for i, n in enumerate(accepted)]
    return Verified(accepted, new_tokens, row_logits, _first_tokens(plan, forward, device))


def _verify_decodes(
    decodes: list[Request], draft: Draft, row_logits: torch.Tensor, width: int, device: torch.device
) -> tuple[list[int], list[int]]:
    """(accepted drafts, next token) per decode, read back in one device-to-host copy: rejection
    sampling from the processed target distribution; all-greedy batches skip the probabilities
    (same result, less work)."""
    tokens = draft.block.tokens[:, :width]
    processed = process_rows(decodes, row_logits, tokens, draft.carried)
    if width == 0:  # plain decoding: nothing to accept, only the next token (what gamma 0 verifies)
        return [0] * len(decodes), _next_tokens(decodes, row_logits, processed, device)[:, 0].tolist()
    host_lengths = _verify_lengths(decodes, draft)
    if all(r.params.greedy for r in decodes):
        # Every row verifying the whole width (the `full` policy) needs no budget mask.
        lengths = None if min(host_lengths) == width else torch.tensor(host_lengths, device=device)
        result = verify_greedy(tokens, target_argmax(row_logits, processed), lengths)
    else:
        sampling = SamplingTensors.for_requests(decodes, device)
        lengths = torch.tensor(host_lengths, device=device)
        probs = draft.block.probs[:, :width] if draft.block.probs is not None else None
        target = target_probs(row_logits, sampling, processed)
        result = verify_draft_tokens(tokens, probs, target, lengths, sampling.generators, host_lengths)
    accepted, nexts = torch.stack(result).tolist()
    return accepted, nexts


def _verify_lengths(decodes: list[Request], draft: Draft) -> list[int]:
    """Each decode's verify length. A request whose grammar failed while its rows were processed
    (its masks forbid nothing now) verifies only the drafts its forward carried: it finishes with
    an error, and must not accept a draft whose logits and KV its forward never computed."""
    return [
        carried if r.grammar is not None and r.grammar.error is not None else n
        for r, n, carried in zip(decodes, draft.lengths, draft.carried, strict=True)
    ]


def _first_tokens(
    plan: StepPlan, forward: StepForward, device: torch.device
) -> list[tuple[Request, int, int]]:
    """Sample each completed prompt's first output token at its chunk's last logit row."""
    num_decodes = len(plan.decodes)
    completed = [
        (request, forward.logit_starts[num_decodes + i])
        for i, (request, chunk) in enumerate(plan.prefills)
        if request.num_cached + chunk == len(request.prompt_token_ids)
    ]
    if not completed:
        return []
    done = [r for r, _ in completed]
    rows = torch.tensor([row for _, row in completed], device=device)
    logits = forward.output.logits[rows]
    processed = process_rows(done, logits)  # penalties, logit_bias, grammars
    first = _next_tokens(done, logits, processed, device).tolist()
    return [(r, token, row) for (r, row), token in zip(completed, first, strict=True)]


def _next_tokens(
    requests: list[Request], logits: torch.Tensor, processed: ProcessedRows | None, device: torch.device
) -> torch.Tensor:
    """The target's token at every row of logits [R, ..., V]: the argmax for an all-greedy batch
    (no probabilities), else sampled with each request's parameters and generator."""
    if all(r.params.greedy for r in requests):
        return target_argmax(logits, processed)
    sampling = SamplingTensors.for_requests(requests, device)
    return sample(target_probs(logits, sampling, processed), sampling.generators)


def verification_logits(
    logits: torch.Tensor, starts: list[int], lengths: list[int], width: int
) -> torch.Tensor:
    """[R, width + 1, V]: each decode's logits at its anchor and the drafts its forward carried
    (`lengths`; rows past its own length repeat its last one)."""
    index = [start + min(k, n) for start, n in zip(starts, lengths, strict=True) for k in range(width + 1)]
    if index == list(range(len(index))):  # every decode verified `width` drafts (plain decoding always)
        return logits[: len(index)].view(len(starts), width + 1, -1)
    return logits[torch.tensor(index, device=logits.device)].view(len(starts), width + 1, -1)
