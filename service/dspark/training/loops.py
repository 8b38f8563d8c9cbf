"""Looping answers: a response whose tail only repeats n-grams it already produced.

About 40% of the default corpus's greedy response tokens are such tails (a small target at T = 0 falls
into a cycle and stays there until the length limit). They are trivially predictable copies, so
they teach the drafter little per training step; `data.loops: truncate` keeps the first
`LOOP_KEEP` tokens of each loop, so the drafter still sees loops begin.
"""

from __future__ import annotations

from collections.abc import Sequence

LOOP_KEEP = 32  # tokens of a loop that truncation keeps


def loop_start(tokens: Sequence[int], n: int = 8, cover: float = 0.9, min_tail: int = 32) -> int | None:
    """Where `tokens` starts repeating itself for good: the first repeated n-gram of the longest tail
    (at least `min_tail` n-grams) in which at least `cover` of the n-grams repeat an earlier one of
    `tokens`; None if there is no such tail."""
    seen: set[tuple[int, ...]] = set()
    repeats = []
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        repeats.append(gram in seen)
        seen.add(gram)
    start, count = None, 0
    for i in range(len(repeats) - 1, -1, -1):
        count += repeats[i]
        tail = len(repeats) - i
        if tail >= min_tail and count >= cover * tail:
            start = i
    if start is None:
        return None
    return next(i for i in range(start, len(repeats)) if repeats[i])


def truncate_loop(tokens: list[int], keep: int = LOOP_KEEP) -> list[int]:
    """`tokens` cut `keep` tokens after its loop starts (unchanged when it does not loop)."""
    start = loop_start(tokens)
    return tokens if start is None else tokens[: start + keep]
