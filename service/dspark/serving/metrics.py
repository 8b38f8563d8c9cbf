"""Prometheus metrics, named as vLLM's so its dashboards work, plus DSpark's own (`dspark_`)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from dspark.engine.outputs import StepStats
from dspark.serving.step_pace import SLOW_FACTOR, SOURCES, StepPace

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)
_TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
_BUDGET_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_SCHED_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)

# Names other components (the Grafana dashboard, the operator's autoscaler) rely on: keep them stable.
METRIC_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "dspark_request_tokens_per_second",
    "dspark_verify_budget",
    "dspark_verify_batch_tokens",
    "dspark_sps_estimate",
    "dspark_scheduler_seconds",
    "dspark_confidence_calibration_error",
    "dspark_policy_fallbacks_total",
    "dspark_undrafted_steps_total",
    "dspark_step_slowdown",
    "dspark_slow_steps_total",
    "dspark_intra_op_parallelism",
    "dspark_openmp_team_collapsed",
)


class _MetricFactory:
    """Metrics labelled by model name, in one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry, self.labels = registry, ["model_name"]

    def counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, [*self.labels, *extra], registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, self.labels, buckets=buckets, registry=self.registry)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self.labels, registry=self.registry, multiprocess_mode="mostrecent")


class ServingMetrics:
    """One replica's metrics in its own registry (`render()` gives the exposition text).

    Engine-step metrics are fed from the engine thread, request metrics from the event loop;
    prometheus_client's metric objects are thread-safe, the running estimates here hold a lock.
    """

    def __init__(self, model_name: str, calibration_window: int = 2048, sps_smoothing: float = 0.1):
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. of the replica
        self._model = model_name
        self._add_vllm_metrics(_MetricFactory(self.registry))
        self._add_dspark_metrics(_MetricFactory(self.registry))
        self._add_pace_metrics(_MetricFactory(self.registry))
        self._start_series()
        self._lock = threading.Lock()
        self._sps_ema: float | None = None
        self._sps_alpha = sps_smoothing
        self._calib: deque[tuple[int, int, float]] = deque()  # (draft, accepted, predicted) per step
        self._calib_window = calibration_window
        self._calib_sums = [0, 0, 0.0]

    def _add_vllm_metrics(self, new: _MetricFactory) -> None:
        self.num_running = new.gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = new.gauge("vllm:num_requests_waiting", "Requests waiting for a slot.")
        self.ttft = new.histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = new.histogram(
            "vllm:inter_token_latency_seconds", "Gap between generated tokens.", _LATENCY_BUCKETS
        )
        self.e2e = new.histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E_BUCKETS
        )
        self.prompt_tokens = new.counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = new.counter("vllm:generation_tokens", "Generated tokens.")
        self.prefix_queries = new.counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = new.counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_drafts = new.counter("vllm:spec_decode_num_drafts", "Verification rounds with a draft.")
        self.draft_tokens = new.counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = new.counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = new.counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position.",
            ("position",),
        )

    def _add_dspark_metrics(self, new: _MetricFactory) -> None:
        self.tokens_per_s = new.histogram(
            "dspark_request_tokens_per_second", "Per-request decode speed.", _TOKENS_PER_S_BUCKETS
        )
        self.verify_budget = new.histogram(
            "dspark_verify_budget", "Draft tokens verified per request per step.", _BUDGET_BUCKETS
        )
        self.verify_batch = new.histogram(
            "dspark_verify_batch_tokens", "Tokens in one verification forward.", _BATCH_BUCKETS
        )
        self.sps = new.gauge("dspark_sps_estimate", "Verification steps per second (smoothed, measured).")
        self.scheduler_s = new.histogram(
            "dspark_scheduler_seconds", "Verify-length scheduling time per step.", _SCHED_BUCKETS
        )
        self.calibration_error = new.gauge(
            "dspark_confidence_calibration_error",
            "|observed - predicted| accepted draft tokens / draft tokens over a recent window.",
        )
        self.policy_fallbacks = new.counter(
            "dspark_policy_fallbacks",
            "Steps scheduled by the safe fixed policy because confidences were unusable.",
        )
        self.undrafted_steps = new.counter(
            "dspark_undrafted_steps",
            "Decode steps that ran no drafter (policy none, or the drafting gate found them faster without).",
        )

    def _add_pace_metrics(self, new: _MetricFactory) -> None:
        self.step_slowdown = new.gauge(
            "dspark_step_slowdown",
            "Median step time (less drafting) / the forward time start-up measurements predict, "
            "recent steps.",
        )
        self.slow_steps = new.counter(
            "dspark_slow_steps",
            f"Steps that took {SLOW_FACTOR:g}x their predicted forward time or more, by the prediction's "
            "source (thread_plan: the one-request start-up timing; profile: the SPS profile).",
            ("source",),
        )
        self.parallelism = new.gauge(
            "dspark_intra_op_parallelism",
            "Process CPU seconds per second of recent forwards on several intra-op threads.",
        )
        self.team_collapsed = new.gauge(
            "dspark_openmp_team_collapsed",
            "1 while recent steps run much slower than predicted on a team of threads that runs as one.",
        )
        self.pace = StepPace()

    def _start_series(self) -> None:
        """Create every series up front so dashboards and scrapers see zeros rather than gaps."""
        for metric in (
            self.ttft,
            self.itl,
            self.e2e,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.num_drafts,
            self.draft_tokens,
            self.accepted_tokens,
            self.tokens_per_s,
            self.verify_budget,
            self.verify_batch,
            self.scheduler_s,
            self.policy_fallbacks,
            self.undrafted_steps,
        ):
            metric.labels(self._model)
        for m in (self.num_running, self.num_waiting):
            m.labels(self._model).set(0)
        self.sps.labels(self._model).set(math.nan)
        for source in SOURCES:
            self.slow_steps.labels(self._model, source)
        for m in (self.step_slowdown, self.parallelism):
            m.labels(self._model).set(math.nan)
        self.team_collapsed.labels(self._model).set(0)
        self.calibration_error.labels(self._model).set(math.nan)

    def watch_engine_process(self, pid: Callable[[], int]) -> None:
        """Export the figures of the engine process `pid()` (the current one, after a restart) as
        `dspark_engine_process_*`: with the engine in a process of its own, the replica's
        `process_*` hold neither the model nor the KV cache."""
        ProcessCollector(namespace="dspark_engine", pid=pid, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # Engine thread -------------------------------------------------------------------------------
    def set_queue_sizes(self, running: int, waiting: int) -> None:
        self.num_running.labels(self._model).set(running)
        self.num_waiting.labels(self._model).set(waiting)

    def observe_step(self, s: StepStats) -> None:
        m = self._model
        self.set_queue_sizes(s.num_running, s.num_waiting)
        if s.num_prefill_tokens:
            self.prompt_tokens.labels(m).inc(s.num_prefill_tokens)
        if s.prefix_cache_queries:
            self.prefix_queries.labels(m).inc(s.prefix_cache_queries)
            self.prefix_hits.labels(m).inc(s.prefix_cache_hits)
        self._observe_speculation(s)
        if s.verify_batch_tokens:
            self.verify_batch.labels(m).observe(s.verify_batch_tokens)
            if s.forward_time_s > 0:
                self._update_sps(1.0 / s.forward_time_s)
        predicted = s.predicted_accepted_tokens
        if predicted is not None and math.isfinite(predicted) and s.num_draft_tokens:
            self._update_calibration(s.num_draft_tokens, s.num_accepted_tokens, float(predicted))
        self._observe_pace(s)

    def _observe_speculation(self, s: StepStats) -> None:
        """Drafts, acceptance per position, verify lengths and how the policy chose them."""
        m = self._model
        if s.num_drafts:
            self.num_drafts.labels(m).inc(s.num_drafts)
        if s.num_draft_tokens:
            self.draft_tokens.labels(m).inc(s.num_draft_tokens)
        if s.num_accepted_tokens:
            self.accepted_tokens.labels(m).inc(s.num_accepted_tokens)
        for pos, n in enumerate(s.accepted_per_position):
            if n:
                self.accepted_per_pos.labels(m, str(pos)).inc(n)
        for budget in s.verify_budgets:
            self.verify_budget.labels(m).observe(budget)
        if s.verify_budgets or s.schedule_time_s:
            self.scheduler_s.labels(m).observe(s.schedule_time_s)
        if s.policy_fallback:
            self.policy_fallbacks.labels(m).inc()
        if s.verify_budgets and not s.drafted:
            self.undrafted_steps.labels(m).inc()

    def _observe_pace(self, s: StepStats) -> None:
        with self._lock:
            pace = self.pace.observe(s)
        if pace is None:
            return
        m = self._model
        if pace.step_slow:
            self.slow_steps.labels(m, s.prediction_source).inc()
        self.step_slowdown.labels(m).set(pace.slowdown)
        self.parallelism.labels(m).set(pace.parallelism)
        self.team_collapsed.labels(m).set(1 if pace.collapsed else 0)

    def _update_sps(self, sps: float) -> None:
        with self._lock:
            a = self._sps_alpha
            self._sps_ema = sps if self._sps_ema is None else (1 - a) * self._sps_ema + a * sps
            self.sps.labels(self._model).set(self._sps_ema)

    def _update_calibration(self, draft: int, accepted: int, predicted: float) -> None:
        with self._lock:
            self._calib.append((draft, accepted, predicted))
            sums = self._calib_sums
            sums[0] += draft
            sums[1] += accepted
            sums[2] += predicted
            while len(self._calib) > 1 and sums[0] - self._calib[0][0] >= self._calib_window:
                d, acc, p = self._calib.popleft()
                sums[0] -= d
                sums[1] -= acc
                sums[2] -= p
            self.calibration_error.labels(self._model).set(abs(sums[1] - sums[2]) / sums[0])

    # Event loop ----------------------------------------------------------------------------------
    def observe_first_token(self, seconds: float, num_tokens: int) -> None:
        self.ttft.labels(self._model).observe(seconds)
        self.generation_tokens.labels(self._model).inc(num_tokens)

    def observe_tokens(self, gap_s: float, num_tokens: int) -> None:
        """`num_tokens` arrived together `gap_s` after the previous ones: each gets gap / n."""
        per = gap_s / num_tokens
        for _ in range(num_tokens):
            self.itl.labels(self._model).observe(per)
        self.generation_tokens.labels(self._model).inc(num_tokens)

    def observe_finished(self, e2e_s: float, num_output_tokens: int, decode_s: float) -> None:
        m = self._model
        self.e2e.labels(m).observe(e2e_s)
        if num_output_tokens > 1 and decode_s > 0:
            self.tokens_per_s.labels(m).observe((num_output_tokens - 1) / decode_s)
