"""Where a served load spends CPU: each process of a server (and the client) by role, per output token.

A closed loop that runs slower served than in-process is slow either because a process is
saturated (the engine at its intra-op threads, or the HTTP side at one core) or because work waits
on a handoff; the CPU each role burns per output token tells the two apart.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil

# First match wins; matched against the process's command line (vLLM and Ray retitle theirs).
ROLE_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine", ("dspark.serving.engine_core", "VLLM::EngineCore", "VLLM::Worker")),
    ("replica", ("ray::ServeReplica",)),
    ("proxy", ("ray::ProxyActor",)),
    ("api server", ("VLLM::APIServer", "vllm.entrypoints")),
)
ROLES = ("engine", "replica", "proxy", "api server", "client", "other")


def role_of(cmdline: str) -> str:
    for role, patterns in ROLE_PATTERNS:
        if any(p in cmdline for p in patterns):
            return role
    return "other"


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def process_cpu_seconds() -> float:
    """This process's CPU seconds (every thread)."""
    return _cpu_seconds(psutil.Process(os.getpid()))


@dataclass
class CpuShare:
    """CPU seconds by role over one measured interval."""

    seconds: dict[str, float] = field(default_factory=dict)

    def ms_per_token(self, tokens: int) -> dict[str, float]:
        return {r: round(s * 1e3 / max(tokens, 1), 3) for r, s in self.seconds.items()}


def _family(root_pid: int) -> dict[int, psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(root_pid)
        return {p.pid: p for p in [root, *root.children(recursive=True)]}
    return {}


def _snapshot(procs: dict[int, psutil.Process]) -> dict[int, float]:
    out = {}
    for pid, p in procs.items():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            out[pid] = _cpu_seconds(p)
    return out


@contextlib.contextmanager
def measure_cpu(server_pid: int) -> Iterator[CpuShare]:
    """CPU of the server's process tree and of this process (the client) while the block runs.
    A process started inside the block counts from zero; one that exits inside it is lost (its last
    reading is unknown), which a server under a steady load does not do."""
    share = CpuShare()
    procs = _family(server_pid)
    before = _snapshot(procs)
    client_before = process_cpu_seconds()
    yield share
    procs.update({pid: p for pid, p in _family(server_pid).items() if pid not in procs})
    after = _snapshot(procs)
    seconds = dict.fromkeys(ROLES, 0.0)
    for pid, value in after.items():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            role = role_of(" ".join(procs[pid].cmdline()))
            seconds[role] += value - before.get(pid, 0.0)
    seconds["client"] += process_cpu_seconds() - client_before
    share.seconds = {r: round(s, 4) for r, s in seconds.items()}
