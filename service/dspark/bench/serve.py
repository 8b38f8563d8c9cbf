"""`dspark bench serve`: closed-loop load against the engine in-process, one curve per policy."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from dspark.bench.oracle import ORACLE, OracleEngine
from dspark.builder import sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.policy_spec import PROFILED_POLICIES, PolicyName
from dspark.engine.request import Request
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy


@dataclass
class LoadPoint:
    """One (policy, concurrency) run."""

    policy: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    aggregate_tokens_per_s: float
    per_user_p50: float
    per_user_p10: float
    ttft_p50_s: float
    ttft_p90_s: float
    mean_verify_budget: float  # l_r averaged over decoding requests and steps
    mean_tau: float
    scheduler_share: float  # scheduler time / step time
    drafted_share: float  # share of decode steps that ran the drafter
    extra: dict = field(default_factory=dict)


def output_lengths(max_tokens: int, spread: float, count: int = 64, seed: int = 0) -> list[int]:
    """`count` output lengths evenly spaced over max_tokens x [1 - spread, 1 + spread] (mean
    max_tokens), in a fixed shuffled order; request i of every loop gets lengths[i % count].

    Equal lengths make a closed loop march in waves: a wave's requests finish on one step and
    their successors prefill together on the next, with no decode beside them. A policy that
    drafts breaks the waves up and pays for prefill chunks beside running decodes, which plain
    decoding is spared only on this artificial load; real traffic has a spread of lengths.
    """
    if not 0 <= spread < 1:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    low, high = max_tokens * (1 - spread), max_tokens * (1 + spread)
    lengths = [max(1, round(low + (high - low) * i / max(count - 1, 1))) for i in range(count)]
    random.Random(seed).shuffle(lengths)
    return lengths


TWIN = "#"  # `none#2`: policy `none` again, in an engine of its own (an A/A twin)


def base_spec(spec: str) -> str:
    """The policy a spec runs: `none#2` runs `none`."""
    return spec.split(TWIN, 1)[0]


class ClosedLoop:
    """One policy's closed loop: keeps `concurrency` requests in flight on its engine until
    `requests` have finished, on its own clock (the seconds spent in its own iterations), so
    loops of several policies can be stepped in turn on one machine. Request i asks for
    `lengths[i % len(lengths)]` tokens when `lengths` is given, else `params.max_tokens`.
    Its point is labelled `label` (default: the policy's name)."""

    def __init__(
        self,
        engine: LLMEngine,
        prompts: list[list[int]],
        concurrency: int,
        requests: int,
        params: SamplingParams,
        id_prefix: str = "",
        lengths: Sequence[int] | None = None,
        label: str | None = None,
    ) -> None:
        self.engine, self.prompts, self.params = engine, prompts, params
        self.label = label or engine.policy.name
        self.lengths = list(lengths) if lengths else None
        self.concurrency, self.requests, self.id_prefix = concurrency, requests, id_prefix
        self.clock = 0.0
        self.issued = 0
        self._started = False
        self._tracked: dict[str, Request] = {}
        self._arrival: dict[str, float] = {}
        self._first: dict[str, float] = {}
        self._finished: list[tuple[Request, float]] = []  # (request, finish time)
        self._budgets: list[int] = []
        self._sched = self._steps = 0.0
        self._decode_steps = self._drafted_steps = 0

    @property
    def done(self) -> bool:
        return self._started and not self.engine.has_unfinished_requests()

    def _issue(self, now: float) -> None:
        # Ids unique across loops: the loops of one level share the drafter and its context store.
        rid = f"{self.id_prefix}req-{self.issued}"
        params = self.params
        if self.lengths:
            params = params.model_copy(update={"max_tokens": self.lengths[self.issued % len(self.lengths)]})
        self.engine.add_request(self.prompts[self.issued % len(self.prompts)], params, request_id=rid)
        self._tracked[rid] = self.engine.requests[rid]  # the engine forgets a request as it finishes
        self._arrival[rid] = now
        self.issued += 1

    def advance(self) -> None:
        """Issue the first requests or run one engine step, and charge its time to this loop."""
        started = time.perf_counter()
        if not self._started:
            self._started = True
            for _ in range(min(self.concurrency, self.requests)):
                self._issue(self.clock)
            self.clock += time.perf_counter() - started
            return
        engine = self.engine
        untimed = getattr(engine, "untimed_s", 0.0)  # the oracle's probing forwards
        outputs = engine.step()
        untimed = getattr(engine, "untimed_s", 0.0) - untimed
        started += untimed
        now = self.clock + time.perf_counter() - started
        stats = engine.last_step_stats
        self._budgets.extend(stats.verify_budgets)
        self._decode_steps += bool(stats.verify_budgets)
        self._drafted_steps += stats.drafted
        self._sched += stats.schedule_time_s
        self._steps += stats.step_time_s - untimed
        for out in outputs:
            if out.new_token_ids:
                self._first.setdefault(out.request_id, now)
            if out.finished:
                self._finished.append((self._tracked.pop(out.request_id), now))
                if self.issued < self.requests:
                    self._issue(now)
        self.clock += time.perf_counter() - started

    def point(self) -> LoadPoint:
        per_user, ttft, taus, tokens = [], [], [], 0
        for r, finish in self._finished:
            n = len(r.output_token_ids)
            tokens += n
            first = self._first[r.request_id]
            ttft.append(first - self._arrival[r.request_id])
            if n > 1 and finish > first:
                per_user.append((n - 1) / (finish - first))
            if r.stats.rounds:
                taus.append(r.stats.tau)
        return LoadPoint(
            policy=self.label,
            concurrency=self.concurrency,
            requests=len(self._finished),
            output_tokens=tokens,
            seconds=self.clock,
            aggregate_tokens_per_s=tokens / self.clock,
            per_user_p50=statistics.median(per_user) if per_user else 0.0,
            per_user_p10=_quantile(per_user, 0.1),
            ttft_p50_s=statistics.median(ttft),
            ttft_p90_s=_quantile(ttft, 0.9),
            mean_verify_budget=statistics.fmean(self._budgets) if self._budgets else 0.0,
            mean_tau=statistics.fmean(taus) if taus else 0.0,
            scheduler_share=self._sched / self._steps if self._steps else 0.0,
            drafted_share=self._drafted_steps / self._decode_steps if self._decode_steps else 0.0,
        )


def run_closed_loop(
    engine: LLMEngine,
    prompts: list[list[int]],
    concurrency: int,
    requests: int,
    params: SamplingParams,
    lengths: Sequence[int] | None = None,
) -> LoadPoint:
    """Keep `concurrency` requests in flight until `requests` have finished."""
    return run_lockstep([ClosedLoop(engine, prompts, concurrency, requests, params, lengths=lengths)])[0]


def run_lockstep(loops: list[ClosedLoop]) -> list[LoadPoint]:
    """Step every unfinished loop once per turn, in an order rotating by one each turn, until all
    are done. A shared machine's speed changes (seconds to minutes) then fall on every loop alike;
    run one after another, the same policy differed by up to 25% between runs here."""
    turn = 0
    while not all(loop.done for loop in loops):
        for i in range(len(loops)):
            loop = loops[(turn + i) % len(loops)]
            if not loop.done:
                loop.advance()
        turn += 1
    return [loop.point() for loop in loops]


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))]


