"""A C++ kernel for the attention of decode and verification rows on the CPU, and the K/V writes.

SDPA's flash kernel on the CPU pays for every (request, query head) pair and parallelises poorly
over few query rows. `csrc/short_attention.cpp` runs one task per (request, KV head), reads each
key once for the group's query heads and rows, and keeps scores in fp32.

It is built once per machine with torch's extension builder (the C++ compiler inductor needs too)
into `~/.cache/torch_extensions`. Where it cannot build, or with `DSPARK_CPU_ATTENTION=sdpa`,
attention runs through SDPA; so it does while the build runs in the background (`defer_build`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


def _build_flags() -> tuple[str, list[str]]:
    """The vector ISA inductor picks for this CPU (it honours `ATEN_CPU_CAPABILITY`), so `at::vec`
    compiles to its widest units, and the flags for it. The ISA names the build: one cached build
    per ISA, rather than a rebuild whenever the cap changes."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        return "scalar", ["-O3", "-fopenmp"]
    flags = ["-O3", "-fopenmp", *isa.build_arch_flags().split(), *(f"-D{m}" for m in isa.build_macro())]
    return str(isa).split()[0], flags


@dataclass(frozen=True)
class Built:
    """The extension's entry points (`csrc/short_attention.cpp`) and the head dims they take."""

    short_attention: Kernel
    write_and_attend: Callable[..., torch.Tensor]
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    head_dims: frozenset[int]


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the machine's build of this kernel, and clear what a killed builder left.

    torch's extension builder marks a build with a `lock` file and makes every other builder wait
    until it is gone; a builder killed mid-build (a server stopped while its kernel builds in the
    background) leaves it for ever, and every later start would wait behind it. Our builders first
    take an flock, which the kernel releases when its holder dies, so whoever holds it and finds
    torch's lock file knows nobody is building.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        lock = build_dir / "lock"
        if lock.exists():
            log.warning("removing the build lock of a build that was killed: %s", lock)
            lock.unlink(missing_ok=True)
        yield


@functools.cache
def _build() -> Built | None:
    from torch.utils import cpp_extension

    started = time.perf_counter()
    isa, flags = _build_flags()
    name = f"dspark_short_attention_{isa}"
    try:
        with _build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
            module = cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
            )
    except Exception as e:  # no compiler or no headers: SDPA computes the same attention
        log.warning("the CPU attention kernel did not build, attention runs through SDPA: %s", e)
        return None
    log.info("built the CPU attention kernel in %.1f s", time.perf_counter() - started)
    return Built(
        module.short_attention, module.write_and_attend, module.write_kv, frozenset(module.head_dims())
    )


_deferred = False


@functools.cache
def short_attention_kernel() -> Built | None:
    """The kernel's entry points and the head dims they take, or None where it is turned off, cannot
    build or is deferred. Read once, not per call: `cache_clear()` after changing `DSPARK_CPU_ATTENTION`."""
    if os.environ.get("DSPARK_CPU_ATTENTION", "kernel") == "sdpa" or _deferred:
        return None
    return _build()


def defer_build() -> None:
    """Run attention through SDPA in this process, instead of building the kernel (25-90 s) at its first
    use, until `build_deferred` built it and `use_built` switched to it."""
    global _deferred
    _deferred = True
    short_attention_kernel.cache_clear()


def build_deferred() -> bool:
    """Build (or load) the kernel without switching attention to it; whether it is usable."""
    return os.environ.get("DSPARK_CPU_ATTENTION", "kernel") != "sdpa" and _build() is not None


def use_built() -> None:
    """Switch attention to the kernel `build_deferred` built; call between forwards."""
    global _deferred
    _deferred = False
    short_attention_kernel.cache_clear()


def _plain_inputs(*tensors: torch.Tensor) -> bool:
    """Contiguous head dims, and no backward (the kernel has none: training goes through torch)."""
    if not all(t.stride(-1) == 1 for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _kernel_takes(built: Built, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return q.shape[-1] in built.head_dims and _plain_inputs(q, k, v)


def short_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor | None:
    """GQA attention of q [B, H, n, hd] over k / v [B, KVH, L, hd] with mask [B, 1, n or 1, L]
    (True = attend; None: every key), or None where the kernel does not apply."""
    rows, _, n, dim = q.shape
    if q.device.type != "cpu" or n > MAX_QUERY_ROWS or (mask is not None and mask.dtype != torch.bool):
        return None
    built = short_attention_kernel()
    if built is None or not _kernel_takes(built, q, k, v):
        return None
    if mask is None:
        mask = _EVERY_KEY
    return built.short_attention(q, k, v, mask[:, 0].expand(rows, n, k.shape[2]), dim**-0.5)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> bool:
    """`cache[slots[t], :, positions[t]] = new[t]` for both caches, as plain copies: index_put_ spends
    about 30 us a call setting up its indexing on the CPU. False (nothing written) where the kernel
    is off or cannot build, off the CPU, under autograd or for a strided head dim."""
    if not k_cache.is_cpu:
        return False
    built = short_attention_kernel()
    if built is None or not _plain_inputs(k, v):
        return False
    built.write_kv(k_cache, k, slots, positions)
    built.write_kv(v_cache, v, slots, positions)
    return True


@dataclass(frozen=True)
class DecodeAttention:
    """Every layer's K/V write and attention in one call (`write_and_attend`) for a step whose requests
    own cache slots lo..lo + rows - 1 in order and add the same number of tokens each: its arguments
    are built once a forward, where the general path takes a dozen tensor ops a layer (about 0.15 ms).
    """

    built: Built
    lo: int
    rows: int
    length: int  # keys attended per slot
    mask: torch.Tensor  # [rows, n, length] bool

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        token_slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """[T, H * hd], having written k / v into the caches; None (nothing written) where it does not apply."""
        if not _kernel_takes(self.built, q, k, v):
            return None
        return self.built.write_and_attend(
            q,
            k,
            v,
            k_cache,
            v_cache,
            token_slots,
            positions,
            self.lo,
            self.rows,
            self.length,
            self.mask,
            q.shape[-1] ** -0.5,
        )


def decode_attention(
    slots: int | slice, rows: int, n: int, length: int, mask: torch.Tensor | None
) -> DecodeAttention | None:
    """The one-call path for in-order rows of n <= `MAX_QUERY_ROWS` tokens reading slots in place
    (`slots`: a lone request's slot, or a slice of as many slots as rows), mask [rows, 1, n, length]
    or None; None where the kernel is off, cannot build or does not apply."""
    if n > MAX_QUERY_ROWS or (mask is not None and mask.dtype != torch.bool):
        return None
    built = short_attention_kernel()
    if built is None:
        return None
    lo = slots if isinstance(slots, int) else slots.start
    every = (mask if mask is not None else _EVERY_KEY)[:, 0].expand(rows, n, length)
    return DecodeAttention(built, lo, rows, length, every)
