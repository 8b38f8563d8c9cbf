"""What the engine hands back to callers: per-request deltas and per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One request's progress in one engine step (a delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    stats: RequestStats | None = None  # on the finishing output: the request's speculation figures
    retry: bool = False  # with an error: the server failed, not the request; the caller may retry

    @classmethod
    def failed(cls, request_id: str, reason: str, retry: bool = False) -> RequestOutput:
        """The last output of a request the server could not finish; `retry` where the server, not
        the request, failed (engine failure, shutdown)."""
        return cls(request_id, [], "", finished=True, finish_reason="error", error=reason, retry=retry)


@dataclass
class RequestStats:
    """Speculation statistics of one request, final when it finishes."""

    rounds: int = 0  # verification rounds (decode steps)
    draft_tokens: int = 0  # draft tokens sent to verification
    drafts: int = 0  # rounds that verified at least one draft token
    accepted_tokens: int = 0  # draft tokens accepted
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def tau(self) -> float:
        """Accepted length per round, bonus token included."""
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0


@dataclass
class StepStats:
    """What one engine step did: the serving layer turns these into metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_prefill_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of the requests admitted this step
    prefix_cache_hits: int = 0  # of those, tokens reused from the prefix cache
    verify_batch_tokens: int = 0  # B: total tokens in the verification forward
    num_drafts: int = 0  # requests that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verify_budgets: list[int] = field(default_factory=list)  # l_r per decoding request
    predicted_accepted_tokens: float | None = None  # sum of survival a_{r,j} over verified positions
    predicted_per_position: list[float] = field(default_factory=list)  # the same per position j
    policy_fallback: bool = False  # unusable confidences: the policy fell back to a fixed length
    drafted: bool = False  # the drafter ran this step
    draft_horizon: int = 0  # positions drafted per request
    draft_time_s: float = 0.0
    schedule_time_s: float = 0.0
    forward_time_s: float = 0.0
    step_time_s: float = 0.0
    forward_cpu_s: float = 0.0  # the process's CPU seconds during the forward (every thread's)
    intra_op_threads: int = 0  # torch's intra-op threads during the forward
    # What the forward should have taken, from a start-up measurement, and which one: "thread_plan"
    # (the one-request timing) or "profile" (the SPS profile); None where neither applies.
    predicted_forward_s: float | None = None
    prediction_source: str = ""
