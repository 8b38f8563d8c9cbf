"""The OpenAI-compatible API's logic, independent of the HTTP framework.

Each handler is an async generator of frames: either one `JSONReply`, or a `StreamStart` followed
by SSE strings. Frames are plain picklable values, so the same handlers serve the Ray Serve ingress
directly and the KServe front end through a deployment handle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from dspark.engine.outputs import RequestOutput, RequestStats, TokenLogprob
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.engine_loop import AsyncEngineClient, EngineStopped, QueueFull, RequestStream
from dspark.serving.errors import APIError, bad_request, error_body
from dspark.serving.metrics import ServingMetrics
from dspark.serving.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from dspark.serving.request_limits import RequestLimits


@dataclass
class JSONReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class StreamStart:
    """The reply is an SSE stream; the strings that follow are its events."""


Frame = JSONReply | StreamStart | str
T = TypeVar("T")


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


@dataclass
class ServiceLimits:
    max_model_len: int
    max_prompt_tokens: int
    max_output_tokens: int
    retry_after_s: int = 1
    max_sequences: int | None = None  # KV cache slots: the most samples one request may ask for
    request_timeout_s: float | None = None  # from arrival to the last token; past it a 504
    request: RequestLimits = field(default_factory=RequestLimits)


class OpenAIService:
    """Completions and chat completions over an `AsyncEngineClient`."""

    def __init__(
        self,
        client: AsyncEngineClient,
        tokenizer: Any,
        model_name: str,
        limits: ServiceLimits,
        metrics: ServingMetrics | None = None,
        aliases: tuple[str, ...] = (),
        listed: tuple[str, ...] = (),
        defaults: dict[str, Any] | None = None,
    ):
        """`aliases` are accepted as the model too; `listed` are the ids /v1/models lists (default:
        `model_name`); `defaults` fill the sampling fields a request leaves out (generation_config)."""
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.metrics = metrics
        self._names = {model_name, *aliases, *listed}
        self._listed = listed or (model_name,)
        self.defaults = defaults or {}
        self._vocab_size = len(tokenizer)
        self.created = int(time.time())
        # One thread, as vLLM's: a fast tokenizer is not safe to share between threads that encode.
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dspark-tokenize")

    async def models(self) -> dict[str, Any]:
        return self.models_body()

    def models_body(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "dspark",
                    "max_model_len": self.limits.max_model_len,
                }
                for name in self._listed
            ],
        }

    # Entry points --------------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest) -> AsyncIterator[Frame]:
        arrival = time.monotonic()
        try:
            self._check_request(req)
            prompts = await self._off_loop(lambda: [self._completion_prompt(p) for p in req.prompts])
            params = [self._sampling_params(req, len(ids), req.max_tokens, req.logprobs) for ids in prompts]
            self._check_sequences(req.n, prompts, params)
        except APIError as e:
            yield _error_reply(e)
            return
        echo = None
        if req.echo:
            echo = [
                p if isinstance(p, str) else self.tokenizer.decode(ids)
                for p, ids in zip(req.prompts, prompts, strict=True)
            ]
        async for frame in self._generate("completion", req, prompts, params, arrival, echo):
            yield frame

    async def chat(self, req: ChatCompletionRequest) -> AsyncIterator[Frame]:
        arrival = time.monotonic()
        try:
            self._check_request(req)
            prompt_ids = await self._off_loop(lambda: self._chat_prompt(req))
            top = (req.top_logprobs or 0) if req.logprobs else None
            params = self._sampling_params(req, len(prompt_ids), req.output_limit, top)
            self._check_sequences(req.n, [prompt_ids], [params])
        except APIError as e:
            yield _error_reply(e)
            return
        async for frame in self._generate("chat", req, [prompt_ids], [params], arrival):
            yield frame

    async def tokenize(self, req: TokenizeRequest) -> JSONReply:
        """vLLM's /tokenize: the prompt's token ids (a chat's as its completion would see them)."""
        try:
            if req.model is not None:
                self._check_model(req.model)
            if isinstance(req, TokenizeChatRequest):
                ids = self._render_chat(
                    req.messages,
                    req.add_generation_prompt,
                    req.chat_template_kwargs,
                    req.continue_final_message,
                    req.add_special_tokens,
                )
            else:
                ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except APIError as e:
            return _error_reply(e)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return JSONReply(200, body)

    async def detokenize(self, req: DetokenizeRequest) -> JSONReply:
        """vLLM's /detokenize: token ids back to text, special tokens included."""
        try:
            if req.model is not None:
                self._check_model(req.model)
            outside = [t for t in req.tokens if t >= self._vocab_size]
            if outside:
                raise bad_request(
                    f"token id {outside[0]} is outside the vocabulary (size {self._vocab_size})", "tokens"
                )
        except APIError as e:
            return _error_reply(e)
        return JSONReply(200, {"prompt": self.tokenizer.decode(req.tokens)})

    # Request validation --------------------------------------------------------------------------
    async def _off_loop(self, work: Callable[[], T]) -> T:
        """Tokenizing and chat templating, on the tokenizer's thread: a huge prompt then delays
        other requests' tokenizing, never the event loop (their streams, the probes)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work)

    def _check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_model(req.model)
        self.limits.request.check(req)

    def _check_model(self, name: str) -> None:
        if name not in self._names:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if t >= self._vocab_size]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary (size {self._vocab_size})", "prompt"
                )
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        return ids

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        return self._render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)

    def _render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation through the model's chat template (`template_kwargs` are its extra
        variables), as token ids."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"the model `{self.model_name}` has no chat template; use /v1/completions", "messages"
            )
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        extra = dict(template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as e:  # jinja raises template errors for conversations it rejects
            param = "chat_template_kwargs" if template_kwargs else "messages"
            raise bad_request(f"the chat template rejected this request: {e}", param) from None
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise bad_request("the conversation is empty after tokenization", "messages")
        return ids

    def _check_sequences(self, n: int, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """All samples of a request decode together, each in its own KV cache slot: refuse more
        than the cache holds (it could never run them at once)."""
        slots = self.limits.max_sequences
        sequences = n * len(prompts)
        if slots is None or sequences <= slots:
            return
        tokens = n * sum(len(ids) + p.max_tokens for ids, p in zip(prompts, params, strict=True))
        raise bad_request(
            f"n = {n} x {len(prompts)} prompt(s) asks for {sequences} sequences ({tokens} tokens of KV "
            f"cache: prompt + max_tokens each), but the KV cache holds {slots} sequences (max_num_seqs) of "
            f"at most {self.limits.max_model_len} tokens ({slots * self.limits.max_model_len} tokens)",
            "n",
        )

    def _sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        lim = self.limits
        if prompt_len > lim.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {prompt_len} tokens; the limit is {lim.max_prompt_tokens}",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        room = lim.max_model_len - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {lim.max_model_len} tokens; the prompt has "
                f"{prompt_len} tokens, which leaves no room for output.",
                "prompt",
            )
        if (
            "max_tokens" in self.defaults
            and not {"max_tokens", "max_completion_tokens"} & req.model_fields_set
        ):
            max_tokens = min(room, lim.max_output_tokens, self.defaults["max_tokens"])
        elif max_tokens is None:
            max_tokens = min(room, lim.max_output_tokens)
        if max_tokens > lim.max_output_tokens:
            raise bad_request(
                f"max_tokens is {max_tokens}; the limit is {lim.max_output_tokens}", "max_tokens"
            )
        if max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {lim.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )
        if req.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens"
            )
        bias = req.token_bias
        outside = [t for t in bias if t >= self._vocab_size]
        if outside:
            raise bad_request(
                f"logit_bias token id {outside[0]} is outside the vocabulary (size {self._vocab_size})",
                "logit_bias",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self._field(req, "temperature"),
                top_p=self._field(req, "top_p"),
                top_k=max(self._field(req, "top_k"), 0),
                min_p=self._field(req, "min_p"),
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=self._field(req, "repetition_penalty"),
                logit_bias=bias,
                seed=req.seed,
                stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                logprobs=logprobs,
                max_draft_tokens=req.speculative.cap if req.speculative is not None else None,
                structured=req.constraint(),
            )
        except ValidationError as e:
            raise bad_request(f"invalid sampling parameters: {e.errors()[0]['msg']}") from None

    def _field(self, req: CompletionRequest | ChatCompletionRequest, name: str) -> Any:
        """The request's value, or the model's default where the request leaves the field out."""
        if name in req.model_fields_set or name not in self.defaults:
            return getattr(req, name)
        return self.defaults[name]

    # Generation ----------------------------------------------------------------------------------
    async def _generate(
        self,
        kind: str,
        req: Any,
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival: float,
        echo: list[str] | None = None,
    ) -> AsyncIterator[Frame]:
        """One engine request per prompt and sample (choice index prompt * n + sample, as OpenAI
        numbers them), admitted together or not at all."""
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        children = [(ids, sp) for ids, p in zip(prompts, params, strict=True) for sp in p.for_samples(req.n)]
        timeout = self.limits.request_timeout_s
        deadline = arrival + timeout if timeout is not None else None
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):  # admission (grammars) included
                    for index, (ids, sp) in enumerate(children):
                        child = rid if len(children) == 1 else f"{rid}-{index}"
                        streams.append(
                            await stack.enter_async_context(self.client.open(ids, sp, request_id=child))
                        )
            except TimeoutError:
                yield _timeout_reply(timeout)
                return
            except QueueFull as e:
                yield JSONReply(
                    429,
                    error_body(429, f"server is at capacity ({e}); retry later", code="rate_limit_exceeded"),
                    {"Retry-After": str(self.limits.retry_after_s)},
                )
                return
            except EngineStopped as e:
                yield JSONReply(503, error_body(503, str(e)), {"Retry-After": str(self.limits.retry_after_s)})
                return
            except ValueError as e:
                yield _error_reply(bad_request(str(e)))
                return
            render = _Renderer(
                kind, rid, self.model_name, self.tokenizer, req, [len(p) for p in prompts], self.created, echo
            )
            timings = [_Timing(arrival, self.metrics) for _ in children]
            outputs = _until(deadline, _merged(streams))
            if req.stream:
                yield StreamStart()
                try:
                    async for index, out in outputs:
                        timings[index].observe(out)
                        for event in render.chunks(index, out):
                            yield sse(event)
                except TimeoutError:
                    yield sse(_timeout_reply(timeout).body)
                    yield sse("[DONE]")
                    return
                for event in render.final_chunks():
                    yield sse(event)
                yield sse("[DONE]")
            else:
                outs: list[list[RequestOutput]] = [[] for _ in children]
                try:
                    async for index, out in outputs:
                        timings[index].observe(out)
                        outs[index].append(out)
                except TimeoutError:
                    yield _timeout_reply(timeout)
                    return
                reply = render.full(outs)
                if reply.status == 503:
                    reply.headers["Retry-After"] = str(self.limits.retry_after_s)
                yield reply


def _loop_time(deadline: float | None) -> float | None:
    """A `time.monotonic` deadline on the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + deadline - time.monotonic()


async def _until(deadline: float | None, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`items` as they come; TimeoutError once the `time.monotonic` `deadline` has passed (closing
    `items`, which aborts the requests behind them)."""
    try:
        while True:
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    item = await anext(items)
            except StopAsyncIteration:
                return
            yield item
    finally:
        await items.aclose()


def _timeout_reply(timeout_s: float | None) -> JSONReply:
    message = f"the request did not finish within the server's request timeout of {timeout_s} s"
    return JSONReply(504, error_body(504, message, code="request_timeout"))


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several request streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for out in stream:
            queue.put_nowait((index, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, out = await queue.get()
            remaining -= out.finished
            yield index, out
    finally:
        for task in tasks:
            task.cancel()


class _Timing:
    """TTFT, inter-token gaps and end-to-end latency of one request, into the metrics."""

    def __init__(self, arrival: float, metrics: ServingMetrics | None):
        self.arrival = arrival
        self.metrics = metrics
        self.first: float | None = None
        self.last = arrival
        self.tokens = 0

    def observe(self, out: RequestOutput) -> None:
        t = time.monotonic()
        n = len(out.new_token_ids)
        if self.metrics is not None and n:
            if self.first is None:
                self.metrics.observe_first_token(t - self.arrival, n)
            else:
                self.metrics.observe_tokens(t - self.last, n)
        if n:
            self.first = t if self.first is None else self.first
            self.last = t
            self.tokens += n
        if out.finished and self.metrics is not None:
            decode_s = self.last - self.first if self.first is not None else 0.0
            self.metrics.observe_finished(t - self.arrival, self.tokens, decode_s)


@dataclass
class _Choice:
    """Streaming state of one choice."""

    text_offset: int = 0
    sent_role: bool = False
    num_tokens: int = 0
    echo: str = ""  # prompt text still to be sent in front of the first text
    stats: RequestStats | None = None


class _Renderer:
    """Turns engine outputs into OpenAI response bodies (whole or as stream chunks)."""

    def __init__(
        self,
        kind: str,
        rid: str,
        model: str,
        tokenizer: Any,
        req: Any,
        prompt_lens: list[int],
        created: int,
        echo: list[str] | None = None,
    ):
        self.kind, self.rid, self.model, self.tok, self.req = kind, rid, model, tokenizer, req
        self.prompt_tokens = sum(prompt_lens)
        self.num_prompts = len(prompt_lens)
        self.created = created
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # Every chunk then carries the usage so far (vLLM's continuous_usage_stats), not null.
        self.continuous_usage = self.include_usage and req.stream_options.continuous_usage_stats
        self.as_ids = req.return_tokens_as_token_ids
        n = req.n
        self.choices = [_Choice(echo=echo[i // n] if echo else "") for i in range(n * len(prompt_lens))]

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tok.decode([token_id])

    def _usage(self) -> dict[str, Any]:
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self._cached_tokens()},
        }

    def _cached_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache, each prompt counted once (as `prompt_tokens`):
        the most any of its n samples reused."""
        n = len(self.choices) // self.num_prompts
        return sum(
            max((c.stats.cached_tokens for c in self.choices[p * n : (p + 1) * n] if c.stats), default=0)
            for p in range(self.num_prompts)
        )

    def _spec_stats(self) -> dict[str, Any]:
        """The request's speculation figures, summed over its choices (tau as `RequestStats.tau`)."""
        total = RequestStats()
        for c in self.choices:
            if c.stats is not None:
                total.rounds += c.stats.rounds
                total.drafts += c.stats.drafts
                total.draft_tokens += c.stats.draft_tokens
                total.accepted_tokens += c.stats.accepted_tokens
        return {
            "rounds": total.rounds,
            "drafts": total.drafts,
            "draft_tokens": total.draft_tokens,
            "accepted_tokens": total.accepted_tokens,
            "tau": round(total.tau, 4),
        }

    def _logprobs(self, choice: _Choice, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_logprob(lp) for lp in lps]}
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(t) if not self.as_ids else 0
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": [
                {**{self._token(tid): _finite(v) for tid, v in lp.top}, tok: _finite(lp.logprob)}
                for tok, lp in zip(tokens, lps, strict=True)
            ],
            "text_offset": offsets,
        }

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        tok = self._token(lp.token_id)
        return {
            "token": tok,
            "logprob": _finite(lp.logprob),
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self._token(tid)), "logprob": _finite(v), "bytes": list(t.encode("utf-8"))}
                for tid, v in lp.top
            ],
        }

    def full(self, outs: list[list[RequestOutput]]) -> JSONReply:
        for choice_outs in outs:
            if choice_outs[-1].finish_reason == "error":
                return JSONReply(*_failure(choice_outs[-1]))
        choices = []
        for index, (state, choice_outs) in enumerate(zip(self.choices, outs, strict=True)):
            last = choice_outs[-1]
            text = state.echo + "".join(o.new_text for o in choice_outs)
            state.num_tokens = last.num_output_tokens or sum(len(o.new_token_ids) for o in choice_outs)
            state.stats = last.stats
            lps = None
            if any(o.logprobs is not None for o in choice_outs):
                lps = self._logprobs(state, [lp for o in choice_outs for lp in (o.logprobs or [])])
            if self.kind == "chat":
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": lps,
                        "finish_reason": last.finish_reason,
                    }
                )
            else:
                choices.append(
                    {"index": index, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
                )
        body = {
            "id": self.rid,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
        }
        if self.req.return_spec_stats:
            body["spec_decode_stats"] = self._spec_stats()
        return JSONReply(200, body)

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def chunks(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        if out.finish_reason == "error":
            return [_failure(out)[1]]
        state = self.choices[index]
        state.num_tokens = out.num_output_tokens or state.num_tokens + len(out.new_token_ids)
        if out.finished:
            state.stats = out.stats
        lps = self._logprobs(state, out.logprobs) if out.logprobs else None
        text, state.echo = state.echo + out.new_text, ""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if not state.sent_role:
                delta["role"] = "assistant"
                state.sent_role = True
            if text or "role" in delta:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": out.finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": out.finish_reason}
        chunk = {
            "id": self.rid,
            "object": self._chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = self._usage() if self.continuous_usage else None
        if text or out.finished or lps or choice.get("delta"):
            return [chunk]
        return []

    def final_chunks(self) -> list[dict[str, Any]]:
        """After every choice finished: usage and the speculation figures, when asked for."""
        if not (self.include_usage or self.req.return_spec_stats):
            return []
        chunk: dict[str, Any] = {
            "id": self.rid,
            "object": self._chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [],
        }
        if self.include_usage:
            chunk["usage"] = self._usage()
        if self.req.return_spec_stats:
            chunk["spec_decode_stats"] = self._spec_stats()
        return [chunk]


def _failure(out: RequestOutput) -> tuple[int, dict[str, Any]]:
    """Status and body of a failed request: 503 where the server failed (the engine died or is
    shutting down) and a retry may succeed, else 500."""
    status = 503 if out.retry else 500
    return status, error_body(status, out.error or "generation failed")


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(float(x), -9999.0)


def _error_reply(e: APIError) -> JSONReply:
    return JSONReply(e.status, e.body(), e.headers)
