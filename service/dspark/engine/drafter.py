"""The interface every drafter implements, and what it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors

# Where a cached prefix lives: a KV slot, or ("stored", n), an entry of the engine's prefix store.
Holder: TypeAlias = int | tuple[str, int]


@dataclass
class DraftBlock:
    """A proposed block for each of R requests."""

    tokens: torch.Tensor  # [R, gamma] int64
    probs: torch.Tensor | None  # [R, gamma, V] distribution each token was drawn from; None = one-hot
    confidences: torch.Tensor | None = None  # [R, gamma]: P(accept k | 1..k-1 accepted), calibrated
    num_valid: torch.Tensor | None = None  # [R]: usable draft length per request (None = gamma)


class Drafter(ABC):
    """Proposes draft blocks; sees the target's features of every token the target commits.

    Lifecycle per request: `admit` when it gets a KV slot, `commit` after every forward that
    adds tokens to the target's cache (prefill chunks and verification steps, only the tokens
    the target keeps, in order), `propose` before each verification, `release` when it ends.
    Rejected draft tokens never reach `commit`, so drafter context needs no rollback.

    Prefix caching: a request admitted with `prefix_source = (holder, n)` starts with n tokens
    already cached, copied from that holder; a drafter with per-request context must start it with
    its own context of those n tokens, from the same holder: a slot's running request or, for a
    free slot, the context it kept of the slot's last request; for a stored entry, the context
    `stash` moved there. It says in `context_limit` how much of a slot's context it holds.
    """

    name: str = "base"
    gamma: int = 0
    target_layers: tuple[int, ...] = ()  # decoder layers whose outputs `commit` receives
    device: torch.device | None = None  # where `propose` puts its tensors (None: it holds none)
    gives_confidences: bool = False  # `propose` fills DraftBlock.confidences (a confidence head)

    def fresh_copy(self) -> Drafter:
        """A drafter over the same weights that holds no requests, for another engine on the same
        model: engines stepped side by side must not share per-request state or deferred work.
        Drafters without per-request state return themselves."""
        return self

    def use_static_shapes(self, batch_buckets: tuple[int, ...], context_buckets: tuple[int, ...]) -> None:  # noqa: B027
        """Optional: propose over batches padded to these request-count buckets and contexts padded
        to these lengths, the last the longest context (CUDA graphs; eager padded code off CUDA).
        The engine calls it at start-up."""

    def admit(self, request: Request) -> None:  # noqa: B027 - optional hook
        """A request got a KV slot (and maybe a cached prefix: `request.prefix_source`)."""

    def context_limit(self, slot: int) -> int | None:
        """Leading tokens of the slot's cache whose drafter context this drafter holds; None when
        it keeps no per-request context (any cached prefix will do)."""
        return None

    def release(self, request: Request) -> None:  # noqa: B027 - optional hook
        """A request finished or was aborted."""

    def stash(self, slot: int, key: Holder) -> None:  # noqa: B027 - optional hook
        """The free slot's cached prefix moved to the prefix store as `key`: keep the context kept
        for the slot under `key` until `drop`, as the source of later hits on it."""

    def drop(self, key: Holder) -> None:  # noqa: B027 - optional hook
        """The prefix store evicted (or handed back to a slot) the entry `key`."""

    def commit(self, requests: Sequence[Request], features: Sequence[torch.Tensor | None]) -> None:  # noqa: B027
        """Features [n_r, len(target_layers) * hidden] of the tokens just cached for each request."""

    @abstractmethod
    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        """Draft up to `gamma` tokens after each request's last token (its anchor).

        `horizon` (<= gamma; None = gamma) is the most the engine will verify this step: a drafter
        may stop there and return a block that many positions wide."""


class WrappingDrafter(Drafter):
    """A drafter that adds to `inner`'s proposals (benchmark oracles, recorders): it takes inner's
    identity and passes every lifecycle call through; subclasses override `propose`."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.gamma = inner.gamma
        self.target_layers = inner.target_layers
        self.device = inner.device
        self.gives_confidences = inner.gives_confidences

    def use_static_shapes(self, batch_buckets: tuple[int, ...], context_buckets: tuple[int, ...]) -> None:
        self.inner.use_static_shapes(batch_buckets, context_buckets)

    def admit(self, request: Request) -> None:
        self.inner.admit(request)

    def context_limit(self, slot: int) -> int | None:
        return self.inner.context_limit(slot)

    def release(self, request: Request) -> None:
        self.inner.release(request)

    def stash(self, slot: int, key: Holder) -> None:
        self.inner.stash(slot, key)

    def drop(self, key: Holder) -> None:
        self.inner.drop(key)

    def commit(self, requests: Sequence[Request], features: Sequence[torch.Tensor | None]) -> None:
        self.inner.commit(requests, features)
