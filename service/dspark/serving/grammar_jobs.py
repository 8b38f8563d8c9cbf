"""Structured requests' grammars, compiled on worker threads while the engine keeps stepping.

A JSON schema or regex of up to a megabyte takes seconds to compile. On the stepping thread that
would stall every running request; here only its own request waits (unacknowledged, as vLLM's
does), and the engine loop admits it between two steps once its grammar is ready. llguidance
releases the GIL while it compiles.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from dspark.engine.sampling_params import SamplingParams

Item = TypeVar("Item")
# Two compiles at a time: more would take cores from the steps for requests that wait anyway.
MAX_WORKERS = 2
# Compile threads' nice value: on a machine with few cores a compile at the steps' priority takes a
# core the intra-op team needs and doubles the running streams' inter-token gaps. At 19 a compile
# starves under load (the team's threads spin between steps); at 10 it takes about a tenth of a
# busy core, so only the compiling request waits longer.
COMPILE_NICE = 10


def lower_thread_priority(niceness: int = COMPILE_NICE) -> None:
    """Give the calling thread `niceness` (Linux sets nice per thread); elsewhere, nothing."""
    # AttributeError: no per-thread priority on this platform; OSError: not permitted.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


class GrammarJobs(Generic[Item]):
    """Compiles with `engine.compile_grammar(params)` (engines without it compile nothing here) on
    worker threads; the loop owning the engine takes the results with `take_done`.

    `wake` is called from a worker thread after each compile, so that an idle loop looks.
    """

    def __init__(self, engine: Any, wake: Callable[[], None], max_workers: int = MAX_WORKERS):
        self._compile: Callable[[SamplingParams], Any] | None = getattr(engine, "compile_grammar", None)
        self._wake = wake
        self._max_workers = max_workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the two tables below
        self._compiling: dict[str, Item] = {}
        self._done: dict[str, tuple[Item, Any, ValueError | None]] = {}

    def wants(self, params: SamplingParams) -> bool:
        """Whether a request with `params` has a grammar to compile here."""
        return params.structured is not None and self._compile is not None

    def __len__(self) -> int:
        """Requests compiling or compiled but not yet taken."""
        with self._lock:
            return len(self._compiling) + len(self._done)

    def submit(self, request_id: str, item: Item, params: SamplingParams) -> None:
        """Compile the grammar of `params`; `item` comes back with it from `take_done`."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._max_workers, thread_name_prefix="dspark-grammar", initializer=lower_thread_priority
            )
        with self._lock:
            self._compiling[request_id] = item
        self._pool.submit(self._run, request_id, params)

    def cancel(self, request_id: str) -> Item | None:
        """Forget a request (aborted) still compiling or not yet taken; its item, or None."""
        with self._lock:
            if request_id in self._compiling:
                return self._compiling.pop(request_id)
            done = self._done.pop(request_id, None)
        return done[0] if done is not None else None

    def take_done(self) -> list[tuple[Item, Any, ValueError | None]]:
        """(item, grammar state, None) or (item, None, the ValueError) of each finished compile."""
        with self._lock:
            done, self._done = list(self._done.values()), {}
        return done

    def cancel_all(self) -> list[Item]:
        """Forget every request; their items."""
        with self._lock:
            items = [*self._compiling.values(), *(d[0] for d in self._done.values())]
            self._compiling, self._done = {}, {}
        return items

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, request_id: str, params: SamplingParams) -> None:
        grammar, error = None, None
        try:
            grammar = self._compile(params)
        except ValueError as e:
            error = e
        except Exception as e:  # a library failure refuses this request alone
            error = ValueError(f"structured output failed: {e}")
        with self._lock:
            item = self._compiling.pop(request_id, None)
            if item is None:
                return  # aborted meanwhile
            self._done[request_id] = (item, grammar, error)
        self._wake()
