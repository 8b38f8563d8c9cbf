"""A C++ kernel for the attention of decode and verification rows on the CPU.

SDPA's flash kernel on the CPU pays for every (request, query head) pair and parallelises poorly
over few query rows. `csrc/short_attention.cpp` runs one task per (request, KV head), reads each
key once for the group's query heads and rows, and keeps scores in fp32.

It is built once per machine with torch's extension builder (the C++ compiler inductor needs too)
into `~/.cache/torch_extensions`. Where it cannot build, or with `DSPARK_CPU_ATTENTION=sdpa`,
attention runs through SDPA.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "short_attention.cpp"
# Queries per request up to which the kernel runs: decode rows and short verification blocks. At
# 16 x 141-300 keys on 2 threads of an AMX Xeon it took 0.45x SDPA's time at one query row, 0.5x
# at two, 0.7-0.8x at four and 0.8-0.9x at five, and lost from eight rows on, where SDPA's tiled
# matmuls (AMX) take over.
MAX_QUERY_ROWS = 5
_EVERY_KEY = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # the mask of a row that sees every key
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _build_flags() -> list[str]:
    """The vector ISA inductor picks for this CPU, so `at::vec` compiles to its widest units."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    macros = isa.build_macro() if isa else []
    return ["-O3", "-fopenmp", *(isa.build_arch_flags().split() if isa else []), *(f"-D{m}" for m in macros)]


@functools.cache
def _build() -> tuple[Kernel, frozenset[int]] | None:
    from torch.utils import cpp_extension

    started = time.perf_counter()
    try:
        module = cpp_extension.load(
            name="dspark_short_attention",
            sources=[str(SOURCE)],
            extra_cflags=_build_flags(),
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler or no headers: SDPA computes the same attention
        log.warning("the CPU attention kernel did not build, attention runs through SDPA: %s", e)
        return None
    log.info("built the CPU attention kernel in %.1f s", time.perf_counter() - started)
    return module.short_attention, frozenset(module.head_dims())


@functools.cache
def short_attention_kernel() -> tuple[Kernel, frozenset[int]] | None:
    """The kernel and the head dims it takes, or None where it is turned off or cannot build.
    Read once, not per call: `cache_clear()` after changing `DSPARK_CPU_ATTENTION`."""
    if os.environ.get("DSPARK_CPU_ATTENTION", "kernel") == "sdpa":
        return None
    return _build()


def short_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor | None:
    """GQA attention of q [B, H, n, hd] over k / v [B, KVH, L, hd] with mask [B, 1, n or 1, L]
    (True = attend; None: every key), or None where the kernel does not apply."""
    rows, _, n, dim = q.shape
    if q.device.type != "cpu" or n > MAX_QUERY_ROWS or k.stride(-1) != 1 or q.stride(-1) != 1:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None  # no backward: training attends through SDPA
    if mask is not None and mask.dtype != torch.bool:
        return None
    built = short_attention_kernel()
    if built is None:
        return None
    kernel, head_dims = built
    if dim not in head_dims:
        return None
    if mask is None:
        mask = _EVERY_KEY
    return kernel(q, k, v, mask[:, 0].expand(rows, n, k.shape[2]), dim**-0.5)
