"""How many intra-op threads the engine's steps use, by the number of requests in the batch, and
the setting that pins them to cores."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

log = logging.getLogger(__name__)

GOMP_CPU_AFFINITY = "GOMP_CPU_AFFINITY"
# Settings by which a user places OpenMP's threads; any of them set, the engine is not pinned.
# (An empty GOMP_CPU_AFFINITY is not "unset" to libgomp: it ran a 2-core engine 6x slower.)
OPENMP_PLACEMENT = (GOMP_CPU_AFFINITY, "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY")


def pinning_env(cpus: list[int] | None, environ: dict[str, str]) -> dict[str, str]:
    """The environment that pins a process's intra-op threads to `cpus`, one each; nothing when
    there are none or `environ` places OpenMP's threads itself.

    libgomp reads it when torch loads: thread i of the team (the loading thread is 0) goes to the
    i-th core listed.
    """
    if not cpus or any(environ.get(name) for name in OPENMP_PLACEMENT):
        return {}
    return {GOMP_CPU_AFFINITY: " ".join(map(str, cpus))}


@dataclass(frozen=True)
class ThreadPlan:
    """`single` threads for a step of one request, `batch` for a step of several.

    With `time_single`, `single` is a default to be replaced at start-up by the faster of itself
    and `batch`, timed on the engine (`timed`).
    """

    single: int
    batch: int
    time_single: bool = False

    def threads(self, num_requests: int) -> int:
        return self.single if num_requests <= 1 else self.batch

    def apply(self, num_requests: int) -> None:
        """Set torch's intra-op threads for a step of `num_requests` (a no-op when unchanged)."""
        threads = self.threads(num_requests)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def fastest_single(self, seconds: dict[int, float]) -> ThreadPlan:
        """This plan with `single` the thread count of the fastest one-request forward."""
        return replace(self, single=min(seconds, key=seconds.__getitem__), time_single=False)

    def timed(self, engine) -> ThreadPlan:
        """`fastest_single` of a one-request decode forward on `engine` at `single` and `batch`
        threads. Whether a second thread pays for one row depends on the CPU: on an AMX Xeon two
        threads ran it 1.5x faster, on an AVX2 EPYC 0.88x."""
        if not self.time_single:
            return self
        # Here, not at the top: the profiler imports torch's compiler (about 1.5 s), which the
        # replica and every reader of a ServeConfig would otherwise load for nothing.
        from dspark.profiling.profiler import decode_seconds_by_threads

        seconds = decode_seconds_by_threads(engine, sorted({self.single, self.batch}))
        plan = self.fastest_single(seconds)
        log.info(
            "one request steps on %d intra-op threads (decode forward: %s)",
            plan.single,
            ", ".join(
                f"{n} thread{'s' if n > 1 else ''} {s * 1000:.1f} ms" for n, s in sorted(seconds.items())
            ),
        )
        return plan
