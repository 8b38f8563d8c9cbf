"""The draft-verify engine: continuous batching over one ragged forward per step."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dspark.engine import drafting
from dspark.engine.config import EngineConfig
from dspark.engine.detokenizer import Detokenizer
from dspark.engine.drafter import Drafter
from dspark.engine.model_runner import ModelRunner, StepForward
from dspark.engine.outputs import RequestOutput, RequestStats, StepStats
from dspark.engine.postprocess import deliver, postprocess
from dspark.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from dspark.engine.prefix_store import PrefixStore
from dspark.engine.request import Request
from dspark.engine.sampling_params import SamplingParams
from dspark.engine.scheduler import Scheduler, StepPlan
from dspark.engine.static_runner import StaticStepRunner
from dspark.engine.stats import step_stats
from dspark.engine.structured import GrammarCompiler, GrammarState
from dspark.engine.verify import verify
from dspark.engine.verify_policy import VerifyPolicy
from dspark.models.background_build import BackgroundBuild, wants_kernel
from dspark.models.compiled_forward import compiled_or_eager
from dspark.models.config import head_dim
from dspark.models.kv_cache import KVCache, check_kv_budget, prefix_store_bytes
from dspark.models.static_batch import batch_buckets, key_buckets

log = logging.getLogger(__name__)


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
        static = config.static_steps(device)
        num_slots = config.max_num_seqs + static  # static steps' padding writes to one more slot
        check_kv_budget(per_token, num_slots, self.max_model_len, device)
        store_blocks = 0
        if config.prefix_caching:
            budget = int(config.prefix_cache_gib * 2**30)
            budget = prefix_store_bytes(budget, per_token, num_slots, self.max_model_len, device)
            store_blocks = PrefixStore.blocks_for(budget, per_token, BLOCK_SIZE)
        self.cache = KVCache(
            mc.num_hidden_layers,
            num_slots,
            self.max_model_len,
            mc.num_key_value_heads,
            head_dim(mc),
            dtype,
            device,
        )
        forward, self.background = model, None
        compiles = config.compiles(device)
        if compiles and (config.compile or not config.build_in_background):
            forward = compiled_or_eager(
                model, self.cache, drafter.target_layers, required=bool(config.compile)
            )
        elif compiles and "compiled_forward" in model.__dict__:
            forward = model.__dict__["compiled_forward"]  # warmed up by an engine before this one
            compiles = False
        if config.build_in_background and (compiles or wants_kernel(device)):
            self.background = BackgroundBuild(
                model, self.cache, drafter.target_layers, kernel=wants_kernel(device), compile=compiles
            ).start()
        self.runner = ModelRunner(forward, self.cache, device)
        self.static_runner = self._static_runner() if static else None
        prefix_cache = None
        if config.prefix_caching:
            store = PrefixStore(self.cache, store_blocks, BLOCK_SIZE) if store_blocks else None
            prefix_cache = PrefixCache(self.cache, drafter, store)
        self.scheduler = Scheduler(self.cache, config.max_batch_tokens, prefix_cache, drafter.admit)
        self.eos_ids = _eos_ids(model.config, tokenizer)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_ids)
        self.requests: dict[str, Request] = {}
        self.last_step_stats = StepStats()
        self._ids = itertools.count()

    def _static_runner(self) -> StaticStepRunner:
        """Buckets of up to max_num_seqs requests x 1 token (plain decode) or 1 + gamma (verification)
        x key lengths doubling up to max_model_len (the drafter's contexts likewise); graphs are
        captured here, before the first request, so a bucket set that does not fit is refused at
        start-up."""
        buckets = batch_buckets(self.config.max_num_seqs, self.config.cuda_graph_batch_sizes)
        contexts = key_buckets(self.max_model_len)
        gamma = self.drafter.gamma
        runner = StaticStepRunner(
            self.model,
            self.cache,
            self.cache.allocate(self.config.max_num_seqs),  # the scratch slot, never freed
            buckets,
            (1, 1 + gamma) if gamma else (1,),
            contexts,
            self.drafter.target_layers,
            self.device,
        )
        runner.capture()
        self.drafter.use_static_shapes(buckets, contexts)
        return runner

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        grammar: GrammarState | None = None,
    ) -> str:
        """Queue a request; raise ValueError (nothing queued) when it cannot be served.

        `grammar`: the request's structured-output state from `compile_grammar`, when compiled
        beforehand; a structured request without one is compiled here."""
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
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        if params.top_k >= vocab:  # keeps every token: off, without a top-k over the whole vocabulary
            params = params.model_copy(update={"top_k": 0})
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if grammar is None:
            grammar = self.compile_grammar(params)
        request = Request(
            request_id, prompt, params, on_output=on_output, generator=generator, grammar=grammar
        )
        if params.min_tokens:
            request.min_tokens_stops = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_ids
            )
        if self.tokenizer is not None:  # engines built for statistics tests run without one
            request.detokenizer = Detokenizer(
                self.tokenizer,
                request.output_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        request.stats.arrival_time = time.perf_counter()
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def compile_grammar(self, params: SamplingParams) -> GrammarState | None:
        """The grammar state of a request with `params` (None without a constraint); ValueError when
        the constraint is invalid. Thread-safe, so that a server compiles off the stepping thread."""
        return self.grammars.compile(params.structured) if params.structured is not None else None

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        request.finish_reason = "abort"
        self._finish(request)
        deliver(request, RequestOutput(request_id, [], "", finished=True, finish_reason="abort"))

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
        """Schedule, draft, run one forward, verify, then advance requests and stream."""
        started = time.perf_counter()
        if self.background is not None:
            self._take_background_build()
        horizon = self._horizon()
        plan = self._schedule(horizon)
        if plan.empty:
            return []
        draft, report = drafting.draft(self.drafter, self.policy, plan.decodes, horizon, self.device)
        forward, forward_time, forward_cpu = self._run(plan, draft)
        verified = verify(plan, draft, forward, self.device)
        outputs = postprocess(plan, draft, verified, forward, self.drafter, self.eos_ids, self._finish)
        times = (forward_time, time.perf_counter() - started, forward_cpu)
        self._record(plan, draft, report, verified.accepted, times)
        return outputs

    def _take_background_build(self) -> None:
        """Switch to what the background build finished: the attention kernel, the compiled forward."""
        finished = self.background.done.is_set()
        self.background.take_kernel()
        compiled = self.background.take_forward()
        if compiled is not None:
            self.runner.forward = compiled
            log.info("steps now run the compiled forward")
        if finished:
            self.background = None

    def wait_for_background_build(self, timeout_s: float | None = None) -> bool:
        """Wait for the background build and switch to what it built; whether it finished in time."""
        if self.background is not None:
            if not self.background.done.wait(timeout_s):
                return False
            self._take_background_build()
        return True

    def _horizon(self) -> int:
        """How far to draft, decided before the plan so that prompt chunks get the budget a short
        or draft-free step leaves: a whole block reserved per decode starved them."""
        decoding = self.scheduler.num_decoding
        return self.policy.max_length(self.drafter.gamma, decoding) if decoding else 0

    def _schedule(self, horizon: int) -> StepPlan:
        return self.scheduler.schedule(tokens_per_decode=1 + horizon)

    def _run(self, plan: StepPlan, draft: drafting.Draft) -> tuple[StepForward, float, float]:
        """The step's forward, its seconds, and the process's CPU seconds meanwhile."""
        started, cpu_started = time.perf_counter(), time.process_time()
        drafts = drafting.draft_lists(draft)
        forward = self.static_runner.run(plan, drafts) if self.static_runner is not None else None
        if forward is None:  # a prompt chunk, or outside every bucket
            forward = self.runner.run(plan, drafts, self.drafter.target_layers)
        return forward, time.perf_counter() - started, time.process_time() - cpu_started

    def _record(
        self,
        plan: StepPlan,
        draft: drafting.Draft,
        report: drafting.DraftReport,
        accepted: list[int],
        times: tuple[float, float, float],
    ) -> None:
        """Fold the step's statistics; `times`: (forward, whole step) seconds and the forward's CPU seconds."""
        queues = (self.num_running, self.num_waiting)
        cache = self.scheduler.prefix_cache
        prefix = cache.take_counts() if cache is not None else (0, 0)
        stats = step_stats(plan, draft, report, accepted, self.drafter.gamma, queues, prefix, *times[:2])
        stats.forward_cpu_s, stats.intra_op_threads = times[2], torch.get_num_threads()
        if not plan.prefills:  # mixed prefill steps would skew the verification-time estimate
            self.policy.observe_step(stats)
        self.last_step_stats = stats

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        self.drafter.release(request)
        self.requests.pop(request.request_id, None)

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
