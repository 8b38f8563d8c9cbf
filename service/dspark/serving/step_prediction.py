"""What a served step's forward should take, from what the engine measured at start-up: the thread
plan's one-request timing, or the SPS profile. `StepPace` (in the replica) holds steps against it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dspark.engine.outputs import StepStats
from dspark.serving.threads import ThreadPlan

if TYPE_CHECKING:
    from dspark.sps_format import SpsProfile

_UNSEEN = object()


class StepPredictor:
    """Sets `predicted_forward_s` and `prediction_source` of a step's stats (prompt steps have none).

    - "thread_plan": a step of one request and one token (a plain decode) on a thread count the plan
      timed at start-up: that count's median forward.
    - "profile": any other decode or verification step, from the SPS profile's forward rate at its
      batch tokens, while the engine runs the forward kind (eager or compiled) it was measured on
      and at the thread count it was measured with (the batch count). The profile as loaded, not
      `OnlineSps`'s refinement, which follows a slowdown and so would hide it.
    """

    def __init__(self, profile: SpsProfile | None, plan: ThreadPlan | None, runner: Any) -> None:
        self.profile = profile
        self.plan_s = dict(plan.timed_s) if plan is not None else {}
        self.profile_threads = plan.batch if plan is not None else None
        self._runner = runner
        self._forward: Any = _UNSEEN
        self._profile_applies = False
        self._rates: list[float] = []

    @classmethod
    def of(cls, engine: Any, plan: ThreadPlan | None) -> StepPredictor:
        sps = getattr(getattr(engine, "policy", None), "sps", None)
        profile = None
        if sps is not None:  # a profiled policy: its modules are loaded (an engine without one need not)
            from dspark.policies.sps_curve import OnlineSps
            from dspark.sps_format import SpsProfile

            profile = (
                sps.prior if isinstance(sps, OnlineSps) else sps if isinstance(sps, SpsProfile) else None
            )
        return cls(profile, plan, getattr(engine, "runner", None))

    def annotate(self, stats: StepStats) -> None:
        b = stats.verify_batch_tokens
        if stats.num_prefill_tokens or b < 1:
            return
        threads = stats.intra_op_threads
        if b == 1 and threads in self.plan_s:
            stats.predicted_forward_s, stats.prediction_source = self.plan_s[threads], "thread_plan"
        elif self._profile_applies_now() and self.profile_threads in (None, threads):
            stats.predicted_forward_s, stats.prediction_source = 1.0 / self._rate(b), "profile"

    def _profile_applies_now(self) -> bool:
        if self.profile is None:
            return False
        from dspark.models.compiled_forward import forward_kind  # loaded with the profiled engine

        forward = getattr(self._runner, "forward", None)
        if forward is not self._forward:  # the engine switched forwards (a background build)
            self._forward = forward
            self._profile_applies = self.profile.engine.get("forward", "eager") == forward_kind(forward)
        return self._profile_applies

    def _rate(self, batch_tokens: int) -> float:
        if len(self._rates) <= batch_tokens:  # a list: indexing a tensor per step costs 50 us
            self._rates = self.profile.table(batch_tokens).tolist()
        return self._rates[batch_tokens]
