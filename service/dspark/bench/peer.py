"""`dspark bench peer`: this server against vLLM on the same machine, model files, prompts and client.

Each system is started as its own server on loopback, measured at every closed-loop level, then
stopped; rounds run the systems in turn (A B C D, A B C D), so a slow spell of a shared machine
falls on all of them. The in-process system runs the same load on the engine without HTTP, which
isolates what the serving path costs.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dspark.bench.cpu_share import ROLES, measure_cpu, process_cpu_seconds
from dspark.bench.fresh_process import in_fresh_process
from dspark.bench.http_load import LevelResult, run_level, wait_until_serving
from dspark.prompts.builtin import BUILTIN_PROMPTS

MODEL_NAME = "smollm2-135m"
NGRAM_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
)


PLAIN = ("--drafter", "none", "--policy", "none")


@dataclass(frozen=True)
class System:
    """One server configuration: `kind` is vllm, dspark (HTTP) or inprocess (the engine, no HTTP;
    `args` are its drafter, policy and optionally its intra-op thread count). An in-process system
    with `beside` runs while that server system is up and idle on the same machine."""

    name: str
    kind: str
    args: tuple[str, ...] = ()
    beside: str | None = None


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("vllm", "vllm"),
        System("vllm-ngram", "vllm", ("--speculative-config", NGRAM_SPEC)),
        System("dspark-plain", "dspark", PLAIN),
        System("dspark", "dspark", ("--drafter", "auto", "--policy", "auto")),
        # The target's forward run eagerly instead of as inductor graphs.
        System("dspark-plain-eager", "dspark", (*PLAIN, "--no-compile")),
        System("dspark-eager", "dspark", ("--drafter", "auto", "--policy", "auto", "--no-compile")),
        # The engine stepped on a thread of the replica instead of in its own process.
        System("dspark-plain-inthread", "dspark", (*PLAIN, "--engine-in-thread")),
        System("dspark-inthread", "dspark", ("--drafter", "auto", "--policy", "auto", "--engine-in-thread")),
        # The engine process at a fixed thread count instead of the default plan (ServeConfig.thread_plan).
        System("dspark-plain-threads1", "dspark", (*PLAIN, "--engine-threads", "1")),
        System("dspark-plain-threads2", "dspark", (*PLAIN, "--engine-threads", "2")),
        # The engine's intra-op threads left to the OS scheduler instead of pinned one per core.
        System("dspark-plain-unpinned", "dspark", (*PLAIN, "--no-pin-engine-threads")),
        # Every token through Ray Serve's HTTP proxy instead of the one replica's own server.
        System("dspark-plain-proxy", "dspark", (*PLAIN, "--ingress", "proxy")),
        System("inprocess-plain", "inprocess", ("none", "none")),
        System("inprocess", "inprocess", ("auto", "auto")),
        # torch's default is one intra-op thread per core; on a busy machine one thread can be faster.
        System("inprocess-plain-threads1", "inprocess", ("none", "none", "1")),
        # The engine alone while an idle `dspark-plain` server (Ray's daemons, Serve's controller and
        # proxy, a replica) shares the machine: what Ray's runtime costs an engine, without HTTP load.
        System("inprocess-plain-beside-server", "inprocess", ("none", "none"), beside="dspark-plain"),
    )
}


@dataclass
class PeerRun:
    """Every round of every system; `points[system][users]` lists one LevelResult per round."""

    levels: list[int]
    points: dict[str, dict[int, list[LevelResult]]] = field(default_factory=dict)

    def add(self, system: str, result: LevelResult) -> None:
        self.points.setdefault(system, {}).setdefault(result.users, []).append(result)

    def median(self, system: str, users: int, metric: str) -> float:
        return statistics.median(getattr(r, metric) for r in self.points[system][users])


def bench_prompts() -> list[str]:
    """Code, chat and math prompts interleaved, so every level sees the same mix."""
    domains = [BUILTIN_PROMPTS[d] for d in ("math", "code", "chat")]
    return [p for group in zip(*domains, strict=True) for p in group]


# Ports for the servers: above Ray's worker ports (10002-19999) and below the kernel's ephemeral
# range, from which Ray's own gRPC servers draw, so a port found free is still free when bound.
SERVER_PORTS = range(20000, 30000)


def free_port() -> int:
    for port in random.sample(SERVER_PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS}")


def server_command(system: System, model_dir: Path, port: int, dtype: str, vllm_python: str) -> list[str]:
    if system.kind == "vllm":
        return [
            vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            dtype,
            "--max-model-len",
            "2048",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *system.args,
        ]
    dspark = str(Path(sys.executable).with_name("dspark"))
    # Compiled before the first request, as the load is measured from the first request on.
    return [dspark, "serve", "--port", str(port), "--dtype", dtype, "--build-before-serving", *system.args]


@contextlib.contextmanager
def running_server(
    command: list[str], log_path: Path, env: dict[str, str], grace_s: float = 60.0
) -> Iterator[subprocess.Popen]:
    """Start a server in its own process group; stop the whole group on every way out."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            yield proc
        finally:
            stop_group(proc, grace_s)


def stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGINT (both servers drain and shut down on it), then SIGKILL to what is left: the process
    group and every descendant (Ray's daemons and workers may have left the group)."""
    import psutil

    family: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        family = psutil.Process(proc.pid).children(recursive=True)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        # A second Ctrl-C or SIGTERM cuts the drain short, never the kill below.
        with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()


@contextlib.contextmanager
def serving(
    system: System,
    model_dir: Path,
    dtype: str,
    vllm_python: str,
    log_path: Path,
    warmup_tokens: int,
    startup_timeout_s: float = 600.0,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A server system up on a free loopback port and warmed up; stopped on every way out."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if system.kind == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    command = server_command(system, model_dir, port, dtype, vllm_python)
    with running_server(command, log_path, env) as proc:
        wait_until_serving(base, startup_timeout_s, alive=lambda: proc.poll() is None)
        run_level(base, MODEL_NAME, bench_prompts(), 2, 2, warmup_tokens)  # warm-up: first-call allocations
        yield proc, base


def idle_server_beside(
    system: System, model_dir: Path, dtype: str, vllm_python: str, log_path: Path, warmup_tokens: int
) -> contextlib.AbstractContextManager:
    """The idle server an in-process system runs beside (`System.beside`), or nothing."""
    if system.beside is None:
        return contextlib.nullcontext()
    return serving(SYSTEMS[system.beside], model_dir, dtype, vllm_python, log_path, warmup_tokens)


def measure_server(
    system: System,
    model_dir: Path,
    levels: list[int],
    requests_per_level: dict[int, int],
    max_tokens: int,
    dtype: str,
    vllm_python: str,
    log_dir: Path,
    round_index: int,
) -> list[LevelResult]:
    log_path = log_dir / f"{system.name}-round{round_index}.log"
    prompts = bench_prompts()
    with serving(system, model_dir, dtype, vllm_python, log_path, max_tokens) as (proc, base):
        results = []
        for users in levels:
            with measure_cpu(proc.pid) as cpu:
                result = run_level(base, MODEL_NAME, prompts, users, requests_per_level[users], max_tokens)
            result.cpu_ms_per_token = cpu.ms_per_token(result.output_tokens)
            results.append(result)
        return results


def measure_inprocess(
    system: System, levels: list[int], requests_per_level: dict[int, int], max_tokens: int, dtype: str
) -> list[LevelResult]:
    """The same prompts and lengths on the engine alone, in a fresh process: no HTTP, no Ray."""
    return in_fresh_process(measure_in_this_process, system, levels, requests_per_level, max_tokens, dtype)


def measure_in_this_process(
    system: System, levels: list[int], requests_per_level: dict[int, int], max_tokens: int, dtype: str
) -> list[LevelResult]:
    """`measure_inprocess` in the calling process."""
    import torch

    from dspark.builder import engine_from_config
    from dspark.engine.config import EngineConfig

    drafter, policy, *threads = system.args
    default_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads[0]))
    try:
        engine = engine_from_config(EngineConfig(drafter=drafter, policy=policy, dtype=dtype))
        return _closed_loops(engine, levels, requests_per_level, max_tokens)
    finally:
        torch.set_num_threads(default_threads)  # the caller's count, not the system's, afterwards