def policy_engine(base: LLMEngine, spec: str, policy, concurrency: int) -> LLMEngine:
    """The engine a policy runs on: plain decoding (`none`) without a drafter, so the baseline does
    not pay for keeping a drafter's context it never drafts from; the others each get their own
    copy of `base`'s drafter (same weights): with one shared, a policy drafting every step would
    compute the context that another, skipping, had queued, and be charged its time."""
    if spec == ORACLE:
        return OracleEngine.of(base, max_num_seqs=concurrency)
    drafter = NoDrafter() if spec == "none" else base.drafter.fresh_copy()
    return sibling_engine(base, drafter, policy, max_num_seqs=concurrency)


def run_serve_bench(
    base: LLMEngine,
    policies: list[str],
    concurrencies: list[int],
    prompts: list[list[int]],
    params: SamplingParams,
    requests_per_level: int,
    sps=None,
    progress=None,
    rounds: int = 1,
    lengths: Sequence[int] | None = None,
) -> list[LoadPoint]:
    """Every policy at every concurrency on the same prompts, output lengths (`output_lengths`;
    None: all `params.max_tokens`), drafter and weights.

    A level runs one closed loop per policy, all stepped in lockstep (`run_lockstep`), `rounds`
    times, each round finishing max(requests_per_level / rounds, 2 x concurrency) requests per
    policy, and reports a policy over all its rounds. A policy object lives through its level's
    rounds (what it learned carries over, as in serving), after an unmeasured warm-up of one
    wave of `concurrency` requests: the steady state of a running server, not a cold start.
    The `oracle` policy (greedy only, `dspark.bench.oracle`) is a bound to read the others against.
    A twin spec (`none#2`) runs its policy again in an engine of its own: identical loops differ
    only by chance, so their ratio is the level's noise floor.
    """
    points = []
    for c in concurrencies:
        verify = {
            spec: build_policy(base_spec(spec), sps=sps) for spec in policies if base_spec(spec) != ORACLE
        }
        runs: dict[str, list[LoadPoint]] = {spec: [] for spec in policies}
        per_run = max(math.ceil(requests_per_level / rounds), 2 * c)
        for r in range(rounds):
            loops = []
            for i, spec in enumerate(policies):
                engine = policy_engine(base, base_spec(spec), verify.get(spec), c)
                if r == 0:  # unmeasured: the policy learns its costs and confidences at this load
                    run_closed_loop(engine, prompts, c, c, params, lengths)
                loops.append(
                    ClosedLoop(
                        engine,
                        prompts,
                        c,
                        per_run,
                        params,
                        id_prefix=f"r{r}p{i}-",
                        lengths=lengths,
                        label=spec,
                    )
                )
            for spec, point in zip(policies, run_lockstep(loops), strict=True):
                runs[spec].append(point)
        for spec in policies:
            points.append(merge_rounds(runs[spec]))
            if progress:
                progress(points[-1])
    return points


