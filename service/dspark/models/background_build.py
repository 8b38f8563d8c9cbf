"""The CPU attention kernel and the compiled forward, built on a background thread while the eager
forward serves; the engine takes each up between steps (`take_kernel`, `take_forward`).

The thread runs at a lower priority (Linux nices threads one by one), and so do the C++ compilers
that inductor and torch's extension builder start from it: on two cores, a step of the eager
forward preempts them. Its warm-up forwards use a one-slot KV cache of their own, so nothing of the
engine's cache is borrowed while requests run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

from dspark.models import cpu_attention
from dspark.models.compiled_forward import CompiledForward
from dspark.models.kv_cache import KVCache
from dspark.models.transformer import DecoderModel

log = logging.getLogger(__name__)

BUILD_NICENESS = 10
_WARM_UP_LEN = 16  # positions of the warm-up cache: its forwards attend at most 5 tokens


class BackgroundBuild:
    """Builds the attention kernel (`kernel`) and the model's warmed-up `CompiledForward` (`compile`)
    on a daemon thread; attention runs through SDPA until the engine takes the kernel."""

    def __init__(
        self, model: DecoderModel, like: KVCache, hidden_layers: tuple[int, ...], kernel: bool, compile: bool
    ) -> None:
        self.model, self.hidden_layers = model, hidden_layers
        self.kernel, self.compile = kernel, compile
        layers, _, kv_heads, _, dim = like.k.shape
        self._cache = KVCache(layers, 1, _WARM_UP_LEN, kv_heads, dim, like.k.dtype, like.k.device)
        self._kernel_built = threading.Event()
        self._compiled: CompiledForward | None = None
        self.done = threading.Event()
        if kernel:
            cpu_attention.defer_build()
        self._thread = threading.Thread(target=self._run, name="dspark-background-build", daemon=True)

    def start(self) -> BackgroundBuild:
        self._thread.start()
        return self

    def take_kernel(self) -> bool:
        """Switch attention to the kernel once it is built (call between steps); whether it did now."""
        if not self._kernel_built.is_set():
            return False
        self._kernel_built.clear()
        cpu_attention.use_built()
        log.info("attention of decode rows now runs the CPU kernel")
        return True

    def take_forward(self) -> CompiledForward | None:
        """The compiled forward once it is warmed up, once; None before, or where it failed."""
        compiled, self._compiled = self._compiled, None
        return compiled

    def _run(self) -> None:
        _lower_this_thread(BUILD_NICENESS)
        try:
            if self.kernel:
                log.info("building the CPU attention kernel in the background (25-90 s the first time)")
                if cpu_attention.build_deferred():
                    self._kernel_built.set()
            if self.compile:
                self._compiled = self._compiled_forward()
        finally:
            self.done.set()

    def _compiled_forward(self) -> CompiledForward | None:
        log.info("compiling the target's forward in the background (about a minute the first time)")
        started = time.perf_counter()
        compiled = self.model.__dict__.get("compiled_forward") or CompiledForward(self.model)
        try:
            compiled.warm_up(self._cache, self.hidden_layers)
        except Exception as e:  # inductor and dynamo raise many types; all mean "cannot compile here"
            log.warning("the target's forward stays eager: compiling it failed (%s)", str(e).splitlines()[0])
            return None
        log.info("compiled the target's forward in %.1f s", time.perf_counter() - started)
        self.model.__dict__["compiled_forward"] = compiled
        return compiled


def _lower_this_thread(niceness: int) -> None:
    """Nice the calling thread (on Linux a thread's own setting; the processes it starts inherit it)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


def wants_kernel(device: torch.device) -> bool:
    """Whether a forward on `device` would build the CPU attention kernel at its first use."""
    return device.type == "cpu" and os.environ.get("DSPARK_CPU_ATTENTION", "kernel") != "sdpa"
