"""Queues, admission and the token budget of each step (continuous batching, chunked prefill)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dspark.engine.prefix_cache import PrefixCache
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

    def __init__(
        self,
        cache: KVCache,
        max_batch_tokens: int,
        prefix_cache: PrefixCache | None = None,
        admit: Callable[[Request], None] = lambda request: None,
    ) -> None:
        """`admit` (the drafter's) is called as each request gets its slot, before the next one is
        placed: a prefix the request copies may move or go with the next placement."""
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache = prefix_cache
        self.admit = admit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_decoding(self) -> int:
        """Running requests past their prompt: the decodes of the next plan."""
        return sum(not r.in_prefill for r in self.running)

    def schedule(self, tokens_per_decode: int) -> StepPlan:
        """Plan one step, reserving `tokens_per_decode` batch tokens per decode; requests admitted
        into a slot by this call join it."""
        if self.prefix_cache is not None:
            for request in self.running:
                self.prefix_cache.update(request)
        while self.waiting and self.cache.num_free_slots:
            request = self.waiting.popleft()
            self._allocate(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

        plan = StepPlan(decodes=[r for r in self.running if not r.in_prefill])
        budget = self.max_batch_tokens - len(plan.decodes) * tokens_per_decode
        for request in self.running:
            if request.in_prefill and budget > 0:
                chunk = min(budget, len(request.prompt_token_ids) - request.num_cached)
                plan.prefills.append((request, chunk))
                budget -= chunk
        return plan

    def _allocate(self, request: Request) -> None:
        """Give the request a slot (past the longest cached prefix of its prompt) and admit it."""
        if self.prefix_cache is None:
            request.slot = self.cache.allocate()
            self.admit(request)
        else:
            self.prefix_cache.place(request, self.admit)

    def finish(self, request: Request) -> None:
        """Drop a request from the queues and free its slot (idempotent); a prefix cache keeps
        indexing what the slot holds until it is reused."""
        if request in self.running:
            self.running.remove(request)
            if self.prefix_cache is not None:
                self.prefix_cache.update(request)
                self.prefix_cache.freed(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request.slot)
        request.slot = -1
        request.status = RequestStatus.FINISHED
