"""The OpenAI-compatible API's logic, independent of the HTTP framework.

Each handler is an async generator of frames: either one `JSONReply`, or a `StreamStart` followed
by SSE strings. Frames are plain picklable values, so the same handlers serve the Ray Serve ingress
directly and the KServe front end through a deployment handle.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from dspark.engine.outputs import RequestOutput, TokenLogprob
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.engine_loop import AsyncEngineClient, EngineStopped, QueueFull
from dspark.serving.errors import APIError, bad_request, error_body
from dspark.serving.metrics import ServingMetrics
from dspark.serving.openai_schemas import ChatCompletionRequest, CompletionRequest


@dataclass
class JSONReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class StreamStart:
    """The reply is an SSE stream; the strings that follow are its events."""


Frame = JSONReply | StreamStart | str


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"


@dataclass
class ServiceLimits:
    max_model_len: int
    max_prompt_tokens: int
    max_output_tokens: int
    retry_after_s: int = 1


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
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.metrics = metrics
        self._names = {model_name, *aliases}
        self._vocab_size = len(tokenizer)
        self.created = int(time.time())

    async def models(self) -> dict[str, Any]:
        return self.models_body()

    def models_body(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "dspark",
                    "max_model_len": self.limits.max_model_len,
                }
            ],
        }

    # Entry points --------------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest) -> AsyncIterator[Frame]:
        arrival = time.monotonic()
        try:
            self._check_model(req.model)
            prompt_ids = self._completion_prompt(req)
            params = self._sampling_params(req, len(prompt_ids), req.max_tokens, req.logprobs)
        except APIError as e:
            yield _error_reply(e)
            return
        async for frame in self._generate("completion", req, prompt_ids, params, arrival):
            yield frame

    async def chat(self, req: ChatCompletionRequest) -> AsyncIterator[Frame]:
        arrival = time.monotonic()
        try:
            self._check_model(req.model)
            prompt_ids = self._chat_prompt(req)
            top = (req.top_logprobs or 0) if req.logprobs else None
            params = self._sampling_params(req, len(prompt_ids), req.output_limit, top)
        except APIError as e:
            yield _error_reply(e)
            return
        async for frame in self._generate("chat", req, prompt_ids, params, arrival):
            yield frame

    # Request validation --------------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name not in self._names:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            ids = self.tokenizer.encode(req.prompt)
        else:
            ids = list(req.prompt)
            bad = [t for t in ids if t >= self._vocab_size]
            if bad:
                raise bad_request(
                    f"token id {bad[0]} is outside the vocabulary (size {self._vocab_size})", "prompt"
                )
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        return ids

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                f"the model `{self.model_name}` has no chat template; use /v1/completions", "messages"
            )
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as e:  # jinja raises template errors for conversations it rejects
            raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the conversation is empty after tokenization", "messages")
        return ids

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
        if max_tokens is None:
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
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=max(req.top_k, 0),
                seed=req.seed,
                stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
            )
        except ValidationError as e:
            raise bad_request(f"invalid sampling parameters: {e.errors()[0]['msg']}") from None

    # Generation ----------------------------------------------------------------------------------
    async def _generate(
        self, kind: str, req: Any, prompt_ids: list[int], params: SamplingParams, arrival: float
    ) -> AsyncIterator[Frame]:
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        ctx = self.client.open(prompt_ids, params, request_id=rid)
        try:
            stream = await ctx.__aenter__()
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
        try:
            render = _Renderer(kind, rid, self.model_name, self.tokenizer, req, len(prompt_ids), self.created)
            timing = _Timing(arrival, self.metrics)
            if req.stream:
                yield StreamStart()
                async for out in stream:
                    timing.observe(out)
                    for event in render.chunks(out):
                        yield sse(event)
                yield sse("[DONE]")
            else:
                outs = []
                async for out in stream:
                    timing.observe(out)
                    outs.append(out)
                yield render.full(outs)
        finally:
            await ctx.__aexit__(None, None, None)


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


class _Renderer:
    """Turns engine outputs into OpenAI response bodies (whole or as stream chunks)."""

    def __init__(
        self, kind: str, rid: str, model: str, tokenizer: Any, req: Any, prompt_len: int, created: int
    ):
        self.kind, self.rid, self.model, self.tok, self.req = kind, rid, model, tokenizer, req
        self.prompt_len = prompt_len
        self.created = created
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.as_ids = req.return_tokens_as_token_ids
        self.num_tokens = 0
        self.text_offset = 0
        self.sent_role = False

    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tok.decode([token_id])

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_len,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_len + completion_tokens,
        }

    def _logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_logprob(lp) for lp in lps]}
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t) if not self.as_ids else 0
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

    def full(self, outs: list[RequestOutput]) -> JSONReply:
        last = outs[-1]
        if last.finish_reason == "error":
            return JSONReply(500, error_body(500, last.error or "generation failed"))
        text = "".join(o.new_text for o in outs)
        n = last.num_output_tokens or sum(len(o.new_token_ids) for o in outs)
        lps = None
        if any(o.logprobs is not None for o in outs):
            lps = self._logprobs([lp for o in outs for lp in (o.logprobs or [])])
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": lps,
                "finish_reason": last.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
            obj = "text_completion"
        body = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(n),
        }
        return JSONReply(200, body)

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        if out.finish_reason == "error":
            return [error_body(500, out.error or "generation failed")]
        self.num_tokens = out.num_output_tokens or self.num_tokens + len(out.new_token_ids)
        events = []
        lps = self._logprobs(out.logprobs) if out.logprobs else None
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if not self.sent_role:
                delta["role"] = "assistant"
                self.sent_role = True
            if out.new_text or "role" in delta:
                delta["content"] = out.new_text
            choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": out.finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": out.new_text, "logprobs": lps, "finish_reason": out.finish_reason}
            obj = "text_completion"
        chunk = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        if out.new_text or out.finished or lps or choice.get("delta"):
            events.append(chunk)
        if out.finished and self.include_usage:
            events.append(
                {
                    "id": self.rid,
                    "object": obj,
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self._usage(self.num_tokens),
                }
            )
        return events


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(float(x), -9999.0)


def _error_reply(e: APIError) -> JSONReply:
    return JSONReply(e.status, e.body(), e.headers)
