"""Queues, admission and the token budget of each step (continuous batching, chunked prefill)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dspark.engine.request import Request, RequestStatus
from dspark.models.kv_cache import KVCache


@dataclass
class StepPlan:
    """Which requests decode (verify a draft) and which prefill how many prompt tokens this step."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """FIFO admission into KV slots; decodes first, then prompt chunks within the token budget."""

    def __init__(self, cache: KVCache, max_batch_tokens: int) -> None:
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_decoding(self) -> int:
        """Running requests past their prompt: the decodes of the next plan."""
        return sum(not r.in_prefill for r in self.running)

    def schedule(self, tokens_per_decode: int) -> tuple[StepPlan, list[Request]]:
        """Plan one step, reserving `tokens_per_decode` batch tokens per decode; also return the
        requests admitted into a slot by this call."""
        admitted = []
        while self.waiting and self.cache.num_free_slots:
            request = self.waiting.popleft()
            request.slot = self.cache.allocate()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)

        plan = StepPlan(decodes=[r for r in self.running if not r.in_prefill])
        budget = self.max_batch_tokens - len(plan.decodes) * tokens_per_decode
        for request in self.running:
            if request.in_prefill and budget > 0:
                chunk = min(budget, len(request.prompt_token_ids) - request.num_cached)
                plan.prefills.append((request, chunk))
                budget -= chunk
        return plan, admitted

    def finish(self, request: Request) -> None:
        """Drop a request from the queues and free its slot (idempotent)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request.slot)
        request.slot = -1
        request.status = RequestStatus.FINISHED