def merge_rounds(runs: list[LoadPoint]) -> LoadPoint:
    """One point from a policy's rounds at one level: throughput over all of them (tokens / time),
    medians of the per-round latency figures, means of the per-round averages."""
    if len(runs) == 1:
        return runs[0]
    tokens, seconds = sum(p.output_tokens for p in runs), sum(p.seconds for p in runs)

    def median(field: str) -> float:
        return statistics.median(getattr(p, field) for p in runs)

    def mean(field: str) -> float:
        return statistics.fmean(getattr(p, field) for p in runs)

    return LoadPoint(
        policy=runs[0].policy,
        concurrency=runs[0].concurrency,
        requests=sum(p.requests for p in runs),
        output_tokens=tokens,
        seconds=seconds,
        aggregate_tokens_per_s=tokens / seconds,
        per_user_p50=median("per_user_p50"),
        per_user_p10=median("per_user_p10"),
        ttft_p50_s=median("ttft_p50_s"),
        ttft_p90_s=median("ttft_p90_s"),
        mean_verify_budget=mean("mean_verify_budget"),
        mean_tau=mean("mean_tau"),
        scheduler_share=mean("scheduler_share"),
        drafted_share=mean("drafted_share"),
        extra={"round_tokens_per_s": [p.aggregate_tokens_per_s for p in runs]},
    )


def summarize(points: list[LoadPoint], baseline: str = "static:1") -> dict:
    """Acceptance figures: DSpark vs the best fixed policy per level, and vs gamma = 1 where it
    halves; each twin (`none#2`) vs its policy, the level's noise floor."""
    by_level: dict[int, dict[str, LoadPoint]] = {}
    for p in points:
        by_level.setdefault(p.concurrency, {})[p.policy] = p
    names = {p.policy for p in points}
    fixed = [n for n in names if n.startswith(PolicyName.STATIC) or n in (PolicyName.FULL, PolicyName.NONE)]
    twins = sorted(n for n in names if TWIN in n)
    rows = []
    for c, level in sorted(by_level.items()):
        best_fixed = max(
            (level[n] for n in fixed if n in level), key=lambda p: p.aggregate_tokens_per_s, default=None
        )
        row = {"concurrency": c, "best_fixed": best_fixed.policy if best_fixed else None}
        for name in (*PROFILED_POLICIES, ORACLE):
            if name in level and best_fixed:
                row[f"{name}_vs_best_fixed"] = (
                    level[name].aggregate_tokens_per_s / best_fixed.aggregate_tokens_per_s
                )
            if name in level and baseline in level:
                row[f"{name}_vs_{baseline}"] = (
                    level[name].aggregate_tokens_per_s / level[baseline].aggregate_tokens_per_s
                )
        for twin in twins:
            if twin in level and base_spec(twin) in level:
                row[f"{twin}_vs_{base_spec(twin)}"] = (
                    level[twin].aggregate_tokens_per_s / level[base_spec(twin)].aggregate_tokens_per_s
                )
        rows.append(row)
    half = None
    base_points = sorted((p for p in points if p.policy == baseline), key=lambda p: p.concurrency)
    if base_points:
        single = base_points[0].per_user_p50
        half = next((p.concurrency for p in base_points if p.per_user_p50 <= single / 2), None)
    return {"per_level": rows, f"{baseline}_half_speed_concurrency": half}


def plot_serve_bench(points: list[LoadPoint], frontier_png, budget_png) -> None:
    from dspark.profiling.plots import plot_lines

    policies = list(dict.fromkeys(p.policy for p in points))
    curves = {n: sorted((p for p in points if p.policy == n), key=lambda p: p.concurrency) for n in policies}
    plot_lines(
        {
            n: ([p.per_user_p50 for p in ps], [p.aggregate_tokens_per_s for p in ps])
            for n, ps in curves.items()
        },
        frontier_png,
        "per-user tokens/s (p50)",
        "aggregate output tokens/s",
        "Throughput vs interactivity frontier (points: concurrency 1 ... max)",
    )
    plot_lines(
        {n: ([p.concurrency for p in ps], [p.mean_verify_budget for p in ps]) for n, ps in curves.items()},
        budget_png,
        "concurrent requests",
        "mean verify budget per request (draft tokens)",
        "Verify budget vs load",
    )


def as_json(points: list[LoadPoint]) -> list[dict]:
    return [asdict(p) for p in points]
