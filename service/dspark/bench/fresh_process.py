"""Run a measurement in a process of its own, so that no earlier one shapes it."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def in_fresh_process(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a newly spawned interpreter; its result or its exception comes back.

    Engines built one after another in one process are not alike: on the AMX Xeon (2026-12-05) the
    second of two identical engines made 3-7% fewer tokens/s at 16 users than the first, from what
    the first left behind (compiled-code caches, its freed memory). A server starts fresh; so does
    this. `fn` and its arguments must be picklable (a module-level function).
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
