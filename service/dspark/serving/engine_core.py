"""The engine's own process: build the engine, step it, and report each step to the replica.

Started by `EngineProcess` as `python -m dspark.serving.engine_core FD`, FD being its end of a
socket pair. Its own interpreter means its own GIL: the step's Python never waits behind the
replica's event loop, Ray's threads or the HTTP handling. The loop is `EngineLoop`'s: commands are
applied between steps (continuous batching), and it idles on the pipe while nothing is running.
The pipe is also the watchdog: when the replica dies, its end closes and this process exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import psutil

from dspark.engine.outputs import RequestOutput
from dspark.serving.config import ServeConfig
from dspark.serving.engine_messages import (
    SHUTDOWN_REASON,
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineSpec,
    Shutdown,
    StepReport,
    Stop,
)
from dspark.serving.engine_prestart import LISTEN_FLAG, await_replica
from dspark.serving.grammar_jobs import GrammarJobs
from dspark.serving.runtime import STARTED_AT_ENV
from dspark.serving.threads import GOMP_CPU_AFFINITY, ThreadPlan

if TYPE_CHECKING:
    from dspark.serving.step_prediction import StepPredictor

# Named, not __name__: run as `python -m`, this module is __main__, outside the dspark logger.
log = logging.getLogger("dspark.serving.engine_core")
# How often an engine loop that is not stepping (grammars compiling) reports that it is alive: the
# replica counts a busy engine silent for longer than its stall timeout as hung.
HEARTBEAT_S = 1.0


class ReplicaGone(Exception):
    """The replica's end of the pipe closed: nobody is left to serve."""


class EngineCore:
    """Steps `engine` while any request is unfinished and sends one `StepReport` per step.

    Structured requests wait for their grammar on a worker thread (`GrammarJobs`) and join the
    batch between two steps once it is compiled; meanwhile a `StepReport` every `HEARTBEAT_S`
    tells the replica that the loop is alive although no step runs.
    """

    def __init__(
        self,
        engine: Any,
        conn: Connection,
        thread_plan: ThreadPlan | None = None,
        predictor: StepPredictor | None = None,
    ):
        self.engine = engine
        self.conn = conn
        self.thread_plan = thread_plan
        self.predictor = predictor  # what each step should take, for the replica's `StepPace`
        self._live: set[str] = set()
        self._report = StepReport()
        self._sizes = (0, 0)
        self._last_stats = getattr(engine, "last_step_stats", None)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the loop
        self.grammars: GrammarJobs[AddRequest] = GrammarJobs(engine, self._wake)

    def run(self) -> int:
        """Serve until stopped (0), the replica is gone (0) or the engine fails (1)."""
        stops = 0
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                # Once stopping, wait only for grammars: the stop check below ends an idle loop.
                stops += self._apply_commands(block=idle and (not stops or len(self.grammars) > 0))
                if stops >= 2:
                    self._abort_all()
                if stops and not self._busy():
                    self._flush()
                    self._send(Shutdown())
                    return 0
                if self.engine.has_unfinished_requests():
                    self._step()
                self._flush()
        except ReplicaGone:
            return 0
        except Exception as e:  # the engine is unusable: tell the replica, which fails every caller
            log.exception("engine loop crashed")
            try:
                self._flush()
                self._send(EngineFailed(f"engine failure: {e}"))
            except ReplicaGone:
                pass
            return 1
        finally:
            self.grammars.shutdown()

    def _busy(self) -> bool:
        return self.engine.has_unfinished_requests() or len(self.grammars) > 0

    # Commands ------------------------------------------------------------------------------------
    def _apply_commands(self, block: bool) -> int:
        """Apply every queued command and compiled grammar (waiting for one when `block`); return
        the stops among the commands."""
        stops = 0
        if block:
            self._wait()
        self._admit_compiled()
        while self._poll():
            cmd = self._recv()
            if isinstance(cmd, AddRequest):
                if self.grammars.wants(cmd.params):
                    self.grammars.submit(cmd.request_id, cmd, cmd.params)
                else:
                    self._add(cmd)
            elif isinstance(cmd, AbortRequest):
                if cmd.request_id in self._live:
                    self.engine.abort_request(cmd.request_id)
                elif self.grammars.cancel(cmd.request_id) is not None:
                    self._report.refused.append((cmd.request_id, "aborted while its grammar compiled"))
            elif isinstance(cmd, Stop):
                stops += 1
        return stops

    def _wait(self) -> None:
        """Until a command or a compiled grammar arrives; with grammars compiling, a heartbeat
        report at least every `HEARTBEAT_S`."""
        while True:
            compiling = len(self.grammars) > 0
            try:
                ready = wait([self.conn, self._wake_r], timeout=HEARTBEAT_S if compiling else None)
            except OSError as e:
                raise ReplicaGone from e
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            if ready:
                return
            self._flush(heartbeat=True)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b".")

    def _admit_compiled(self) -> None:
        for cmd, grammar, error in self.grammars.take_done():
            if error is not None:
                self._report.refused.append((cmd.request_id, str(error)))
            else:
                self._add(cmd, grammar)

    def _add(self, cmd: AddRequest, grammar: Any = None) -> None:
        kwargs = {"grammar": grammar} if grammar is not None else {}
        try:
            rid = self.engine.add_request(
                cmd.prompt_token_ids, cmd.params, cmd.request_id, on_output=self._collect, **kwargs
            )
        except ValueError as e:  # bad input: the caller's 400, not the engine's failure
            self._report.refused.append((cmd.request_id, str(e)))
            return
        self._live.add(rid)
        self._report.admitted.append(rid)

    def _collect(self, out: RequestOutput) -> None:
        if out.finished:
            self._live.discard(out.request_id)
        self._report.outputs.append(out)

    def _abort_all(self) -> None:
        for cmd in self.grammars.cancel_all():
            self._report.refused.append((cmd.request_id, SHUTDOWN_REASON))
        for rid in list(self._live):
            self.engine.abort_request(rid)
        for rid in list(self._live):  # an engine that did not report the abort
            self._collect(RequestOutput.failed(rid, SHUTDOWN_REASON, retry=True))

    # Steps and reports ---------------------------------------------------------------------------
    def _step(self) -> None:
        if self.thread_plan is not None:
            self.thread_plan.apply(self.engine.num_running + self.engine.num_waiting)
        self.engine.step()
        stats = getattr(self.engine, "last_step_stats", None)
        # A step that scheduled nothing keeps the previous step's stats: never count them twice.
        if stats is not None and stats is not self._last_stats:
            if self.predictor is not None:
                self.predictor.annotate(stats)
            self._report.stats = stats
            self._last_stats = stats

    def _flush(self, heartbeat: bool = False) -> None:
        """Send what this pass produced, in one message; nothing when nothing changed, unless it is
        a `heartbeat`."""
        r = self._report
        sizes = (self.engine.num_running, self.engine.num_waiting)
        changed = r.outputs or r.admitted or r.refused or r.stats is not None or sizes != self._sizes
        if not (changed or heartbeat):
            return
        r.num_running, r.num_waiting = sizes
        self._sizes = sizes
        self._report = StepReport()
        self._send(r)

    # The pipe ------------------------------------------------------------------------------------
    def _poll(self) -> bool:
        try:
            return self.conn.poll()
        except (EOFError, OSError) as e:
            raise ReplicaGone from e

    def _recv(self) -> Any:
        try:
            return self.conn.recv()
        except (EOFError, OSError) as e:
            raise ReplicaGone from e

    def _send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise ReplicaGone from e


