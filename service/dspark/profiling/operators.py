"""Count the operators a piece of work dispatches: on a GPU, each one that computes is a launch.

A small model's step is launch-bound on a GPU (docs/gpu.md), so the number of computing operators
per step is the figure to keep down; it does not depend on the machine, so tests can hold it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OperatorCount(TorchDispatchMode):
    """Inside the context, counts the aten operators that run a kernel, by name.

    Views are left out: an operator whose schema returns an alias of its input (view, slice,
    transpose; also `to`, `reshape` and `contiguous`, which inference mode dispatches whole) is
    counted only when its result does not share the input's storage, i.e. when it copied.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view and _aliases(out, args[0])):
            self.counts[func.overloadpacket.__name__] += 1
        return out

    @property
    def computing(self) -> int:
        return sum(self.counts.values())


def _aliases(out, source) -> bool:
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    return (
        isinstance(first, torch.Tensor)
        and isinstance(source, torch.Tensor)
        and first.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    )
