"""Queues, admission and the token budget of each step (continuous batching, chunked prefill)."""

from __future__ import annotations

from collections import deque
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
        self, cache: KVCache, max_batch_tokens: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache = prefix_cache
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
        if self.prefix_cache is not None:
            for request in self.running:
                self.prefix_cache.update(request)
        while self.waiting and self.cache.num_free_slots:
            request = self.waiting.popleft()
            self._allocate(request)
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

    def _allocate(self, request: Request) -> None:
        """Give the request a slot, starting it past the longest cached prefix of its prompt: the
        free slot that holds it as is, or a copy of it from a running (or another free) slot."""
        prefix = self.prefix_cache
        if prefix is None:
            request.slot = self.cache.allocate()
            return
        hit = prefix.lookup(request.prompt_token_ids, self.cache.is_free)
        if hit is not None and self.cache.is_free(hit.slot):
            request.slot = self.cache.allocate(hit.slot)
            prefix.truncate(request.slot, hit.length)
        else:
            request.slot = self.cache.allocate(prefix.victim(self.cache.free_slots))
            prefix.truncate(request.slot)
            if hit is not None:
                self.cache.copy_prefix(hit.slot, request.slot, hit.length)
                prefix.copy_index(hit.slot, request.slot, hit.length)
        prefix.count(len(request.prompt_token_ids), hit.length if hit else 0)
        if hit is not None:
            request.num_cached = request.stats.cached_tokens = hit.length
            request.prefix_source = (hit.slot, hit.length)

    def finish(self, request: Request) -> None:
        """Drop a request from the queues and free its slot (idempotent); a prefix cache keeps
        indexing what the slot holds until it is reused."""
        if request in self.running:
            self.running.remove(request)
            if self.prefix_cache is not None:
                self.prefix_cache.update(request)
                self.prefix_cache.freed(request.slot)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request.slot)
        request.slot = -1
        request.status = RequestStatus.FINISHED