def load_engine(config: Any) -> Any:
    """The engine a replica serves, from its `ServeConfig` (in this process or the engine's own)."""
    import torch

    from dspark.builder import engine_from_config

    _log_start_up()
    # No more intra-op threads than the CPUs Ray reserved for this replica: more threads than cores
    # make OpenMP workers of co-located replicas spin against each other (~10x slower on 2 cores).
    torch.set_num_threads(config.thread_plan().batch)
    engine = engine_from_config(config.engine_config())
    engine.grammars.prepare()  # here, not at the first structured request
    return engine


class _SinceStart(logging.Formatter):
    """`[+12.3 s] INFO name: message`, the seconds counted from `dspark serve`'s start
    ($DSPARK_STARTED_AT), so the engine's stages read on one clock with the launcher's; without it,
    no prefix."""

    def __init__(self) -> None:
        super().__init__("%(since)s%(levelname)s %(name)s: %(message)s")
        try:
            self.started: float | None = float(os.environ[STARTED_AT_ENV])
        except (KeyError, ValueError):
            self.started = None

    def format(self, record: logging.LogRecord) -> str:
        record.since = f"[+{record.created - self.started:.1f} s] " if self.started is not None else ""
        return super().format(record)


def _log_start_up() -> None:
    """Show the engine's INFO lines (drafter, policy, which SPS profile or a new measurement, the
    background build) in the replica's output: outside Ray's own loggers a replica process keeps only
    warnings."""
    logger = logging.getLogger("dspark")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_SinceStart())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # where Ray gave the root logger a handler, once is enough


