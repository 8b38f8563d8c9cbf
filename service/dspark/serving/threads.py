"""How many intra-op threads the engine's steps use, by the number of requests in the batch, and
the setting that pins them to cores."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field, replace

import torch

log = logging.getLogger(__name__)

GOMP_CPU_AFFINITY = "GOMP_CPU_AFFINITY"
# Settings by which a user places OpenMP's threads; any of them set, the engine is not pinned.
# (An empty GOMP_CPU_AFFINITY is not "unset" to libgomp: it ran a 2-core engine 6x slower.)
OPENMP_PLACEMENT = (GOMP_CPU_AFFINITY, "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY")
# How much faster fewer threads must run a lone request's forward at start-up to be chosen.
CLEAR_MARGIN = 0.10


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
    and `batch`, timed on the engine (`timed`); `timed_s` then holds the median one-request decode
    forward (seconds) by thread count, what a served step of one request is held against.
    """

    single: int
    batch: int
    time_single: bool = False
    timed_s: tuple[tuple[int, float], ...] = field(default=(), compare=False)

    def threads(self, num_requests: int) -> int:
        return self.single if num_requests <= 1 else self.batch

    def apply(self, num_requests: int) -> None:
        """Set torch's intra-op threads for a step of `num_requests` (a no-op when unchanged)."""
        threads = self.threads(num_requests)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def fastest_single(self, samples: dict[int, list[float]]) -> ThreadPlan:
        """This plan with `single` set from one-request forward timings at `single` and `batch` threads.

        `single` stays below `batch` only where it is clearly faster: its median beats `batch`'s by
        `CLEAR_MARGIN` and by more than either count's spread. Otherwise every step takes `batch`
        threads: on a 2-core AVX2 EPYC five starts timed the two counts 2-6% apart, in either order,
        and the starts that chose one thread served a lone user 13-56% slower than the one that
        chose two.
        """
        medians = {n: statistics.median(t) for n, t in samples.items()}
        single, batch = medians.get(self.single), medians.get(self.batch)
        clearly_faster = (
            single is not None
            and batch is not None
            and single < batch * (1 - CLEAR_MARGIN)
            and batch - single > max(_spread(samples[self.single]), _spread(samples[self.batch]))
        )
        return replace(
            self,
            single=self.single if clearly_faster else self.batch,
            time_single=False,
            timed_s=tuple(sorted(medians.items())),
        )

    def timed(self, engine) -> ThreadPlan:
        """`fastest_single` of one-request decode forwards on `engine` at `single` and `batch`
        threads, timed at the first start on this model, dtype, CPU and forward and stored for the
        next (`acquire_thread_timings`). Whether a second thread pays for one row depends on the
        CPU: on an AMX Xeon two threads ran it 1.5x faster, on an AVX2 EPYC 0.88-1.02x."""
        if not self.time_single:
            return self
        # Here, not at the top: profiling imports torch's compiler (about 1.5 s), which the
        # replica and every reader of a ServeConfig would otherwise load for nothing.
        from dspark.profiling.thread_timings import acquire_thread_timings

        samples, stored = acquire_thread_timings(engine, sorted({self.single, self.batch}))
        plan = self.fastest_single(samples)
        log.info(
            "one request steps on %d intra-op threads (decode forward, median and spread: %s%s)",
            plan.single,
            ", ".join(
                f"{n} thread{'s' if n > 1 else ''} {statistics.median(t) * 1000:.1f} ms "
                f"+-{_spread(t) * 1000:.1f}"
                for n, t in sorted(samples.items())
            ),
            f"; timed at an earlier start, {stored}" if stored is not None else "",
        )
        return plan


def _spread(seconds: list[float]) -> float:
    """The interquartile range: how far timings of the same forward differ between runs."""
    if len(seconds) < 4:
        return 0.0
    low, _, high = statistics.quantiles(seconds, n=4)
    return high - low
