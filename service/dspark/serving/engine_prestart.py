"""An engine process started by `dspark serve` before Ray, and handed over to the replica.

A replica spawns its engine process only once Ray, Serve's controller and proxy, and the replica's
own actor are up (about 8 s of a 19 s warm start on 2 cores), and the engine then spends seconds
importing torch, transformers and the engine's modules before it reads a weight. Started by the
launcher at once, those imports run while Ray starts. The prestarted process listens on a Unix socket
(in a directory only this user can enter: whoever connects sends it code to run); the one replica
that connects takes it over, and builds its engine in it exactly as in a process of its own, which
it adopts only where the environment it would have given that process is the prestarted one's
(`environment_differences`). Otherwise, and for every later engine (a restart, another replica), the
replica spawns its own.

Three sides: `PrestartedEngine` (the launcher's), `adopt` (the replica's), `await_replica` (the
engine process's).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

# Where a replica finds the prestarted engine's socket (set in the replica's environment by the launcher).
PRESTARTED_ENGINE_ENV = "DSPARK_PRESTARTED_ENGINE"
LISTEN_FLAG = "--listen"
# Set per process by Ray in its workers' environments; they tell nothing about the engine.
_PER_PROCESS = ("RAY_", "PYTHONBREAKPOINT", "SPT_NOENV")


@dataclass
class EngineHello:
    """The prestarted engine's first message to the replica that connected: who it is and what it
    runs in (the environment it was started with: torch's imports add to `os.environ`)."""

    pid: int
    environ: dict[str, str]
    cwd: str


class PrestartedEngine:
    """The launcher's side: the engine process, started now, waiting for its replica."""

    def __init__(self, environ: Mapping[str, str]):
        self._dir = Path(tempfile.mkdtemp(prefix="dspark-engine-"))  # mode 0700
        self.path = self._dir / "engine.sock"
        # Bound here, so a replica can connect from now on (it waits in the backlog until the
        # engine's imports are done) and never spawns a second engine beside this one.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(1)
        with listener:
            # Its own session: Ctrl-C at the terminal reaches the launcher, which drains the replica,
            # and not this engine in the middle of that drain (a spawned engine is a Ray worker's
            # child, outside the terminal's process group too).
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dspark.serving.engine_core", LISTEN_FLAG, str(listener.fileno())],
                pass_fds=(listener.fileno(),),
                env=dict(environ),
                start_new_session=True,
            )
        # Reaped as soon as it exits: the replica that took it over waits for its pid to disappear.
        threading.Thread(target=self._proc.wait, name="dspark-prestarted-reaper", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait(self, timeout: float) -> int:
        """Its exit code, once it exits within `timeout` seconds."""
        return self._proc.wait(timeout)

    def replica_env(self) -> dict[str, str]:
        """What tells a replica where to find this engine."""
        return {PRESTARTED_ENGINE_ENV: str(self.path)}

    def close(self) -> None:
        """Kill the engine if it still runs (nobody took it over, or its replica left it behind)."""
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10.0)
        shutil.rmtree(self._dir, ignore_errors=True)


def prestart_environment(config: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a replica's worker will have (`environ` being the one Ray's workers inherit,
    with the replica's runtime env applied): Ray sets OMP_NUM_THREADS to the actor's CPUs where unset."""
    env = dict(environ)
    env.setdefault("OMP_NUM_THREADS", str(max(math.floor(config.replica_cpus()), 1)))
    return env


def should_prestart(config: Any) -> bool:
    """Only for the one CPU replica of a server on a Ray instance of its own: a GPU replica's devices
    are Ray's to assign, of several replicas only the first would find it, and on a cluster the
    replica may run on another node."""
    return (
        config.address is None
        and not config.engine_in_thread
        and config.max_replicas == 1
        and config.num_gpus_per_replica == 0
        and not (config.device or "").startswith("cuda")
    )


def environment_differences(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """The variables in which two engine environments differ, Ray's per-process ones left out."""
    names = set(expected) | set(actual)
    return sorted(n for n in names if expected.get(n) != actual.get(n) and not n.startswith(_PER_PROCESS))


# The replica's side ---------------------------------------------------------------------------------
class HandedOverProcess:
    """What `EngineProcess` uses of a `Popen`, for the prestarted engine: the launcher's child,
    not this process's, so it is watched by pid (the launcher reaps it)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._process = psutil.Process(pid)
        self.returncode: int | None = None

    def kill(self) -> None:
        with contextlib.suppress(psutil.Error):
            self._process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            self._process.wait(timeout)
        except psutil.TimeoutExpired:
            raise subprocess.TimeoutExpired("dspark.serving.engine_core", timeout or 0.0) from None
        # Its exit code went to the launcher: this side only knows that it is gone.
        self.returncode = 0
        return self.returncode


def adopt(expected_env: Mapping[str, str]) -> tuple[HandedOverProcess, Connection] | None:
    """Take over the prestarted engine where there is one and it runs in `expected_env` (the
    environment this replica would spawn its engine with); None where it must spawn its own."""
    path = os.environ.get(PRESTARTED_ENGINE_ENV)
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # taken over already (its socket is gone), or the launcher's engine died
        sock.close()
        return None
    conn = Connection(sock.detach())
    try:
        hello = conn.recv()  # once its imports are done
    except (EOFError, OSError):
        conn.close()
        return None
    differing = environment_differences(expected_env, hello.environ)
    if differing or hello.cwd != os.getcwd():
        log.warning(
            "not taking over the prestarted engine (pid %d): it runs with another %s; starting one",
            hello.pid,
            ", ".join(differing) or "working directory",
        )
        conn.close()  # it exits on the closed socket
        return None
    log.info("took over the engine process the launcher started (pid %d)", hello.pid)
    return HandedOverProcess(hello.pid), conn


# The engine process's side --------------------------------------------------------------------------
def await_replica(listener_fd: int, preload: Callable[[], None]) -> tuple[Connection, int] | None:
    """Run `preload()` (the imports), then take the first replica that connects to the socket
    listening on `listener_fd`: return the connection and the replica's pid (None if it left)."""
    preload()
    with socket.socket(fileno=listener_fd) as listener:
        sock, _ = listener.accept()
        path = Path(listener.getsockname())
    with contextlib.suppress(OSError):
        path.unlink()  # the next replica to look (a restart) spawns its own
        path.parent.rmdir()
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    conn = Connection(sock.detach())
    try:
        conn.send(EngineHello(os.getpid(), _environment_at_start(), os.getcwd()))
    except OSError:
        return None
    return conn, pid


def _environment_at_start() -> dict[str, str]:
    """This process's environment as it was started (`/proc/self/environ`; the imports since then
    set variables of their own, such as torch's TORCHINDUCTOR_CACHE_DIR)."""
    raw = Path("/proc/self/environ").read_bytes()
    return dict(os.fsdecode(entry).partition("=")[::2] for entry in raw.split(b"\0") if b"=" in entry)
