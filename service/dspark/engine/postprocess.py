"""The postprocess phase of a step: advance requests, commit drafter context, emit outputs."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dspark.engine.drafter import Drafter
from dspark.engine.drafting import Draft
from dspark.engine.model_runner import StepForward
from dspark.engine.outputs import RequestOutput, TokenLogprob
from dspark.engine.request import Request, RequestStatus
from dspark.engine.scheduler import StepPlan
from dspark.engine.stopping import append_tokens, new_text
from dspark.engine.verify import Verified

Finish = Callable[[Request], None]


def postprocess(
    plan: StepPlan,
    draft: Draft,
    verified: Verified,
    forward: StepForward,
    drafter: Drafter,
    eos_ids: frozenset[int],
    finish: Finish,
) -> list[RequestOutput]:
    """Cache what the target kept, hand its features to the drafter, and emit the new tokens."""
    hidden, offsets, outputs = forward.output.layer_hidden, forward.offsets, []
    decodes = plan.decodes
    for i, request in enumerate(decodes):
        n = verified.accepted[i]
        request.num_cached += 1 + n
        request.stats.rounds += 1
        request.stats.draft_tokens += draft.lengths[i]
        request.stats.drafts += draft.lengths[i] > 0
        request.stats.accepted_tokens += n
        outputs.append(
            emit(request, verified.new_tokens[i], verified.row_logits[i, : n + 1], eos_ids, finish)
        )
    if decodes:  # requests that just finished were released from the drafter: commit the live ones
        spans = _spans(hidden, offsets, [1 + n for n in verified.accepted])
        live = [i for i, r in enumerate(decodes) if r.status is not RequestStatus.FINISHED]
        drafter.commit([decodes[i] for i in live], [spans[i] for i in live])
    for request, chunk in plan.prefills:
        request.num_cached += chunk
    drafter.commit(
        [r for r, _ in plan.prefills],
        _spans(hidden, offsets[len(decodes) :], [c for _, c in plan.prefills]),
    )
    logits = forward.output.logits
    for request, token, row in verified.first_tokens:
        outputs.append(emit(request, [token], logits[row : row + 1], eos_ids, finish))
    return outputs


def emit(
    request: Request, tokens: list[int], token_logits: torch.Tensor, eos_ids: frozenset[int], finish: Finish
) -> RequestOutput:
    """Append tokens (with stop checks), detokenize the delta and deliver it."""
    now = time.perf_counter()
    if request.stats.first_token_time is None:
        request.stats.first_token_time = now
    kept = append_tokens(request, tokens, eos_ids)
    tokens = tokens[:kept]
    if request.grammar is not None and not request.grammar.advance(tokens):
        request.finish_reason = "error"  # this request alone
    delta = ""
    if request.detokenizer is not None:
        # The EOS or stop token that finished the request has no text unless asked for.
        by_token = request.finish_reason == "stop" and not request.params.include_stop_str_in_output
        text = request.detokenizer.update(final=request.finish_reason is not None, drop_last=by_token)
        delta = new_text(request, text)
    logprobs, stats = None, None
    if request.params.logprobs is not None:
        logprobs = _logprobs(token_logits[:kept], tokens, request.params.logprobs)
    finished = request.finish_reason is not None
    if finished:
        request.stats.finish_time = now
        finish(request)
        stats = request.stats
    output = RequestOutput(
        request.request_id,
        tokens,
        delta,
        finished=finished,
        finish_reason=request.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=len(request.output_token_ids),
        stats=stats,
        error=request.grammar.error if request.grammar is not None else None,
    )
    deliver(request, output)
    return output


def deliver(request: Request, output: RequestOutput) -> None:
    if request.on_output is not None:
        request.on_output(output)


def _spans(hidden: torch.Tensor | None, offsets: list[int], counts: list[int]) -> list[torch.Tensor | None]:
    if hidden is None:
        return [None] * len(counts)
    return [hidden[start : start + n] for start, n in zip(offsets, counts, strict=False)]


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    alternatives = torch.topk(logp, top, dim=-1) if top else None
    result = []
    for i, token in enumerate(tokens):
        alts = (
            list(zip(alternatives.indices[i].tolist(), alternatives.values[i].tolist(), strict=True))
            if top
            else []
        )
        result.append(TokenLogprob(token, chosen[i], alts))
    return result
