"""Python operators that compiled graphs call as opaque ops, registered with torch.library's low-level API.

`torch.library.custom_op` runs a function under Python wrappers (autograd, argument checks) that
cost 5-6 us a call more than a plain registration: in a compiled graph of 121 chained bf16
[1, 576] x [576, 576] packed matmuls, 4.24 against 4.95 ms (one row; 7.87 against 8.48 ms at 16),
on a 2-core AMD EPYC with avx512_bf16. A compiled decode step of SmolLM2-135M calls these ops 151
times. They serve inference only, so they need no autograd formula.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("dspark", "FRAGMENT")  # held for the process: it owns the registrations


def define_op(schema: str, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> None:
    """Define `dspark::<schema>` with `impl` for every device and `fake` for tracing."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dspark::{name}", fake, lib=_LIB)
