"""One thread owns the engine and steps it continuously; callers talk to it through a command queue.

The engine is not thread-safe. Requests from many HTTP connections are added between steps and so
join the running batch (continuous batching); aborts are applied between steps too.
`AsyncEngineClient` is the asyncio face: admission control (bounded queue), per-request output
streams, and aborting a request whose caller went away.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dspark.engine.outputs import RequestOutput
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.grammar_jobs import GrammarJobs
from dspark.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
Sink = tuple[OutputCallback, asyncio.AbstractEventLoop | None]  # a callback, and the loop it runs on


class EngineBackend(Protocol):
    """What `AsyncEngineClient` drives: `EngineLoop` (a thread) or `EngineProcess` (a process)."""

    fatal_error: str | None
    metrics: ServingMetrics | None

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def stalled_s(self) -> float:
        """Seconds without progress while requests are open (0 when none are)."""
        ...

    def add(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        on_output: OutputCallback,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> concurrent.futures.Future: ...

    def abort(self, request_id: str) -> None: ...

    def stop(self, drain_timeout_s: float = 30.0) -> None: ...


class EngineStopped(RuntimeError):
    """The loop is shutting down or has stopped: no new requests."""


class QueueFull(RuntimeError):
    """More requests are in flight than the replica admits."""


@dataclass
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    sink: Sink
    accepted: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class _GrammarCompiled:
    """Wakes an idle loop: a structured request's grammar is ready."""


