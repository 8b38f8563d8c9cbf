"""One serving replica: an engine (in its own process, or on a thread), its metrics and the API logic."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from dspark.serving.config import ServeConfig
from dspark.serving.engine_core import load_engine
from dspark.serving.engine_loop import AsyncEngineClient, EngineBackend, EngineLoop
from dspark.serving.engine_messages import EngineFactory
from dspark.serving.engine_process import EngineProcess
from dspark.serving.errors import APIError, validation_message
from dspark.serving.generation_defaults import generation_defaults
from dspark.serving.metrics import ServingMetrics
from dspark.serving.openai_schemas import ChatCompletionRequest, CompletionRequest
from dspark.serving.openai_service import Frame, JSONReply, OpenAIService, ServiceLimits
from dspark.serving.request_limits import RequestLimits

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

    A watchdog thread kills an engine process that made no progress with requests open for
    `engine_stall_timeout_s` (hung, or stopped by a signal), and restarts a dead one, up to
    `max_engine_restarts` times: faster than Ray's replacement, which waits for several failed
    health checks and then starts a whole replica (actor, imports, engine). Past that, or with the
    engine on a thread (which cannot be killed), `check_health` fails and Ray replaces the replica.
    """

    def __init__(self, config: ServeConfig, engine: Any | None = None, factory: EngineFactory | None = None):
        self.config = config
        self.loop: EngineBackend
        self._factory = factory or load_engine
        self._closing = threading.Event()
        self.restarts = 0
        self._restarting = False
        self._swap = threading.Lock()  # a restart's new engine against a shutdown
        self._unrecoverable: str | None = None  # why the replica cannot bring its engine back
        if engine is None and not config.engine_in_thread:
            self.loop = process = EngineProcess(self._factory, config)
            self.engine = process.info
        else:
            self.engine = engine if engine is not None else self._factory(config)
            self.loop = EngineLoop(self.engine)
        ecfg = self.engine.config
        names = config.served_model_name or [self.engine.model_name]
        self.model_name = names[0]
        self.metrics = ServingMetrics(self.model_name)
        if isinstance(self.loop, EngineProcess):
            self.metrics.watch_engine_process(lambda: self.loop.pid)
        self.loop.metrics = self.metrics
        self.client = AsyncEngineClient(self.loop, max_in_flight=ecfg.max_num_seqs + config.max_queue)
        max_len = self.engine.max_model_len
        limits = ServiceLimits(
            max_model_len=max_len,
            max_prompt_tokens=min(config.max_prompt_tokens or max_len - 1, max_len - 1),
            max_output_tokens=config.max_output_tokens,
            retry_after_s=config.retry_after_s,
            max_sequences=ecfg.max_num_seqs,
            request_timeout_s=config.request_timeout_s,
            request=RequestLimits.from_config(config),
        )
        self.service = OpenAIService(
            self.client,
            self.engine.tokenizer,
            self.model_name,
            limits,
            self.metrics,
            aliases=(*names[1:], self.engine.model_name),
            listed=tuple(names),
            defaults=generation_defaults(config.generation_config, getattr(ecfg, "target", None)),
        )
        self.loop.start()
        self._watchdog = threading.Thread(target=self._watch, name="dspark-engine-watchdog", daemon=True)
        self._watchdog.start()

    async def ready(self) -> bool:
        # The engine acquired whatever its policy needs (an SPS profile: loaded or measured) before
        # it was built, so a replica is ready while its step loop runs.
        return self.loop.alive and self.problem() is None

    async def health(self) -> str | None:
        """Why the replica cannot serve now (`/health` answers 503 with it), or None."""
        return self.problem()

    def problem(self) -> str | None:
        """Why the engine cannot serve now: dead, hung, or being restarted; None when it can."""
        if self._unrecoverable is not None:
            return self._unrecoverable
        if not self.loop.alive:
            why = self.loop.fatal_error or "the engine stopped"
            return f"{why}; restarting the engine" if self._recovers_itself() else why
        stalled = self.loop.stalled_s()
        if stalled > self.config.engine_stall_timeout_s:
            return f"engine hung: no progress for {stalled:.0f} s with requests open"
        return None

    def check_health(self) -> None:
        """Ray Serve's health check: raise when the replica needs replacing, that is when its engine
        is dead or hung and the replica will not restart it itself."""
        problem = self.problem()
        if problem is not None and not self._recovers_itself():
            raise RuntimeError(problem)

    def _recovers_itself(self) -> bool:
        """Whether the replica brings its engine back itself: restarting it now, or it may still."""
        return (
            isinstance(self.loop, EngineProcess)
            and self._unrecoverable is None
            and (self._restarting or self.restarts < self.config.max_engine_restarts)
        )

    # Watchdog thread -----------------------------------------------------------------------------
    def _watch(self, interval_s: float = 0.5) -> None:
        while not self._closing.wait(interval_s):
            loop = self.loop
            if not isinstance(loop, EngineProcess):
                continue  # an engine thread cannot be killed: check_health fails, Ray replaces us
            stalled = loop.stalled_s()
            if loop.alive and stalled > self.config.engine_stall_timeout_s:
                log.error("engine made no progress for %.0f s with requests open: killing it", stalled)
                loop.kill(f"engine hung: no progress for {stalled:.0f} s with requests open")
            restarts_left = self.restarts < self.config.max_engine_restarts
            if not loop.alive and not self._closing.is_set() and restarts_left:
                self._restarting = True
                try:
                    self._restart(loop)
                finally:
                    self._restarting = False

    def _restart(self, dead: EngineProcess) -> None:
        """Replace a dead engine process by a new one (its callers got their errors already)."""
        self.restarts += 1
        log.error(
            "%s; restarting the engine process (%d of %d)",
            dead.fatal_error or "the engine process stopped",
            self.restarts,
            self.config.max_engine_restarts,
        )
        dead.stop(drain_timeout_s=0)  # reaps the child
        try:
            fresh = EngineProcess(self._factory, self.config, self.metrics)
        except Exception as e:
            log.exception("engine restart failed")
            self._unrecoverable = f"engine restart failed: {e}"
            return
        with self._swap:
            if not self._closing.is_set():
                fresh.start()
                self.loop = self.client.engine_loop = fresh
                log.info("engine process restarted")
                return
        fresh.stop(drain_timeout_s=0)  # the replica shut down meanwhile

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def models(self) -> dict[str, Any]:
        return self.service.models_body()

    def shutdown(self) -> None:
        with self._swap:
            self._closing.set()
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
            self.service.limits.request.check_v2_inputs(len(inputs))
        except APIError as e:
            return _v2_error(e.status, e.message)
        try:
            reqs = [CompletionRequest(model=self.model_name, prompt=text, **parameters) for text in inputs]
        except ValidationError as e:
            return _v2_error(400, validation_message(list(e.errors()))[0])
        tasks = [asyncio.create_task(self._complete(r)) for r in reqs]
        try:
            for next_done in asyncio.as_completed(tasks):
                reply = await next_done
                if reply.status != 200:  # a 429 or 400 for one input answers for all of them
                    return reply
        finally:
            for task in tasks:  # the others' requests are aborted, not left running for nobody
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [task.result().body["choices"][0]["text"] for task in tasks]

    async def _complete(self, req: CompletionRequest) -> JSONReply:
        async with contextlib.aclosing(self.service.completion(req)) as frames:
            async for frame in frames:
                if isinstance(frame, JSONReply):
                    return frame
        raise APIError(500, "no reply")


def _v2_error(status: int, message: str) -> JSONReply:
    return JSONReply(status, {"error": message})
