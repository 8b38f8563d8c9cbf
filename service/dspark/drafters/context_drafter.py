"""Drafters that keep per-request context in a `ContextStore`, computed from committed features
when they next draft."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from dspark.drafters.context_store import ContextStore
from dspark.drafters.feature_batch import CommittedChunk, PendingCommits, check_in_sync, gather_commit
from dspark.engine.drafter import Drafter
from dspark.engine.request import Request


class ContextDrafter(Drafter):
    """`commit` queues features (`PendingCommits`); `write_pending` turns them into stored context
    in one batch, and each `propose` starts with `context_lengths`, which calls it."""

    store: ContextStore
    feature_size: int

    def __init__(self) -> None:
        self.pending = PendingCommits()

    def admit(self, request: Request) -> None:
        self.store.admit(request.request_id)

    def release(self, request: Request) -> None:
        if request.request_id in self.store.length:
            self.pending.release(self.store.rows([request.request_id])[0])
        self.store.release(request.request_id)

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
