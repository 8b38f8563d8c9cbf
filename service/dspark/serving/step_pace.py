"""Steps that run much slower than the engine's start-up measurements predict, and OpenMP teams that
no longer run in parallel: told in the log (at most once a minute) and read by the metrics."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dspark.engine.outputs import StepStats

log = logging.getLogger(__name__)

# How many times its prediction a step may take before it counts as slow; a served forward runs
# over longer contexts than the start-up timings did (up to about 1.3x at 2k tokens on SmolLM2).
SLOW_FACTOR = 2.0
# Steps judged together: a single stalled step (a page fault, a preempted step) is no slowdown.
WINDOW = 16
# An intra-op team of several threads whose forwards kept fewer cores than this busy (process CPU
# seconds per second) does not run in parallel any more: its other threads are preempted or gone.
COLLAPSED_PARALLELISM = 1.2
LOG_INTERVAL_S = 60.0

SOURCES = {"thread_plan": "the thread plan's start-up timing", "profile": "the SPS profile"}


@dataclass(frozen=True)
class Pace:
    """The recent window's verdict."""

    step_slow: bool  # this step took SLOW_FACTOR times its prediction or more
    slowdown: float  # the window's median of step time (less drafting) / predicted forward time
    parallelism: float  # median CPU seconds per second of the multi-threaded forwards; NaN: none
    slow: bool  # a full window whose median is SLOW_FACTOR or more
    collapsed: bool  # slow, with a team of several threads that ran about as one


class StepPace:
    """Holds each step that carries a prediction (`StepPredictor`) against it.

    A step's time is its whole step less drafting, so that time lost outside the forward (the
    engine's Python, the scheduler) counts too; the window's median decides, so one stalled step
    does not.
    """

    def __init__(
        self,
        window: int = WINDOW,
        slow_factor: float = SLOW_FACTOR,
        log_interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slow_factor, self.log_interval_s, self._clock = slow_factor, log_interval_s, clock
        self._ratios: deque[float] = deque(maxlen=window)
        self._parallelism: deque[float] = deque(maxlen=window)
        self._steps: deque[tuple[float, float, str, int]] = deque(maxlen=window)
        self._last_warning: float | None = None

    def observe(self, stats: StepStats) -> Pace | None:
        """Judge one step; None when it carries no prediction."""
        predicted = stats.predicted_forward_s
        if predicted is None or not predicted > 0:
            return None
        measured = max(stats.step_time_s - stats.draft_time_s, stats.forward_time_s)
        ratio = measured / predicted
        self._ratios.append(ratio)
        self._steps.append((measured, predicted, stats.prediction_source, stats.intra_op_threads))
        if stats.intra_op_threads > 1 and stats.forward_time_s > 0:
            self._parallelism.append(stats.forward_cpu_s / stats.forward_time_s)
        slowdown = statistics.median(self._ratios)
        parallelism = statistics.median(self._parallelism) if self._parallelism else math.nan
        slow = len(self._ratios) == self._ratios.maxlen and slowdown >= self.slow_factor
        collapsed = slow and stats.intra_op_threads > 1 and parallelism < COLLAPSED_PARALLELISM
        pace = Pace(ratio >= self.slow_factor, slowdown, parallelism, slow, collapsed)
        if slow:
            self._warn(pace)
        return pace

    def _warn(self, pace: Pace) -> None:
        now = self._clock()
        if self._last_warning is not None and now - self._last_warning < self.log_interval_s:
            return
        self._last_warning = now
        measured, predicted, source, threads = self._steps[-1]
        what = f"{len(self._ratios)} steps ran {pace.slowdown:.1f}x slower than {SOURCES[source]} predicts"
        last = f"(the last: {measured * 1000:.1f} ms against {predicted * 1000:.1f} ms on {threads} threads)"
        if pace.collapsed:
            log.warning(
                "%s %s, and its %d intra-op threads kept %.1f cores busy: the OpenMP team has collapsed "
                "(another process on its cores, or too few cores for it)",
                what,
                last,
                threads,
                pace.parallelism,
            )
        else:
            log.warning("%s %s: the CPU is shared or throttled, or the plan is wrong here", what, last)
