"""Automatic prefix caching over per-request KV slots.

Every slot's cached tokens are indexed in fixed-size blocks under chained hashes (a block's hash
covers every token before it, as in vLLM). A finished request's slot keeps its KV until the slot
is reused, so its blocks stay in the index: a new request whose prompt starts with them takes that
free slot over as is, or copies the prefix out of a running (or another free) slot. Positions
below a request's `num_cached` are never rewritten while it holds the slot (rejected draft tokens
only ever sit past it), so an indexed block stays valid until its slot changes hands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark.engine.request import Request

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PrefixHit:
    slot: int  # the slot whose KV holds the prefix
    length: int  # tokens reused (whole blocks)


def chain_hashes(tokens: Sequence[int], num_blocks: int, block_size: int, start: int = 0, parent: int = 0):
    """Hashes of blocks start..num_blocks-1, each chained to the one before (`parent` for `start`)."""
    hashes = []
    for b in range(start, num_blocks):
        parent = hash((parent, tuple(tokens[b * block_size : (b + 1) * block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Which slot holds which full blocks of tokens, and the lookup of a prompt's longest cached prefix.

    `context_limit(slot)` says how many of the slot's leading tokens the drafter can hand over too
    (None: the drafter keeps no per-request context), so a hit never outruns the drafter's context.
    """

    def __init__(self, context_limit: Callable[[int], int | None], block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.context_limit = context_limit
        self._hashes: dict[int, list[int]] = {}  # slot -> chained hashes of its cached blocks
        self._tokens: dict[int, list[int]] = {}  # slot -> those blocks' tokens (rules out collisions)
        self._slots: dict[int, set[int]] = {}  # block hash -> slots holding it
        self.queries = self.hits = 0  # prompt tokens looked up / found, since the last `take_counts`
        self._freed: dict[int, int] = {}  # slot -> when it was last freed (a step-free clock)
        self._clock = 0

    def lookup(self, prompt: Sequence[int], is_free: Callable[[int], bool]) -> PrefixHit | None:
        """The longest cached whole-block prefix of `prompt`, leaving its last token to compute (its
        logits give the first output token); a free slot wins a tie (no copy)."""
        depth: dict[int, int] = {}
        wanted = (len(prompt) - 1) // self.block_size
        for i, h in enumerate(chain_hashes(prompt, wanted, self.block_size)):
            slots = self._slots.get(h)
            if not slots:
                break
            for slot in slots:
                depth[slot] = i + 1
        best: PrefixHit | None = None
        for slot, blocks in sorted(depth.items()):
            length = blocks * self.block_size
            limit = self.context_limit(slot)
            if limit is not None:
                length = min(length, limit // self.block_size * self.block_size)
            if length == 0 or self._tokens[slot][:length] != list(prompt[:length]):
                continue
            if best is None or (length, is_free(slot)) > (best.length, is_free(best.slot)):
                best = PrefixHit(slot, length)
        return best

    def count(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_tokens

    def take_counts(self) -> tuple[int, int]:
        """(queried, hit) prompt tokens since the last call."""
        counts, self.queries, self.hits = (self.queries, self.hits), 0, 0
        return counts

    def update(self, request: Request) -> None:
        """Index the request's slot up to its cached tokens (only new whole blocks are hashed)."""
        slot, hashes = request.slot, self._hashes.setdefault(request.slot, [])
        # A stop may cut the output short of what the target cached; only known tokens are indexed.
        blocks = min(request.num_cached, request.num_tokens) // self.block_size
        if blocks <= len(hashes):
            return
        tokens = self._tokens.setdefault(slot, [])
        known = request.all_token_ids[: blocks * self.block_size]
        new = chain_hashes(known, blocks, self.block_size, len(hashes), hashes[-1] if hashes else 0)
        for h in new:
            self._slots.setdefault(h, set()).add(slot)
        hashes.extend(new)
        tokens.extend(known[len(tokens) :])

    def freed(self, slot: int) -> None:
        self._clock += 1
        self._freed[slot] = self._clock

    def victim(self, free: Sequence[int]) -> int:
        """The free slot to give a request whose prefix is not cached: one that holds no cached
        block, else the least recently freed."""
        empty = [s for s in free if not self._hashes.get(s)]
        if empty:
            return min(empty)
        return min(free, key=lambda s: self._freed.get(s, 0))

    def truncate(self, slot: int, length: int = 0) -> None:
        """The slot keeps only its first `length` tokens (whole blocks) valid: it changes hands."""
        keep = length // self.block_size
        hashes = self._hashes.get(slot, [])
        for h in hashes[keep:]:
            holders = self._slots[h]
            holders.discard(slot)
            if not holders:
                del self._slots[h]
        del hashes[keep:]
        if slot in self._tokens:
            del self._tokens[slot][keep * self.block_size :]

    def copy_index(self, source: int, dest: int, length: int) -> None:
        """`dest` now holds `source`'s first `length` tokens (a copied prefix)."""
        self.truncate(dest)
        keep = length // self.block_size
        self._hashes[dest] = self._hashes[source][:keep]
        self._tokens[dest] = self._tokens[source][: keep * self.block_size]
        for h in self._hashes[dest]:
            self._slots[h].add(dest)
