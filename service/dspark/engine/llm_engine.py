"""The draft-verify engine: continuous batching over one ragged forward per step."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.engine.config import EngineConfig
from dspark.engine.detokenizer import Detokenizer
from dspark.engine.drafter import DraftBlock, Drafter
from dspark.engine.model_runner import ModelRunner, StepForward
from dspark.engine.outputs import RequestOutput, RequestStats, StepStats, TokenLogprob
from dspark.engine.prefix_cache import PrefixCache
from dspark.engine.request import Request, RequestStatus
from dspark.engine.sampler import SamplingTensors, sample
from dspark.engine.sampling_params import SamplingParams
from dspark.engine.scheduler import Scheduler, StepPlan
from dspark.engine.stopping import append_tokens, new_text
from dspark.engine.structured import GrammarCompiler
from dspark.engine.survival import host_array, survival_probabilities
from dspark.engine.target_logits import process_rows, target_argmax, target_probs
from dspark.engine.verifier import verify_draft_tokens, verify_greedy
from dspark.engine.verify_policy import VerifyPolicy
from dspark.models.config import head_dim
from dspark.models.kv_cache import KVCache, check_kv_budget


@dataclass
class Draft:
    """This step's drafts for the decoding requests and how much of each is verified."""

    block: DraftBlock
    lengths: list[int]  # l_r per decoding request


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: RequestStats


