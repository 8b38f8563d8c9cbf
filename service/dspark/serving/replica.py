"""One serving replica: an engine (in its own process, or on a thread), its metrics and the API logic."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from dspark.serving.config import ServeConfig
from dspark.serving.engine_core import load_engine
from dspark.serving.engine_loop import AsyncEngineClient, EngineBackend, EngineLoop
from dspark.serving.engine_messages import EngineFactory
from dspark.serving.engine_process import EngineProcess
from dspark.serving.errors import APIError, validation_message
from dspark.serving.metrics import ServingMetrics
from dspark.serving.openai_schemas import ChatCompletionRequest, CompletionRequest
from dspark.serving.openai_service import Frame, JSONReply, OpenAIService, ServiceLimits

log = logging.getLogger(__name__)

V2_INPUT = "text_input"
V2_OUTPUT = "text_output"
# Sampling settings a v2 `infer` request may pass in its `parameters`.
V2_PARAMETERS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
)


class EngineReplica:
    """Owns one engine; everything a Ray Serve replica answers goes through here.

    By default the engine runs in its own process, built there by `factory(config)` (an importable
    callable; default `load_engine`); `self.engine` is then its `EngineInfo`. An `engine` object
    passed in, or `config.engine_in_thread`, runs it on a thread of this process instead.
    """

    def __init__(self, config: ServeConfig, engine: Any | None = None, factory: EngineFactory | None = None):
        self.config = config
        self.loop: EngineBackend
        engine_pid = None
        if engine is None and not config.engine_in_thread:
            self.loop = process = EngineProcess(factory or load_engine, config)
            self.engine, engine_pid = process.info, process.pid
        else:
            self.engine = engine if engine is not None else (factory or load_engine)(config)
            self.loop = EngineLoop(self.engine)
        ecfg = self.engine.config
        self.model_name = config.served_model_name or self.engine.model_name
        self.metrics = ServingMetrics(self.model_name)
        if engine_pid is not None:
            self.metrics.watch_engine_process(engine_pid)
        self.loop.metrics = self.metrics
        self.client = AsyncEngineClient(self.loop, max_in_flight=ecfg.max_num_seqs + config.max_queue)
        max_len = self.engine.max_model_len
        limits = ServiceLimits(
            max_model_len=max_len,
            max_prompt_tokens=min(config.max_prompt_tokens or max_len - 1, max_len - 1),
            max_output_tokens=config.max_output_tokens,
            retry_after_s=config.retry_after_s,
            max_sequences=ecfg.max_num_seqs,
        )
        self.service = OpenAIService(
            self.client,
            self.engine.tokenizer,
            self.model_name,
            limits,
            self.metrics,
            aliases=(self.engine.model_name,),
        )
        self.loop.start()

    async def ready(self) -> bool:
        # The engine acquired whatever its policy needs (an SPS profile: loaded or measured) before
        # it was built, so a replica is ready while its step loop runs.
        return self.loop.alive

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def models(self) -> dict[str, Any]:
        return self.service.models_body()

    def shutdown(self) -> None:
        self.loop.stop(self.config.graceful_shutdown_timeout_s)

    async def openai(
        self, route: str, body: CompletionRequest | ChatCompletionRequest
    ) -> AsyncIterator[Frame]:
        """The OpenAI handlers by route name, for callers in other processes (the KServe front end)."""
        frames = self.service.chat(body) if route == "chat" else self.service.completion(body)
        try:
            async for frame in frames:
                yield frame
        finally:
            await frames.aclose()

    async def infer_v2(self, inputs: list[str], parameters: dict[str, Any]) -> list[str] | JSONReply:
        """Open Inference Protocol v2 with text in, text out: one completion per input string."""
        unknown = sorted(set(parameters) - set(V2_PARAMETERS))
        if unknown:
            return _v2_error(400, f"unknown parameters {unknown}; allowed: {list(V2_PARAMETERS)}")
        if not inputs:
            return _v2_error(400, f"input `{V2_INPUT}` holds no strings")
        try:
            reqs = [CompletionRequest(model=self.model_name, prompt=text, **parameters) for text in inputs]
        except ValidationError as e:
            return _v2_error(400, validation_message(list(e.errors()))[0])
        replies = await asyncio.gather(*(self._complete(r) for r in reqs))
        for reply in replies:
            if reply.status != 200:
                return reply
        return [reply.body["choices"][0]["text"] for reply in replies]

    async def _complete(self, req: CompletionRequest) -> JSONReply:
        async for frame in self.service.completion(req):
            if isinstance(frame, JSONReply):
                return frame
        raise APIError(500, "no reply")


def _v2_error(status: int, message: str) -> JSONReply:
    return JSONReply(status, {"error": message})
