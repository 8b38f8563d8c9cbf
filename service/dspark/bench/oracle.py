"""The oracle of `dspark bench serve` (greedy only): a bound to read the verify policies against.

Every step it drafts the whole block, learns from an extra, unclocked verification forward how
many drafted tokens the target accepts, and then runs the step proper verifying exactly those.
A policy that drafts on a step can at best verify that same prefix, so the oracle bounds what any
scheduler reaches with this drafter on this machine on the steps where it drafts; its gap to
DSpark is what imperfect confidences cost, and plain decoding covers the steps a policy skips.

It is built from the engine's public seams: a drafter wrapper that marks only the accepted
prefix of each draft usable (`DraftBlock.num_valid`), under a policy that verifies every usable
draft token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dspark.builder import sibling_engine
from dspark.engine.drafter import DraftBlock, Drafter, WrappingDrafter
from dspark.engine.drafting import Draft, draft_lists
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.model_runner import ModelRunner
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.sampling_params import SamplingParams
from dspark.engine.scheduler import StepPlan
from dspark.engine.verifier import verify_greedy
from dspark.engine.verify import verification_logits
from dspark.policies.baselines import StaticPolicy

ORACLE = "oracle"


def oracle_policy() -> StaticPolicy:
    """The whole usable block for every request: `OracleDrafter` cuts each to its accepted prefix."""
    policy = StaticPolicy(None)
    policy.name = ORACLE
    return policy


class OracleDrafter(WrappingDrafter):
    """`inner`'s drafts, each usable only as far as the target accepts it. `untimed_s` counts the
    seconds of the probing forwards, which a benchmark's clock leaves out (`ClosedLoop` does)."""

    def __init__(self, inner: Drafter, runner: ModelRunner | None = None) -> None:
        super().__init__(inner)
        self.runner = runner  # the engine's; set once the engine exists
        self.untimed_s = 0.0

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        block = self.inner.propose(requests, sampling, horizon)
        width = min(self.gamma if horizon is None else horizon, block.tokens.shape[1])
        usable = block.num_valid.tolist() if block.num_valid is not None else [width] * len(requests)
        # The bonus token must fit in max_tokens, as the engine's own limit says.
        lengths = [
            max(0, min(width, n, r.remaining_tokens - 1)) for r, n in zip(requests, usable, strict=True)
        ]
        if not requests or max(lengths) == 0:
            return block
        started = time.perf_counter()
        accepted = self._accepted_prefix(requests, Draft(block, lengths))
        self.untimed_s += time.perf_counter() - started
        num_valid = torch.tensor(accepted, dtype=torch.int64, device=block.tokens.device)
        return DraftBlock(block.tokens, block.probs, block.confidences, num_valid)

    def _accepted_prefix(self, requests: Sequence[Request], draft: Draft) -> list[int]:
        """Verify the drafts in a forward of their own. It writes K/V past each request's cached
        length only, which the step's forward overwrites (or leaves unread) as a rejection would."""
        assert self.runner is not None, "OracleDrafter.runner is set by OracleEngine.of"
        width = max(draft.lengths)
        forward = self.runner.run(StepPlan(decodes=list(requests)), draft_lists(draft), ())
        logits = verification_logits(forward.output.logits, forward.logit_starts, draft.lengths, width)
        lengths = torch.tensor(draft.lengths, device=logits.device)
        accepted, _ = verify_greedy(draft.block.tokens[:, :width], logits.argmax(-1), lengths)
        return accepted.tolist()


class OracleEngine(LLMEngine):
    """An engine that verifies only what the target accepts; refuses sampled requests."""

    @classmethod
    def of(cls, engine: LLMEngine, **config_updates) -> OracleEngine:
        """A sibling of `engine` under the oracle: same weights, its own KV cache and its own copy of
        the drafter (a drafter keeps per-slot context that two engines' slots would collide in)."""
        drafter = OracleDrafter(engine.drafter.fresh_copy())
        oracle = sibling_engine(engine, drafter, oracle_policy(), engine_type=cls, **config_updates)
        drafter.runner = oracle.runner
        return oracle

    @property
    def untimed_s(self) -> float:
        """Seconds spent in probing forwards so far."""
        return self.drafter.untimed_s

    def add_request(self, prompt_token_ids, params: SamplingParams, *args, **kwargs) -> str:
        if not params.greedy:
            raise ValueError("the oracle policy needs greedy decoding (temperature 0)")
        return super().add_request(prompt_token_ids, params, *args, **kwargs)
