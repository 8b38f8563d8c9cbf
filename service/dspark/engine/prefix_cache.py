"""Automatic prefix caching over per-request KV slots and a store of prefixes moved out of them.

The tokens every holder caches (a KV slot, or an entry of the `PrefixStore`) are indexed in
fixed-size blocks under chained hashes (a block's hash covers every token before it, as in vLLM).
A finished request's slot keeps its KV until the slot is given to another request; then its
cached prefix moves to the store, which evicts least recently used entries to make room.

A new request starts past its prompt's longest cached prefix. It takes over the free slot that
holds it when that slot's last request is the same conversation's earlier turn (the new prompt
contains that whole prompt): the rest of that slot is the earlier answer, which the new prompt
resends. Otherwise the prefix is copied into another free slot, out of a slot (running or free)
or a stored entry. A stored entry taken whole by the next turn of its conversation is moved out
(the slot holds it again).

Positions below a request's `num_cached` are never rewritten while it holds the slot (rejected
draft tokens only ever sit past it), so an indexed block stays valid until its slot changes hands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark.engine.drafter import Drafter, Holder
from dspark.engine.prefix_store import PrefixStore
from dspark.engine.request import Request
from dspark.models.kv_cache import KVCache

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PrefixHit:
    holder: Holder  # the slot or stored entry whose KV holds the prefix
    length: int  # tokens reused (whole blocks)


def chain_hashes(tokens: Sequence[int], num_blocks: int, block_size: int, start: int = 0, parent: int = 0):
    """Hashes of blocks start..num_blocks-1, each chained to the one before (`parent` for `start`)."""
    hashes = []
    for b in range(start, num_blocks):
        parent = hash((parent, tuple(tokens[b * block_size : (b + 1) * block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Which holder caches which full blocks of tokens; where each admitted request starts.

    The drafter's `context_limit(slot)` caps a hit on a slot at the leading tokens whose drafter
    context it holds; `stash` and `drop` keep that context with the stored entries.
    """

    def __init__(
        self,
        cache: KVCache,
        drafter: Drafter,
        store: PrefixStore | None = None,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.cache, self.drafter, self.store = cache, drafter, store
        self.block_size = block_size
        self._hashes: dict[Holder, list[int]] = {}  # holder -> chained hashes of its cached blocks
        self._tokens: dict[Holder, list[int]] = {}  # holder -> those blocks' tokens (rules out collisions)
        self._holders: dict[int, set[Holder]] = {}  # block hash -> holders of it
        # Idle holder -> the prompt length of the request that left it: a prompt containing that
        # whole prompt continues its conversation.
        self._prompt_len: dict[Holder, int] = {}
        self.queries = self.hits = 0  # prompt tokens looked up / found, since the last `take_counts`
        self._freed: dict[int, int] = {}  # slot -> when it was last freed or read (a step-free clock)
        self._clock = 0

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The longest cached whole-block prefix of `prompt`, leaving its last token to compute (its
        logits give the first output token); on a tie a free slot (no copy), then a stored entry."""
        depth: dict[Holder, int] = {}
        wanted = (len(prompt) - 1) // self.block_size
        for i, h in enumerate(chain_hashes(prompt, wanted, self.block_size)):
            holders = self._holders.get(h)
            if not holders:
                break
            for holder in holders:
                depth[holder] = i + 1
        best, best_rank = None, None
        for holder, blocks in depth.items():
            length = blocks * self.block_size
            if isinstance(holder, int):
                limit = self.drafter.context_limit(holder)
                if limit is not None:
                    length = min(length, limit // self.block_size * self.block_size)
            if length == 0 or self._tokens[holder][:length] != list(prompt[:length]):
                continue
            rank = (length, self._preference(holder), str(holder))  # str: a deterministic tie-break
            if best_rank is None or rank > best_rank:
                best, best_rank = PrefixHit(holder, length), rank
        return best

    def _preference(self, holder: Holder) -> int:
        if not isinstance(holder, int):
            return 1
        return 2 if self.cache.is_free(holder) else 0

    # ---- admission --------------------------------------------------------------------------

    def place(self, request: Request, admit: Callable[[Request], None]) -> None:
        """Give the request a free slot, starting it past its prompt's longest cached prefix, and
        call `admit` (the drafter's) once the slot holds that prefix."""
        hit = self.lookup(request.prompt_token_ids)
        source = hit.holder if hit is not None else None
        free = self.cache.free_slots
        if source in free and (self._continues(hit) or len(free) == 1):
            slot = source
            if not self._continues(hit):
                self._stash(slot)
            self.truncate(slot, hit.length)
        else:
            slot = self._victim([s for s in free if s != source])
            self._stash(slot, protect=source)
            self.truncate(slot)
            if hit is not None:
                self._copy(hit, slot)
        if isinstance(source, int) and source in self._freed:
            self._tick(source)
        request.slot = self.cache.allocate(slot)
        self._prompt_len.pop(slot, None)
        self.count(len(request.prompt_token_ids), hit.length if hit else 0)
        if hit is not None:
            request.num_cached = request.stats.cached_tokens = hit.length
            request.prefix_source = (source, hit.length)
        admit(request)
        if hit is not None and not isinstance(source, int) and self._continues(hit):
            self._drop_stored(source)  # moved out: the request's slot holds it now

    def _continues(self, hit: PrefixHit) -> bool:
        """The hit covers the whole prompt of the request that left its holder (block-rounded)."""
        prompt = self._prompt_len.get(hit.holder)
        cached = len(self._hashes.get(hit.holder, ())) * self.block_size
        return prompt is not None and hit.length >= min(prompt // self.block_size * self.block_size, cached)

    def _victim(self, free: Sequence[int]) -> int:
        """The free slot for a request that does not take one over: one that holds no cached
        block, else the least recently freed."""
        empty = [s for s in free if not self._hashes.get(s)]
        if empty:
            return min(empty)
        return min(free, key=lambda s: self._freed.get(s, 0))

    def _copy(self, hit: PrefixHit, dest: int) -> None:
        """`dest` (holding nothing) gets the hit's prefix, K/V and index."""
        if isinstance(hit.holder, int):
            self.cache.copy_prefix(hit.holder, dest, hit.length)
        else:
            self.store.load(hit.holder[1], dest, hit.length)
        self._index(dest, hit.holder, hit.length)

    # ---- the store --------------------------------------------------------------------------

    def _stash(self, slot: int, protect: Holder | None = None) -> None:
        """Move the free slot's cached prefix (as far as the drafter holds its context) to the store
        before the slot is reused, unless an entry already holds it all. Never evicts `protect`."""
        hashes = self._hashes.get(slot)
        if self.store is None or not hashes:
            return
        length = len(hashes) * self.block_size
        limit = self.drafter.context_limit(slot)
        if limit is not None:
            length = min(length, limit // self.block_size * self.block_size)
        n = min(length // self.block_size, self.store.num_blocks)
        if n == 0 or any(
            not isinstance(h, int) and len(self._hashes[h]) >= n for h in self._holders[hashes[n - 1]]
        ):
            return
        while self.store.num_free_blocks < n:
            oldest = ("stored", self.store.oldest())
            if oldest == protect:
                return
            self._drop_stored(oldest)
        key = ("stored", self.store.save(slot, n * self.block_size))
        self._index(key, slot, n * self.block_size)
        if slot in self._prompt_len:
            self._prompt_len[key] = self._prompt_len[slot]
        self.drafter.stash(slot, key)

    def _drop_stored(self, key: Holder) -> None:
        self.truncate(key)
        del self._hashes[key], self._tokens[key]
        self._prompt_len.pop(key, None)
        self.store.drop(key[1])
        self.drafter.drop(key)

    @property
    def num_stored(self) -> int:
        return len(self.store) if self.store is not None else 0

    # ---- the index --------------------------------------------------------------------------

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
            self._holders.setdefault(h, set()).add(slot)
        hashes.extend(new)
        tokens.extend(known[len(tokens) :])

    def freed(self, request: Request) -> None:
        """The request finished: its slot stays indexed, the continuation of its prompt."""
        self._tick(request.slot)
        self._prompt_len[request.slot] = len(request.prompt_token_ids)

    def _tick(self, slot: int) -> None:
        self._clock += 1
        self._freed[slot] = self._clock

    def truncate(self, holder: Holder, length: int = 0) -> None:
        """The holder keeps only its first `length` tokens (whole blocks) valid."""
        keep = length // self.block_size
        hashes = self._hashes.get(holder, [])
        for h in hashes[keep:]:
            holders = self._holders[h]
            holders.discard(holder)
            if not holders:
                del self._holders[h]
        del hashes[keep:]
        if holder in self._tokens:
            del self._tokens[holder][keep * self.block_size :]

    def _index(self, dest: Holder, source: Holder, length: int) -> None:
        """`dest` (holding nothing) now holds `source`'s first `length` tokens."""
        keep = length // self.block_size
        self._hashes[dest] = self._hashes[source][:keep]
        self._tokens[dest] = self._tokens[source][: keep * self.block_size]
        for h in self._hashes[dest]:
            self._holders[h].add(dest)

    # ---- counters ---------------------------------------------------------------------------

    def count(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queries += prompt_tokens
        self.hits += hit_tokens

    def take_counts(self) -> tuple[int, int]:
        """(queried, hit) prompt tokens since the last call."""
        counts, self.queries, self.hits = (self.queries, self.hits), 0, 0
        return counts
