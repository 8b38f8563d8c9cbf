"""Static-shape functions run per bucket: captured as CUDA graphs on a GPU, called eagerly elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

GiB = 2**30


class GraphSet:
    """One `torch.cuda.CUDAGraph` per bucket key, all allocating from one memory pool.

    Capture the largest bucket first (as nano-vllm does): the smaller graphs then reuse its pool
    blocks. Each graph's outputs live in the pool and are overwritten by the next replay of any
    graph, so a caller copies what it keeps before the next step. Off CUDA, `run` calls the
    function eagerly: the same padded static-shape code, which is what the CPU tests exercise.
    """

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.device = device
        self._pool: Any = None
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[Hashable, Any] = {}

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> None:
        """Warm `fn` up (lazy kernel and allocator set-up must not happen mid-capture), then capture it."""
        if not self.enabled:
            return
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[key] = fn()
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = graph

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """Replay the key's graph (its outputs reflect the static inputs' current contents), or call fn."""
        graph = self._graphs.get(key)
        if graph is None:
            return fn()
        graph.replay()
        return self._outputs[key]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


def check_graph_memory(needed: int, free: int, what: str, share: float = 0.9) -> None:
    """Refuse, before any capture, graphs whose buffers and pool would not fit the free device memory."""
    if needed > share * free:
        raise ValueError(
            f"CUDA graphs for {what} need about {needed / GiB:.2f} GiB (static buffers and memory pool), "
            f"but only {free / GiB:.2f} GiB of device memory is free ({share:.0%} usable) after the KV "
            "cache; lower max_num_seqs or max_model_len, or run with --no-cuda-graphs"
        )


def free_device_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]
