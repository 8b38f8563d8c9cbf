"""Which engine replica takes a request: the one most likely to hold its prompt's prefix in its cache,
unless that one is much busier than the least loaded. Pure functions and a bounded index, no Ray
(`dspark.serving.request_routers` plugs them into Ray Serve).

A prompt is keyed by text that grows as the engine's rendered prompt grows (`prompt_key`), cut into
blocks of `BLOCK_CHARS` under chained hashes, as the engine's prefix cache cuts tokens: a block's
hash stands for the whole prefix up to its end, so the blocks of one replica form a prefix tree of
the prompts it was sent, one node per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# About 16 tokens of English text: the engine's prefix cache reuses whole 16-token blocks.
BLOCK_CHARS = 64
# Per replica: 64k blocks of 64 characters is about 4 M characters (about a million tokens) of
# prompts, more than a replica's prefix store holds, for about 10 MB of index.
MAX_BLOCKS_PER_REPLICA = 65_536
# The replica holding the prefix is skipped when it runs this many more requests than the least
# loaded one: a queue of that length costs more than prefilling the prefix again.
IMBALANCE_THRESHOLD = 8

_ROLE, _MESSAGE = "\x1f", "\x1e"  # separators that chat text does not contain


def prompt_key(body: Any) -> str | None:
    """The text the engine's cache key follows, for a chat or completion request body; None when
    there is no single prompt to key on (a batch of prompts).

    A chat's messages are joined with their roles, so a conversation's next turn extends its last
    turn's key exactly as its rendered chat prompt extends the last one (the answer included).
    """
    messages = getattr(body, "messages", None)
    if messages is not None:
        return "".join(f"{_MESSAGE}{m.role}{_ROLE}{m.text()}" for m in messages)
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt))
    return None


def block_hashes(key: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of the key's whole blocks: hash i stands for key[: (i + 1) * block_chars]."""
    hashes, h = [], 0
    for end in range(block_chars, len(key) + 1, block_chars):
        h = hash((h, key[end - block_chars : end]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """For each replica, the prefix blocks of the prompts recently routed to it, at most
    `max_blocks` each; the least recently routed blocks are dropped first."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_REPLICA) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Track these replicas: new ones start empty, the others are forgotten."""
        replicas = set(replicas)
        for gone in self._blocks.keys() - replicas:
            del self._blocks[gone]
        for new in replicas - self._blocks.keys():
            self._blocks[new] = OrderedDict()

    def held(self, replica: Hashable) -> int:
        return len(self._blocks.get(replica, ()))

    def insert(self, replica: Hashable, hashes: Sequence[int]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def match(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """How many of the prompt's leading blocks the replica was sent. The longest block present
        counts, earlier ones evicted or not: its chained hash covers the whole prefix."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in blocks:
                return i + 1
        return 0


@dataclass(frozen=True)
class Route:
    """Replicas in order of preference (Ray takes the least loaded of the first rank that accepts)
    and why: `prefix`, `imbalanced` (the replica holding the prefix is too busy) or `least_loaded`
    (no replica holds any of it)."""

    ranks: list[list[Hashable]]
    decision: str


def choose(
    candidates: Sequence[Hashable],
    loads: Mapping[Hashable, int | None],
    matched: Mapping[Hashable, int],
    held: Mapping[Hashable, int] | None = None,
    imbalance_threshold: int = IMBALANCE_THRESHOLD,
) -> Route:
    """Rank the candidates for a prompt.

    `loads` are the replicas' ongoing requests (None: unknown, ranked last), `matched` the blocks of
    the prompt each was sent, `held` the blocks each holds (the emptier wins a tie of loads, so new
    prefixes spread). The replicas with the longest match come first unless the least loaded of
    them runs more than `imbalance_threshold` requests beyond the least loaded replica; then, or
    without a match, the least loaded.
    """
    held = held or {}

    def by_load(r: Hashable) -> tuple:
        load = loads.get(r)
        return (load is None, load or 0, held.get(r, 0))

    ordered = sorted(candidates, key=by_load)
    if not ordered:
        return Route([], "least_loaded")
    best = max((matched.get(r, 0) for r in ordered), default=0)
    if best == 0:
        return Route([ordered[:1], ordered[1:]], "least_loaded")
    holders = [r for r in ordered if matched.get(r, 0) == best]
    least = loads.get(ordered[0]) or 0
    if (loads.get(holders[0]) or 0) - least > imbalance_threshold:
        return Route([ordered[:1], ordered[1:]], "imbalanced")
    others = [r for r in ordered if r not in holders]
    return Route([holders, others], "prefix")
