"""The engine in its own process, behind `EngineLoop`'s interface (the shape of vLLM's EngineCore).

The replica spawns `dspark.serving.engine_core` with one end of a socket pair, sends it the
`EngineSpec`, and waits for its `EngineInfo` (tokenizer, config, limits). Requests go down the
pipe through a writer thread (a stopped or stalled engine fills the socket, and a blocking send
would stop the event loop); a reader thread receives one `StepReport` per engine step and hands
all its outputs to the event loop in one `call_soon_threadsafe`. The engine's Python thus never
competes for this process's GIL with the event loop, Ray's threads and the HTTP handling.

Every message from the engine counts as progress (it sends a heartbeat while it waits for
grammars); `stalled_s` is how long it has been silent with requests open, and `kill` ends a hung
one, which fails its requests as its death does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dspark import OPENMP_ENV
from dspark.engine.outputs import RequestOutput
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.config import ServeConfig
from dspark.serving.engine_loop import EngineStopped, OutputCallback, Sink, hand_over
from dspark.serving.engine_messages import (
    SHUTDOWN_REASON,
    AbortRequest,
    AddRequest,
    EngineFactory,
    EngineFailed,
    EngineInfo,
    EngineSpec,
    Shutdown,
    StepReport,
    Stop,
)
from dspark.serving.engine_prestart import PRESTARTED_ENGINE_ENV, HandedOverProcess, adopt
from dspark.serving.metrics import ServingMetrics
from dspark.serving.threads import pinning_env

log = logging.getLogger(__name__)


class EngineProcess:
    """Builds the engine in a child process (blocking until it is ready) and relays its requests.

    `add`, `abort`, `stop`, `alive`, `stalled_s`, `fatal_error` and `metrics` behave as
    `EngineLoop`'s; `info` holds what the serving layer reads from an engine.
    """

    def __init__(self, factory: EngineFactory, config: Any, metrics: ServingMetrics | None = None):
        self.metrics = metrics
        self.fatal_error: str | None = None
        self._lock = threading.Lock()  # the two tables below, `_closed` and `_heard_at`
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()  # for the writer thread; None ends it
        self._heard_at = time.monotonic()  # the engine's last message, or when work arrived at an idle one
        self._sinks: dict[str, Sink] = {}
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._closed = False
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self.pinned_cpus = (
            config.engine_cpus(os.sched_getaffinity(0)) if isinstance(config, ServeConfig) else None
        )
        env = engine_env(self.pinned_cpus)
        self._proc: subprocess.Popen | HandedOverProcess
        self._proc, self._conn = adopt(env) or _spawn(env)
        try:
            self.info = self._handshake(EngineSpec(factory, config))
        except BaseException:
            self._reap(kill=True)
            raise
        self._reader = threading.Thread(target=self._read, name="dspark-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="dspark-engine-writer", daemon=True)

    # Any thread ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._writer.start()
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and not self._stopping.is_set()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stalled_s(self) -> float:
        """Seconds the engine has been silent while requests were open (0 when none are)."""
        with self._lock:
            if not (self._sinks or self._pending):
                return 0.0
            return time.monotonic() - self._heard_at

    def kill(self, reason: str) -> None:
        """End a hung engine: its open requests fail with `reason` as they would at its death."""
        self.fatal_error = self.fatal_error or reason
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGKILL)

    def add(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        on_output: OutputCallback,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> concurrent.futures.Future:
        """Send a request; the future resolves to its id once the engine took it, or to its
        ValueError. `on_output` runs on `loop` when given, else on the reader thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._stopping.is_set():
                fut.set_exception(EngineStopped(self.fatal_error or "the server is shutting down"))
                return fut
            if request_id in self._sinks:
                fut.set_exception(ValueError(f"request id {request_id!r} is already in use"))
                return fut
            if not (self._sinks or self._pending):
                self._heard_at = time.monotonic()  # an idle engine owed no word until now
            self._sinks[request_id] = (on_output, loop)
            self._pending[request_id] = fut
        # A pipe that breaks meanwhile ends the reader, which fails this request with the others.
        self._send(AddRequest(request_id, list(prompt_token_ids), params))
        return fut

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._closed or request_id not in self._sinks:
                return  # finished, refused or never sent: nothing holds a KV slot for it
        self._send(AbortRequest(request_id))

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to `drain_timeout_s`, then abort the rest."""
        self._stopping.set()
        self._send(Stop())
        if self._reader.is_alive() and not self._stopped.wait(drain_timeout_s):
            self._send(Stop())  # second stop: abort what is left
            self._stopped.wait(10.0)
        self._reap(kill=False)

    # Start-up and shut-down ----------------------------------------------------------------------
    def _handshake(self, spec: EngineSpec) -> EngineInfo:
        self._conn.send(list(sys.path))
        self._conn.send(spec)
        _import_engine_info_modules()
        try:
            msg = self._conn.recv()  # as long as it takes: loading, maybe measuring an SPS profile
        except (EOFError, OSError):
            raise RuntimeError(
                f"the engine process exited before it was ready ({_exit_status(self._proc)})"
            ) from None
        if isinstance(msg, EngineFailed):
            raise RuntimeError(msg.message)
        if not isinstance(msg, EngineInfo):
            raise RuntimeError(f"the engine process sent {type(msg).__name__} instead of its EngineInfo")
        return msg

    def _reap(self, kill: bool) -> None:
        """Wait for the child (killing it when asked, or after 10 s), then close the pipe."""
        if kill:
            self._proc.kill()
        try:
            self._proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        reader = getattr(self, "_reader", None)
        if reader is not None and reader.is_alive():
            reader.join(10.0)  # the child's exit closed the pipe: the reader is leaving
        self._outgoing.put(None)
        writer = getattr(self, "_writer", None)
        if writer is not None and writer.is_alive():
            writer.join(10.0)
        self._conn.close()

    def _send(self, msg: Any) -> None:
        """Queue `msg` for the writer thread: never blocks."""
        self._outgoing.put(msg)

    # Writer thread -------------------------------------------------------------------------------
    def _write(self) -> None:
        while (msg := self._outgoing.get()) is not None:
            try:
                self._conn.send(msg)
            except OSError:  # the engine is gone: the reader sees it too and fails every caller
                return

    # Reader thread -------------------------------------------------------------------------------
    def _read(self) -> None:
        clean = False
        try:
            while True:
                msg = self._conn.recv()
                with self._lock:
                    self._heard_at = time.monotonic()
                if isinstance(msg, StepReport):
                    self._on_report(msg)
                elif isinstance(msg, EngineFailed):
                    self.fatal_error = msg.message
                    return
                elif isinstance(msg, Shutdown):
                    clean = True
                    return
        except (EOFError, OSError):
            pass
        except Exception as e:  # a message this side cannot read: the engine is out of reach
            log.exception("engine process reader failed")
            self.fatal_error = f"engine failure: {e}"
        finally:
            if not clean:
                self.fatal_error = self.fatal_error or (
                    f"engine failure: the engine process exited ({_exit_status(self._proc)})"
                )
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
            self._stopping.set()  # before callers hear of it: a caller that retries must see it dead
            self._close(self.fatal_error or SHUTDOWN_REASON)
            self._stopped.set()

    def _on_report(self, report: StepReport) -> None:
        acks: list[tuple[concurrent.futures.Future | None, str, str | None]] = []
        batch: list[tuple[Sink, RequestOutput]] = []
        with self._lock:
            for rid in report.admitted:
                acks.append((self._pending.pop(rid, None), rid, None))
            for rid, error in report.refused:
                self._sinks.pop(rid, None)
                acks.append((self._pending.pop(rid, None), rid, error))
            for out in report.outputs:
                rid = out.request_id
                sink = self._sinks.pop(rid, None) if out.finished else self._sinks.get(rid)
                if sink is not None:
                    batch.append((sink, out))
        for fut, rid, error in acks:
            if fut is not None and not fut.done():
                if error is None:
                    fut.set_result(rid)
                else:
                    fut.set_exception(ValueError(error))
        if self.metrics is not None:
            if report.stats is not None:
                self.metrics.observe_step(report.stats)
            self.metrics.set_queue_sizes(report.num_running, report.num_waiting)
        hand_over(batch)

    def _close(self, reason: str) -> None:
        """Fail every request still open: running ones get an error output, unacknowledged ones
        EngineStopped (they never started)."""
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
            sinks, self._sinks = self._sinks, {}
        for rid, fut in pending.items():
            sinks.pop(rid, None)
            if not fut.done():
                fut.set_exception(EngineStopped(self.fatal_error or "the server is shutting down"))
        hand_over([(sink, RequestOutput.failed(rid, reason, retry=True)) for rid, sink in sinks.items()])


def _import_engine_info_modules() -> None:
    """Import the tokenizer classes that unpickling `EngineInfo` needs now, while the engine
    process loads on another core; at the unpickling they would delay the first answer (transformers
    takes seconds to import)."""
    with contextlib.suppress(ImportError):
        import transformers.tokenization_utils_fast  # noqa: F401


def _spawn(env: dict[str, str]) -> tuple[subprocess.Popen, Connection]:
    """Start `python -m dspark.serving.engine_core FD` on one end of a socket pair."""
    mine, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dspark.serving.engine_core", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
    return proc, Connection(mine.detach())


def engine_env(pinned_cpus: list[int] | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine process's environment: `environ` (this process's by default), with this `dspark`
    first on the path (a checkout may shadow an install), the OpenMP settings of every dspark process
    unless set already, and the intra-op threads pinned to `pinned_cpus` unless the environment
    places OpenMP's threads itself."""
    import dspark

    env = dict(os.environ if environ is None else environ)
    env.pop(PRESTARTED_ENGINE_ENV, None)  # an engine takes nothing over
    here = str(Path(dspark.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    for name, value in OPENMP_ENV.items():
        env.setdefault(name, value)
    env.update(pinning_env(pinned_cpus, env))
    return env


def _exit_status(proc: subprocess.Popen) -> str:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(1.0)
    code = proc.returncode
    if code is None:
        return "still running"
    if isinstance(proc, HandedOverProcess):
        return "exit status unknown: `dspark serve` started it"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
