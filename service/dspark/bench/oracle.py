"""The oracle of `dspark bench serve` (greedy only): a bound to read the verify policies against.

Every step it drafts the whole block, learns from an extra, unclocked verification forward how
many drafted tokens the target accepts, and then runs the step proper verifying exactly those.
A policy that drafts on a step can at best verify that same prefix, so the oracle bounds what any
scheduler reaches with this drafter on this machine on the steps where it drafts; its gap to
DSpark is what imperfect confidences cost, and plain decoding covers the steps a policy skips.
"""

from __future__ import annotations

import time

import torch

from dspark.engine.llm_engine import Draft, LLMEngine, draft_lists, verification_logits
from dspark.engine.request import Request
from dspark.engine.sampling_params import SamplingParams
from dspark.engine.scheduler import StepPlan
from dspark.engine.verifier import verify_greedy
from dspark.policies.static import StaticPolicy

ORACLE = "oracle"


class OraclePolicy(StaticPolicy):
    """The whole block for every request; `OracleEngine` then cuts each to its accepted prefix."""

    def __init__(self) -> None:
        super().__init__(None)
        self.name = ORACLE


class OracleEngine(LLMEngine):
    """An engine that verifies only what the target accepts. `untimed_s` counts the seconds of its
    probing forwards, which a benchmark's clock leaves out (`ClosedLoop` does)."""

    untimed_s: float = 0.0

    @classmethod
    def of(cls, engine: LLMEngine, **config_updates) -> OracleEngine:
        """A sibling of `engine` (same weights and drafter, own KV cache) under the oracle."""
        return engine.sibling(engine.drafter, OraclePolicy(), engine_type=cls, **config_updates)

    def add_request(self, prompt_token_ids, params: SamplingParams, *args, **kwargs) -> str:
        if not params.greedy:
            raise ValueError("the oracle policy needs greedy decoding (temperature 0)")
        return super().add_request(prompt_token_ids, params, *args, **kwargs)

    def _draft(self, decodes: list[Request], horizon: int) -> Draft:
        self._probe_s = 0.0  # `step` drafts on every step it records
        draft = super()._draft(decodes, horizon)
        if not decodes or max(draft.lengths) == 0:
            return draft
        started = time.perf_counter()
        lengths = self._accepted_prefix(decodes, draft)
        self._probe_s = time.perf_counter() - started
        self.untimed_s += self._probe_s
        return Draft(draft.block, lengths)

    def _accepted_prefix(self, decodes: list[Request], draft: Draft) -> list[int]:
        """Verify the whole drafts in a forward of their own. It writes K/V past each request's
        cached length only, which the step's forward overwrites (or leaves unread) as a rejection
        would."""
        width = max(draft.lengths)
        forward = self.runner.run(StepPlan(decodes=list(decodes)), draft_lists(draft), ())
        logits = verification_logits(forward.output.logits, forward.logit_starts, draft.lengths, width)
        lengths = torch.tensor(draft.lengths, device=self.device)
        accepted, _ = verify_greedy(draft.block.tokens[:, :width], logits.argmax(-1), lengths)
        return accepted.tolist()

    def _record(self, plan, draft, forward_time: float, step_time: float) -> None:
        super()._record(plan, draft, forward_time, step_time - self._probe_s)
