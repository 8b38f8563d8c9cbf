"""Ray Serve request routers of the engine deployment: by prompt prefix (`PrefixAwareRouter`) or in
turn (`RoundRobinRouter`); Ray's default, the power of two choices, is the third (`ROUTERS`).

A router runs in the process holding the deployment handle (the HTTP ingress replica, or the KServe
front end), one per process, and sees each call's arguments: the parsed chat or completion request.
Both routers here keep the same index of what each replica was sent, so their prefix-match rates
compare (`dspark.serving.router_metrics`).

Ray pickles a router class's module by value and rebuilds it in each handle's process: this module
holds no state of its own, and reaches its metrics through their module.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from dspark.serving import router_metrics
from dspark.serving.prefix_routing import (
    BLOCK_CHARS,
    IMBALANCE_THRESHOLD,
    MAX_BLOCKS_PER_REPLICA,
    PrefixIndex,
    block_hashes,
    choose,
    prompt_key,
)

# The engine deployment's method that generates (the one a prefix cache serves).
GENERATE_METHOD = "openai"


class _IndexedRouter(RequestRouter):
    """Keeps, per replica, the prefix blocks of the prompts routed to it, and counts the match rate."""

    name = ""

    def initialize_state(
        self,
        imbalance_threshold: int = IMBALANCE_THRESHOLD,
        max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA,
        block_chars: int = BLOCK_CHARS,
    ) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.block_chars = block_chars
        self.index = PrefixIndex(max_blocks_per_replica)
        for metric in (router_metrics.PROMPT_BLOCKS, router_metrics.MATCHED_BLOCKS):
            metric.labels(self.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only(self._replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.keep_only(self._replicas)

    def prompt_hashes(self, request: PendingRequest | None) -> list[int] | None:
        """The prefix blocks of a generation request's prompt; None for other calls."""
        if request is None or request.metadata.call_method != GENERATE_METHOD:
            return None
        for arg in request.args:
            key = prompt_key(arg)
            if key is not None:
                return block_hashes(key, self.block_chars)
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = self.prompt_hashes(pending_request)
        if hashes is None:
            return
        router_metrics.MATCHED_BLOCKS.labels(self.name).inc(self.index.match(replica_id, hashes))
        router_metrics.PROMPT_BLOCKS.labels(self.name).inc(len(hashes))
        self.index.insert(replica_id, hashes)


class PrefixAwareRouter(_IndexedRouter):
    """To the replica sent the longest part of the prompt before, unless it runs more than
    `imbalance_threshold` requests beyond the least loaded replica; else to the least loaded."""

    name = "prefix"

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ids = [r.replica_id for r in candidate_replicas]
        hashes = self.prompt_hashes(pending_request) or []
        route = choose(
            ids,
            await self._queue_lengths(candidate_replicas),
            {r: self.index.match(r, hashes) for r in ids} if hashes else {},
            {r: self.index.held(r) for r in ids},
            self.imbalance_threshold,
        )
        if pending_request is not None and pending_request.metadata.call_method == GENERATE_METHOD:
            router_metrics.DECISIONS.labels(self.name, route.decision).inc()
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[r] for r in rank] for rank in route.ranks]

    async def _queue_lengths(self, replicas: Sequence[RunningReplica]) -> dict[ReplicaID, int | None]:
        """Ongoing requests per replica: Ray's cached figures, probing the replicas it has none for."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        unknown = [r for r in replicas if loads[r.replica_id] is None]
        if unknown:
            for replica, length in await self._probe_queue_lens(unknown, 0):
                loads[replica.replica_id] = length
        return loads


class RoundRobinRouter(_IndexedRouter):
    """Each request to the next replica in turn (the others after it, should it be full): what a
    Kubernetes Service in front of one-replica pods does."""

    name = "round-robin"

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._turn = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        if pending_request is not None and pending_request.metadata.call_method == GENERATE_METHOD:
            router_metrics.DECISIONS.labels(self.name, "in_turn").inc()
        first = next(self._turn) % len(ordered)
        return [[ordered[first]], ordered[first + 1 :] + ordered[:first]]


# `--router` values: the engine deployment's request router class; None keeps Ray's default, the
# power of two choices (two replicas drawn at random, the one with fewer ongoing requests taken).
ROUTERS: dict[str, type[RequestRouter] | None] = {
    "prefix": PrefixAwareRouter,
    "round-robin": RoundRobinRouter,
    "pow2": None,
}
