"""Drafters that keep per-request context in a `ContextStore`, computed from committed features
when they next draft."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Hashable, Sequence

import torch

from dspark.drafters.context_store import ContextStore
from dspark.drafters.feature_batch import CommittedChunk, PendingCommits, check_in_sync, gather_commit
from dspark.engine.drafter import Drafter, Holder
from dspark.engine.request import Request


class ContextDrafter(Drafter):
    """`commit` queues features (`PendingCommits`); `write_pending` turns them into stored context
    in one batch, and each `propose` starts with `context_lengths`, which calls it."""

    store: ContextStore
    feature_size: int

    def __init__(self) -> None:
        self.pending = PendingCommits()
        # slot -> whose context it is: its running request's id, or ("slot", n) for the context a
        # finished request left there, kept while the prefix cache may reuse the slot's KV. The
        # context of a stored prefix is kept under its key, ("stored", n).
        self._holder: dict[int, Hashable] = {}
        self._slot_of: dict[str, int] = {}
        # slot -> the key its kept context was just stashed under: a request that takes the slot
        # over (keeping part of its KV) is admitted right after, and copies its context from there.
        self._stashed: dict[int, Hashable] = {}

    def admit(self, request: Request) -> None:
        rid = request.request_id
        self.store.admit(rid)
        if request.prefix_source is not None:
            source, length = request.prefix_source
            self.write_pending()  # the source's context must be stored before it is copied
            if isinstance(source, int):
                source = self._holder.get(source) or self._stashed[source]
            self.store.copy_prefix(source, rid, length)
        self._stashed.clear()
        if request.slot < 0:  # no KV slot (a drafter driven without an engine): nothing to keep
            return
        self._drop_kept(request.slot)  # the slot's old KV is being overwritten
        self._holder[request.slot] = rid
        self._slot_of[rid] = request.slot

    def release(self, request: Request) -> None:
        rid = request.request_id
        slot = self._slot_of.pop(rid, None)
        if slot is None or rid not in self.store.length:
            self.store.release(rid)
            return
        # Its queued commits stay: the row keeps its context, under the slot's key.
        self.store.rename(rid, ("slot", slot))
        self._holder[slot] = ("slot", slot)

    def context_limit(self, slot: int) -> int | None:
        holder = self._holder.get(slot)
        return self.store.length.get(holder, 0) if holder is not None else 0

    def stash(self, slot: int, key: Holder) -> None:
        if self._holder.get(slot) == ("slot", slot):
            self.store.rename(("slot", slot), key)  # its queued commits follow the row
            del self._holder[slot]
            self._stashed[slot] = key

    def drop(self, key: Holder) -> None:
        if key in self.store.length:
            self.pending.release(self.store.rows([key])[0])
            self.store.release(key)

    def _drop_kept(self, slot: int) -> None:
        if self._holder.get(slot) == ("slot", slot):
            self.drop(("slot", slot))
            del self._holder[slot]

    @torch.inference_mode()
    def commit(self, requests: Sequence[Request], features: Sequence[torch.Tensor | None]) -> None:
        chunk = gather_commit(self.store, requests, features, self.feature_size)
        if chunk is not None and self.pending.add(chunk):
            self.write_pending()

    @torch.inference_mode()
    def write_pending(self) -> None:
        chunk = self.pending.take()
        if chunk is not None:
            self._write(chunk)

    def context_lengths(self, requests: Sequence[Request]) -> list[int]:
        """Each request's committed length (checked against the target's), with every queued
        commit written: the context `propose` drafts from."""
        lengths = check_in_sync(self.store, requests)
        self.write_pending()
        return lengths

    @abstractmethod
    def _write(self, chunk: CommittedChunk) -> None:
        """Store the context entries of the committed tokens."""