class LLMEngine:
    """Owns the target, its KV cache, a drafter and a verify-length policy. Not thread-safe."""

    def __init__(
        self,
        config: EngineConfig,
        model,
        tokenizer,
        drafter: Drafter,
        policy: VerifyPolicy,
        device: torch.device,
        dtype: torch.dtype,
        model_name: str,
    ) -> None:
        _check_drafter_device(drafter, device)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.policy = policy
        self.device = device
        self.dtype = dtype
        self.model_name = model_name
        self.max_model_len = min(config.max_model_len, model.config.max_position_embeddings)
        mc = model.config
        per_token = KVCache.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim(mc), dtype)
        check_kv_budget(per_token, config.max_num_seqs, self.max_model_len, device)
        self.cache = KVCache(
            mc.num_hidden_layers,
            config.max_num_seqs,
            self.max_model_len,
            mc.num_key_value_heads,
            head_dim(mc),
            dtype,
            device,
        )
        self.runner = ModelRunner(model, self.cache, device)
        prefix_cache = PrefixCache(drafter.context_limit) if config.prefix_caching else None
        self.scheduler = Scheduler(self.cache, config.max_batch_tokens, prefix_cache)
        self.eos_ids = _eos_ids(model.config, tokenizer)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_ids)
        self.requests: dict[str, Request] = {}
        self.last_step_stats = StepStats()
        self._stats = StepStats()
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> str:
        """Queue a request; raise ValueError (nothing queued) when it cannot be served."""
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request asks "
                f"for {len(prompt)} prompt + {params.max_tokens} output tokens"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        request = Request(
            request_id, prompt, params, on_output=on_output, generator=generator, grammar=grammar
        )
        if self.tokenizer is not None:  # engines built for statistics tests run without one
            request.detokenizer = Detokenizer(self.tokenizer, request.output_token_ids)
        request.stats.arrival_time = time.perf_counter()
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.finish_reason = "abort"
        self._finish(request)
        self._deliver(request, RequestOutput(request_id, [], "", finished=True, finish_reason="abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, draft, verify in one forward, accept and stream."""
        started = time.perf_counter()
        self._stats = StepStats(accepted_per_position=[0] * self.drafter.gamma)
        # The policy decides how far to draft before the plan, so that prompt chunks get the budget
        # a short or draft-free step leaves: a whole block reserved per decode starved them.
        decoding = self.scheduler.num_decoding
        horizon = self.policy.max_length(self.drafter.gamma, decoding) if decoding else 0
        plan, admitted = self.scheduler.schedule(tokens_per_decode=1 + horizon)
        for request in admitted:
            self.drafter.admit(request)
        if plan.empty:
            return []
        draft = self._draft(plan.decodes, horizon)
        forward_start = time.perf_counter()
        forward = self.runner.run(plan, draft_lists(draft), self.drafter.target_layers)
        forward_time = time.perf_counter() - forward_start
        outputs = self._accept(plan, draft, forward)
        self._record(plan, draft, forward_time, time.perf_counter() - started)
        return outputs

    def _draft(self, decodes: list[Request], horizon: int) -> Draft:
        t0 = time.perf_counter()
        caps = [r.params.max_draft_tokens for r in decodes]  # per request; None: the policy decides
        if None not in caps:
            horizon = min(horizon, max(caps, default=0))
        if horizon == 0:  # nothing to decode, the policy does not draft, or no request speculates
            empty = torch.zeros((len(decodes), 0), dtype=torch.int64, device=self.device)
            return Draft(DraftBlock(empty, None), [0] * len(decodes))
        block = self.drafter.propose(decodes, self._sampling(decodes, drafting=True), horizon)
        t1 = time.perf_counter()
        width = min(horizon, block.tokens.shape[1])
        # On the host once, for the policy and the statistics below (one device copy per step).
        confidences = host_array(block.confidences[:, :width]) if block.confidences is not None else None
        fallbacks = getattr(self.policy, "fallbacks", 0)
        lengths = self.policy.verify_lengths(confidences, width, len(decodes))
        self._stats.policy_fallback = getattr(self.policy, "fallbacks", 0) > fallbacks
        limit = _verify_limits(decodes)
        lengths = lengths.cpu().numpy()
        if block.num_valid is not None:
            lengths = np.minimum(lengths, block.num_valid.cpu().numpy())
        lengths = np.maximum(np.minimum(lengths, limit), 0)
        if confidences is not None:  # what the confidence head expects to be accepted
            survival = survival_probabilities(confidences)
            verified = np.arange(survival.shape[1]) < lengths[:, None]
            per_position = np.where(verified, survival, 0.0).sum(axis=0)
            self._stats.predicted_accepted_tokens = float(per_position.sum())
            self._stats.predicted_per_position = per_position.tolist()
        lengths = lengths.tolist()
        self._stats.drafted, self._stats.draft_time_s = True, t1 - t0
        self._stats.draft_horizon = width
        self._stats.schedule_time_s = time.perf_counter() - t1
        return Draft(block, lengths)

    def _accept(self, plan: StepPlan, draft: Draft, forward: StepForward) -> list[RequestOutput]:
        """Verify decodes, sample first tokens of completed prompts, commit caches, emit."""
        logits, hidden = forward.output.logits, forward.output.layer_hidden
        offsets, outputs = forward.batch.offsets, []
        decodes = plan.decodes
        if decodes:
            gamma_max = max(draft.lengths)
            lengths = torch.tensor(draft.lengths, device=self.device)
            row_logits = verification_logits(
                logits, forward.logit_starts[: len(decodes)], draft.lengths, gamma_max
            )
            num_accepted, next_tokens = self._verify(decodes, draft, row_logits, lengths, gamma_max)
            accepted, nexts = num_accepted.tolist(), next_tokens.tolist()
            drafted = draft.block.tokens[:, :gamma_max].tolist()
            for i, request in enumerate(decodes):
                n = accepted[i]
                new_tokens = drafted[i][:n] + [nexts[i]]
                request.num_cached += 1 + n
                request.stats.rounds += 1
                request.stats.draft_tokens += draft.lengths[i]
                request.stats.drafts += draft.lengths[i] > 0
                request.stats.accepted_tokens += n
                self._accept_counts(draft.lengths[i], n)
                outputs.append(self._emit(request, new_tokens, row_logits[i, : n + 1]))
            # Requests that just finished were released from the drafter; commit only the live ones.
            spans = _spans(hidden, offsets, [1 + n for n in accepted])
            live = [i for i, r in enumerate(decodes) if r.status is not RequestStatus.FINISHED]
            self.drafter.commit([decodes[i] for i in live], [spans[i] for i in live])

        prefills = [(r, c) for r, c in plan.prefills]
        completed = [i for i, (r, c) in enumerate(prefills) if r.num_cached + c == len(r.prompt_token_ids)]
        for request, chunk in prefills:
            request.num_cached += chunk
        self.drafter.commit(
            [r for r, _ in prefills],
            _spans(hidden, offsets[len(decodes) :], [c for _, c in prefills]),
        )
        if completed:
            done = [prefills[i][0] for i in completed]
            rows = torch.tensor(
                [forward.logit_starts[len(decodes) + i] for i in completed], device=self.device
            )
            first_logits = logits[rows]
            processed = process_rows(done, first_logits)  # penalties, logit_bias, grammars
            if all(r.params.greedy for r in done):
                first = target_argmax(first_logits, processed).tolist()
            else:
                sampling = self._sampling(done)
                first = sample(target_probs(first_logits, sampling, processed), sampling.generators).tolist()
            for request, token, row in zip(done, first, rows.tolist(), strict=True):
                outputs.append(self._emit(request, [token], logits[row : row + 1]))
        return outputs

    def _verify(self, decodes, draft: Draft, row_logits, lengths, gamma_max: int):
        """Rejection sampling from the processed target distribution; all-greedy batches skip the
        probabilities (same result, less work)."""
        tokens = draft.block.tokens[:, :gamma_max]
        processed = process_rows(decodes, row_logits, tokens, draft.lengths)
        if all(r.params.greedy for r in decodes):
            return verify_greedy(tokens, target_argmax(row_logits, processed), lengths)
        sampling = self._sampling(decodes)
        probs = draft.block.probs[:, :gamma_max] if draft.block.probs is not None else None
        target = target_probs(row_logits, sampling, processed)
        return verify_draft_tokens(tokens, probs, target, lengths, sampling.generators, draft.lengths)

    # ---- helpers --------------------------------------------------------------------------

    def _sampling(self, requests: Sequence[Request], drafting: bool = False) -> SamplingTensors:
        # A request that does not speculate keeps its generator out of drafting (its drafts are
        # never verified), so its seeded output is its plain one.
        generators = [None if drafting and r.params.max_draft_tokens == 0 else r.generator for r in requests]
        return SamplingTensors.from_params([r.params for r in requests], generators, self.device)

    def _emit(self, request: Request, tokens: list[int], token_logits: torch.Tensor) -> RequestOutput:
        """Append tokens (with stop checks), detokenize the delta and deliver it."""
        now = time.perf_counter()
        if request.stats.first_token_time is None:
            request.stats.first_token_time = now
        kept = append_tokens(request, tokens, self.eos_ids)
        tokens = tokens[:kept]
        if request.grammar is not None and not request.grammar.advance(tokens):
            request.finish_reason = "error"  # this request alone
        delta = ""
        if request.detokenizer is not None:
            delta = new_text(request, request.detokenizer.update(final=request.finish_reason is not None))
        logprobs, stats = None, None
        if request.params.logprobs is not None:
            logprobs = _logprobs(token_logits[:kept], tokens, request.params.logprobs)
        finished = request.finish_reason is not None
        if finished:
            request.stats.finish_time = now
            self._finish(request)
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
        self._deliver(request, output)
        return output

    def _deliver(self, request: Request, output: RequestOutput) -> None:
        if request.on_output is not None:
            request.on_output(output)

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        self.drafter.release(request)
        self.requests.pop(request.request_id, None)

    def _accept_counts(self, verified: int, accepted: int) -> None:
        stats = self._stats
        if verified:
            stats.num_drafts += 1
        stats.num_draft_tokens += verified
        stats.num_accepted_tokens += accepted
        for k in range(accepted):
            stats.accepted_per_position[k] += 1

    def _record(self, plan: StepPlan, draft: Draft, forward_time: float, step_time: float) -> None:
        stats = self._stats
        stats.num_running, stats.num_waiting = self.num_running, self.num_waiting
        stats.num_prefill_tokens = sum(c for _, c in plan.prefills)
        if self.scheduler.prefix_cache is not None:
            stats.prefix_cache_queries, stats.prefix_cache_hits = self.scheduler.prefix_cache.take_counts()
        stats.verify_batch_tokens = sum(1 + n for n in draft.lengths)
        stats.verify_budgets = list(draft.lengths)
        stats.forward_time_s, stats.step_time_s = forward_time, step_time
        if not plan.prefills:  # mixed prefill steps would skew the verification-time estimate
            self.policy.observe_step(stats)
        self.last_step_stats = stats

    # ---- offline use ----------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Run prompts (token ids) to completion together; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        tracked = {i: self.requests[i] for i in ids}
        while self.has_unfinished_requests():
            self.step()
        return [
            GenerationResult(i, r.text, list(r.output_token_ids), r.finish_reason, r.stats)
            for i, r in tracked.items()
        ]


def _verify_limits(decodes: Sequence[Request]) -> list[int]:
    """The most draft tokens each request may verify this step: room for the bonus token within
    max_tokens, and the request's own cap (`max_draft_tokens`, 0 = no speculation)."""
    return [
        r.remaining_tokens - 1
        if (cap := r.params.max_draft_tokens) is None
        else min(r.remaining_tokens - 1, cap)
        for r in decodes
    ]


def verification_logits(
    logits: torch.Tensor, starts: list[int], lengths: list[int], width: int
) -> torch.Tensor:
    """[R, width + 1, V]: each decode's logits at its anchor and verified drafts (rows past its own
    length repeat its last one)."""
    index = [start + min(k, n) for start, n in zip(starts, lengths, strict=True) for k in range(width + 1)]
    if index == list(range(len(index))):  # every decode verified `width` drafts (plain decoding always)
        return logits[: len(index)].view(len(starts), width + 1, -1)
    return logits[torch.tensor(index, device=logits.device)].view(len(starts), width + 1, -1)


def draft_lists(draft: Draft) -> list[list[int]]:
    if not draft.lengths or max(draft.lengths) == 0:
        return [[] for _ in draft.lengths]
    rows = draft.block.tokens[:, : max(draft.lengths)].tolist()
    return [row[:n] for row, n in zip(rows, draft.lengths, strict=True)]


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


def _eos_ids(config, tokenizer) -> frozenset[int]:
    ids = config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _check_drafter_device(drafter: Drafter, device: torch.device) -> None:
    """Refuse a drafter on another device: its tokens would meet the target's logits mid-step."""
    if drafter.device is None:
        return
    own = torch.device(drafter.device)
    if own.type != device.type or (own.index or 0) != (device.index or 0):
        raise ValueError(f"drafter {drafter.name!r} is on {own} but the engine runs on {device}")