class EngineLoop:
    """Runs `engine.step()` on its own thread while any request is unfinished; idles on the queue otherwise."""

    def __init__(self, engine: Any, metrics: ServingMetrics | None = None, idle_poll_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Sink] = {}  # engine thread only
        # Engine thread only: an iteration's outputs, handed over once its metrics are recorded, so
        # a caller that has its last token never reads the metrics of the step before.
        self._outbox: list[tuple[Sink, RequestOutput]] = []
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._step_started: float | None = None  # while a step runs
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)
        self.fatal_error: str | None = None
        self.grammars: GrammarJobs[_Add] = GrammarJobs(engine, lambda: self._commands.put(_GrammarCompiled()))

    # Any thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def stalled_s(self) -> float:
        """Seconds the current step has run (0 between steps): a step that never returns is a hang."""
        started = self._step_started
        return time.monotonic() - started if started is not None else 0.0

    def add(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        on_output: OutputCallback,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its id once the engine took it, or to its
        ValueError. `on_output` runs on `loop` when given (one hand-over per step), else on the
        engine thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping.is_set():
            fut.set_exception(EngineStopped("the server is shutting down"))
            return fut
        self._commands.put(_Add(list(prompt_token_ids), params, request_id, (on_output, loop), fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to `drain_timeout_s`, then abort the rest."""
        self._stopping.set()
        self._commands.put(_Stop())
        if self._thread.is_alive() and not self._stopped.wait(drain_timeout_s):
            self._commands.put(_Stop())  # second stop: abort what is left
        self._thread.join(timeout=10.0)

    # Engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        stops = 0
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                stops += self._apply_commands(block=not busy)
                self._admit_compiled()
                if stops >= 2:
                    self._abort_all("the server shut down before the request finished")
                if stops and not self.engine.has_unfinished_requests() and not len(self.grammars):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_queue_sizes()
                self._flush()
        except Exception as e:  # the engine is unusable: fail every caller rather than hang them
            log.exception("engine loop crashed")
            self.fatal_error = f"engine failure: {e}"
            self._stopping.set()  # before callers hear of it: a caller that retries must see it dead
            self._fail_all(self.fatal_error)
        finally:
            self._flush()
            self._stopping.set()
            self._stopped.set()
            self._reject_pending()
            self.grammars.shutdown()

    def _apply_commands(self, block: bool) -> int:
        stops = 0
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return 0
        while True:
            if isinstance(cmd, _Add):
                self._apply_add(cmd)
            elif isinstance(cmd, _Abort):
                if cmd.request_id in self._live:
                    self.engine.abort_request(cmd.request_id)
                    self._live.pop(cmd.request_id, None)
                elif (add := self.grammars.cancel(cmd.request_id)) is not None:
                    add.accepted.cancel()
            elif isinstance(cmd, _Stop):
                stops += 1
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return stops

    def _apply_add(self, cmd: _Add, grammar: Any = None) -> None:
        if cmd.accepted.cancelled():
            return
        if grammar is None and self.grammars.wants(cmd.params):
            self.grammars.submit(cmd.request_id, cmd, cmd.params)  # back in `_admit_compiled`
            return
        on_output = self._tracking(cmd.request_id, cmd.sink)
        kwargs = {"grammar": grammar} if grammar is not None else {}
        try:
            rid = self.engine.add_request(
                cmd.prompt_token_ids, cmd.params, cmd.request_id, on_output=on_output, **kwargs
            )
        except ValueError as e:
            cmd.accepted.set_exception(e)
            return
        self._live[rid] = cmd.sink
        cmd.accepted.set_result(rid)

    def _admit_compiled(self) -> None:
        for cmd, grammar, error in self.grammars.take_done():
            if error is not None:
                if not cmd.accepted.done():
                    cmd.accepted.set_exception(error)
            else:
                self._apply_add(cmd, grammar)

    def _tracking(self, request_id: str, sink: Sink) -> OutputCallback:
        def deliver(out: RequestOutput) -> None:
            if out.finished:
                self._live.pop(request_id, None)
            self._outbox.append((sink, out))

        return deliver

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            self.engine.step()
        finally:
            self._step_started = None
        stats = getattr(self.engine, "last_step_stats", None)
        if self.metrics is not None and stats is not None:
            self.metrics.observe_step(stats)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        hand_over(outbox)

    def _publish_queue_sizes(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue_sizes(self.engine.num_running, self.engine.num_waiting)

    def _abort_all(self, reason: str) -> None:
        for cmd in self.grammars.cancel_all():
            if not cmd.accepted.done():
                cmd.accepted.set_exception(EngineStopped(reason))
        for rid in list(self._live):
            self.engine.abort_request(rid)
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        """Queue an error output for every live request, behind the outputs already queued."""
        live, self._live = self._live, {}
        self._outbox.extend(
            (sink, RequestOutput.failed(rid, reason, retry=True)) for rid, sink in live.items()
        )

    def _reject_pending(self) -> None:
        for cmd in self.grammars.cancel_all():
            if not cmd.accepted.done():
                cmd.accepted.set_exception(EngineStopped(self.fatal_error or "the server is shutting down"))
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and not cmd.accepted.done():
                cmd.accepted.set_exception(EngineStopped(self.fatal_error or "the server is shutting down"))


class AsyncEngineClient:
    """The event loop's view of an engine backend: bounded admission and an async stream per request."""

    def __init__(self, loop: EngineBackend, max_in_flight: int):
        self.engine_loop = loop
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # touched only on the event loop thread

    @contextlib.asynccontextmanager
    async def open(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestStream]:
        """Admit a request (or raise QueueFull / EngineStopped / the engine's ValueError) and stream it.

        Leaving the block before the request finished (client gone, task cancelled, error) aborts it
        in the engine, which frees its KV slot.
        """
        if not self.engine_loop.alive:
            raise EngineStopped(self.engine_loop.fatal_error or "the server is shutting down")
        if self.in_flight >= self.max_in_flight:
            raise QueueFull(f"{self.in_flight} requests in flight; the limit is {self.max_in_flight}")
        stream = RequestStream(request_id or uuid.uuid4().hex, asyncio.get_running_loop())
        self.in_flight += 1
        try:
            accepted = self.engine_loop.add(
                prompt_token_ids, params, stream.request_id, stream.put, loop=stream.loop
            )
            await asyncio.wrap_future(accepted)
            yield stream
        finally:
            self.in_flight -= 1
            if not stream.finished:
                self.engine_loop.abort(stream.request_id)  # idempotent; ignored if never admitted


class RequestStream:
    """Outputs of one request, handed to the event loop by the engine backend and consumed there.

    A consumer that falls behind gets what queued up in one merged output: one frame for several
    steps' tokens instead of one per step, so a busy event loop catches up instead of lagging more.
    """

    def __init__(self, request_id: str, aloop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self.loop = aloop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, out: RequestOutput) -> None:
        """Event loop thread: queue one output."""
        self._queue.put_nowait(out)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        outs = [await self._queue.get()]
        while not outs[-1].finished and not self._queue.empty():
            outs.append(self._queue.get_nowait())
        out = merge_outputs(outs)
        self.finished = out.finished
        return out


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one delta (the last one's status and counts)."""
    if len(outs) == 1:
        return outs[0]
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = [lp for o in outs for lp in o.logprobs or []]
    return dataclasses.replace(
        outs[-1],
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outs),
        logprobs=logprobs,
    )


def hand_over(batch: list[tuple[Sink, RequestOutput]]) -> None:
    """Each output to its callback: one `call_soon_threadsafe` per event loop for the whole batch
    (a step's outputs), not one per output; callbacks without a loop run here."""
    by_loop: dict[asyncio.AbstractEventLoop | None, list[tuple[OutputCallback, RequestOutput]]] = {}
    for (callback, loop), out in batch:
        by_loop.setdefault(loop, []).append((callback, out))
    for loop, items in by_loop.items():
        if loop is None:
            deliver_outputs(items)
        else:
            with contextlib.suppress(RuntimeError):  # the event loop already closed
                loop.call_soon_threadsafe(deliver_outputs, items)


def deliver_outputs(items: list[tuple[OutputCallback, RequestOutput]]) -> None:
    """Call each callback with its output; a failing one costs neither the engine nor the others."""
    for callback, out in items:
        try:
            callback(out)
        except Exception:
            log.exception("output callback of request %s failed", out.request_id)