def main(argv: list[str]) -> int:
    """Receive the replica's import path and the `EngineSpec`, build the engine, then serve.

    `FD` is this process's end of the replica's socket pair; `--listen FD` makes it the engine
    `dspark serve` prestarts (`engine_prestart`), which imports the engine's modules while Ray starts
    and then takes the first replica that connects to the listening socket FD.
    """
    _log_start_up()
    if argv[1] == LISTEN_FLAG:
        launcher = os.getppid()
        waiting = _exit_when_orphaned(
            lambda: os.getppid() != launcher, "`dspark serve` exited before a replica took this engine over"
        )
        handed = await_replica(int(argv[2]), _preload)
        waiting.set()
        if handed is None:
            return 0
        conn, replica = handed

        def replica_gone() -> bool:
            return not psutil.pid_exists(replica)
    else:
        replica = os.getppid()
        conn = Connection(int(argv[1]))

        def replica_gone() -> bool:
            return os.getppid() != replica  # orphans are re-parented

    try:
        # The replica's import path first, so a factory it names (a test's fake engine) resolves.
        paths = conn.recv()
        sys.path[:0] = [p for p in paths if p not in sys.path]
        spec: EngineSpec = conn.recv()
    except (EOFError, OSError):
        return 0
    building = _exit_when_orphaned(replica_gone, "the replica exited while the engine was starting; stopping")
    stepping_cpus = _build_on_every_core(replica)
    try:
        engine = spec.factory(spec.config)
        os.sched_setaffinity(0, stepping_cpus)
        plan = _thread_plan(spec.config, engine)
        info = EngineInfo.of(engine)
    except Exception as e:
        log.exception("engine start-up failed")
        with contextlib.suppress(OSError):
            conn.send(EngineFailed(f"engine start-up failed: {e}"))
        return 1
    finally:
        building.set()  # from here on the pipe is the watchdog
    try:
        conn.send(info)
    except OSError:
        return 0
    try:
        return EngineCore(engine, conn, plan, _step_predictor(engine, plan)).run()
    finally:
        _end_own_children()


def _preload() -> None:
    """What building a served engine imports (seconds of torch, transformers and the engine's own
    modules), for the prestarted engine to import before its replica arrives."""
    import dspark.builder  # noqa: F401

    with contextlib.suppress(ImportError):  # the fast tokenizers' module, loaded at the tokenizer's load
        import transformers.tokenization_utils_fast  # noqa: F401


def _end_own_children() -> None:
    """Kill what this process started and left running: a background build's C++ compilers and
    inductor's compile workers would outlive a stopped server."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def _build_on_every_core(replica: int) -> set[int]:
    """Let this thread build the engine on every core of the replica; return the cores it steps on.

    With `GOMP_CPU_AFFINITY` set (`EngineProcess` pins the engine's threads), libgomp pinned this
    thread, its team's thread 0, to the first core listed when torch loaded (this module's imports
    load it); the inductor compile workers that the build starts would inherit that one core.
    """
    stepping = os.sched_getaffinity(0)
    with contextlib.suppress(OSError):  # the replica is already gone: the watchdog exits
        os.sched_setaffinity(0, stepping | os.sched_getaffinity(replica))
    if cpus := os.environ.get(GOMP_CPU_AFFINITY):
        log.info("intra-op threads pinned to CPUs %s (%s)", cpus, GOMP_CPU_AFFINITY)
    return stepping


def _exit_when_orphaned(gone: Callable[[], bool], why: str, interval_s: float = 0.5) -> threading.Event:
    """Exit when `gone()` (the process this one works for exited), until the returned event is set.

    Building the engine (loading, compiling, measuring an SPS profile) takes minutes without a look
    at the pipe; a replica killed meanwhile (Ctrl-C at start-up, a failed health check) must not
    leave the build holding its memory and cores.
    """
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            if gone():
                log.warning(why)
                os._exit(0)

    threading.Thread(target=watch, name="dspark-orphan-watch", daemon=True).start()
    return done


def _thread_plan(config: Any, engine: Any) -> ThreadPlan | None:
    """A served engine's thread plan, with its one-request thread count timed on a CPU engine."""
    # Here, not at the top: the replica imports this module for `load_engine` and need not load
    # the engine's modules (they double its import time).
    from dspark.engine.llm_engine import LLMEngine

    if not isinstance(config, ServeConfig):
        return None
    plan = config.thread_plan()
    if isinstance(engine, LLMEngine) and engine.device.type == "cpu":
        plan = plan.timed(engine)
    return plan


def _step_predictor(engine: Any, plan: ThreadPlan | None) -> StepPredictor:
    # Here, not at the top, for the reason `_thread_plan` gives.
    from dspark.serving.step_prediction import StepPredictor

    return StepPredictor.of(engine, plan)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