def _closed_loops(
    engine, levels: list[int], requests_per_level: dict[int, int], max_tokens: int
) -> list[LevelResult]:
    """A warm-up loop of 2 users, then one closed loop per level."""
    from dspark.bench.serve import ClosedLoop
    from dspark.engine.prompt import encode_prompt
    from dspark.engine.sampling_params import SamplingParams

    prompts = [encode_prompt(engine.tokenizer, p) for p in bench_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results = []
    for users in [2, *levels]:  # the first loop warms up, as the servers' warm-up request does
        loop = ClosedLoop(engine, prompts, users, requests_per_level.get(users, 2), params, f"u{users}-")
        cpu_before = process_cpu_seconds()
        while not loop.done:
            loop.advance()
        cpu_seconds = process_cpu_seconds() - cpu_before
        p = loop.point()
        results.append(
            LevelResult(
                users=users,
                requests=p.requests,
                output_tokens=p.output_tokens,
                seconds=round(p.seconds, 3),
                aggregate_tokens_per_s=round(p.aggregate_tokens_per_s, 2),
                per_user_p50=round(p.per_user_p50, 2),
                ttft_p50_s=round(p.ttft_p50_s, 4),
                cpu_ms_per_token={"engine": round(cpu_seconds * 1e3 / max(p.output_tokens, 1), 3)},
            )
        )
    return results[1:]


def run_peer_bench(
    systems: list[str],
    model_dir: Path,
    levels: list[int],
    requests_per_level: dict[int, int],
    max_tokens: int,
    rounds: int,
    dtype: str,
    vllm_python: str,
    log_dir: Path,
    progress=print,
    save=None,
) -> PeerRun:
    """Every system in every round; a system that fails in a round is reported and left out of that
    round only, and `save(run)` keeps what was measured after each system."""
    run = PeerRun(levels)
    for r in range(1, rounds + 1):
        for name in systems:
            system = SYSTEMS[name]
            progress(f"round {r}/{rounds}: {name}")
            started = time.perf_counter()
            try:
                if system.kind == "inprocess":
                    log_path = log_dir / f"{name}-round{r}.log"
                    with idle_server_beside(system, model_dir, dtype, vllm_python, log_path, max_tokens):
                        results = measure_inprocess(system, levels, requests_per_level, max_tokens, dtype)
                else:
                    results = measure_server(
                        system,
                        model_dir,
                        levels,
                        requests_per_level,
                        max_tokens,
                        dtype,
                        vllm_python,
                        log_dir,
                        r,
                    )
            except (RuntimeError, TimeoutError, OSError) as e:
                progress(f"  failed, left out of round {r}: {e} (log: {log_dir}/{name}-round{r}.log)")
                continue
            for result in results:
                run.add(name, result)
            summary = ", ".join(f"{x.users}u {x.aggregate_tokens_per_s:.1f} tok/s" for x in results)
            progress(f"  {summary} ({time.perf_counter() - started:.0f} s)")
            if save is not None:
                save(run)
    return run


def format_table(run: PeerRun, baseline: str = "vllm") -> str:
    """Aggregate tokens/s (median of rounds) per system and level, and the ratio to `baseline`."""
    head = "| system | " + " | ".join(f"{u} users tok/s (x {baseline})" for u in run.levels) + " |"
    lines = [head, "|---" * (len(run.levels) + 1) + "|"]
    for system in run.points:
        cells = []
        for u in run.levels:
            if u not in run.points[system]:
                cells.append("-")
                continue
            value = run.median(system, u, "aggregate_tokens_per_s")
            ratio = ""
            if u in run.points.get(baseline, {}) and system != baseline:
                ratio = f" ({value / run.median(baseline, u, 'aggregate_tokens_per_s'):.2f}x)"
            spread = _round_spread(run, system, u)
            cells.append(f"{value:.1f}{ratio}{spread}")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _round_spread(run: PeerRun, system: str, users: int) -> str:
    """The twins' spread: how far the rounds of one system differ (the noise floor)."""
    values = [r.aggregate_tokens_per_s for r in run.points[system][users]]
    if len(values) < 2:
        return ""
    return f" ±{(max(values) - min(values)) / statistics.median(values) * 50:.0f}%"


def format_cpu_table(run: PeerRun) -> str:
    """CPU milliseconds per output token by role (median of rounds), and the cores kept busy: a
    served system below its in-process twin either saturates one role or waits between them."""
    roles = [
        r
        for r in ROLES
        if any(
            x.cpu_ms_per_token.get(r, 0.0) > 0 for by in run.points.values() for rs in by.values() for x in rs
        )
    ]
    lines = [
        "| system | users | " + " | ".join(roles) + " | total ms/token | cores busy |",
        "|---" * (len(roles) + 4) + "|",
    ]
    for system, by_level in run.points.items():
        for users in run.levels:
            rounds = [r for r in by_level.get(users, []) if r.cpu_ms_per_token]
            if not rounds:
                continue
            cells = [statistics.median(r.cpu_ms_per_token.get(role, 0.0) for r in rounds) for role in roles]
            busy = statistics.median(
                sum(r.cpu_ms_per_token.values()) * r.aggregate_tokens_per_s / 1e3 for r in rounds
            )
            row = " | ".join(f"{c:.2f}" for c in cells)
            lines.append(f"| {system} | {users} | {row} | {sum(cells):.2f} | {busy:.2f} |")
    return "\n".join(lines)


def plot_frontier(run: PeerRun, path: Path) -> None:
    """Aggregate against per-user tokens/s, one line per system (medians of rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, by_level in run.points.items():
        levels = [u for u in run.levels if u in by_level]
        xs = [run.median(system, u, "per_user_p50") for u in levels]
        ys = [run.median(system, u, "aggregate_tokens_per_s") for u in levels]
        style = "--" if system.startswith("vllm") else "-"
        ax.plot(xs, ys, style, marker="o", label=system)
        for u, x, y in zip(levels, xs, ys, strict=True):
            ax.annotate(str(u), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user tokens/s (median request)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Served throughput frontier (labels: concurrent users)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
