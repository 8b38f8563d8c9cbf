"""Linear layers with weights pre-packed for oneDNN on the CPU.

`F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every call;
packing it once at load time roughly halves the matmul time of a decode step (the small-M shapes
that dominate serving). In fp32 the packed kernel also beats MKL's at those shapes: 1.28x
decode throughput at 16 users on an AVX2-only CPU. Inductor's CPU freezing pass does the same packing.

A single fp32 row (plain decoding of one request) is a matrix-vector product bound by memory
bandwidth, where MKL streaming a dense [in, out] copy beats the blocked layout (over a model's
weights, 1.4x on an AVX2 EPYC and 1.3x on an AMX Xeon). That copy is the weight itself: `weight`
becomes the transposed view of a contiguous [in, out] tensor, which `F.linear` reads without a
copy, so the two layouts cost no more memory than the packed one alone did. A bf16 row stays
packed: `F.linear` would reorder the weight on every call (1.7x slower on the AMX Xeon).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.cpu_kind import cpu_has_native_bf16
from dspark.models.graph_ops import define_op

# The packed layout does not depend on M; the hint only picks oneDNN's kernel for that size.
_BATCH_HINT = 16


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing pays on the CPU in fp32, and in bf16 where the CPU has native bf16 (without it
    oneDNN emulates bf16 slowly); cuBLAS needs none."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and cpu_has_native_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward uses a packed copy of its (frozen) weight for several rows and
    the weight itself, stored [in, out], for one; `weight` stays readable."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training reads `weight`, the packed copy would go stale
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():  # inductor cannot lower the packed op itself
            return torch.ops.dspark.packed_linear(x, self.packed, self.weight, self.bias)
        return _packed_or_dense(x, self.packed, self.weight, self.bias)


def uses_dense(x: torch.Tensor) -> bool:
    """Whether `x` is multiplied by the dense [in, out] weight: one fp32 row. Decided at run time,
    so a compiled graph needs no guard on it."""
    return x.dtype == torch.float32 and x.numel() == x.shape[-1]


def _packed_or_dense(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if uses_dense(x):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_linear_shape(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


# The packed (or, for one fp32 row, dense) matmul as one opaque op of a compiled graph.
define_op(
    "packed_linear(Tensor x, Tensor packed, Tensor weight, Tensor? bias) -> Tensor",
    _packed_or_dense,
    _packed_linear_shape,
)


def pack_linears(model: nn.Module) -> int:
    """Pack every nn.Linear of an inference-only model in place; returns how many were packed.
    A weight shared with another module (a tied head) is copied, not changed under that module."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            weight = module.weight
            module.__class__ = PackedLinear
            module.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
            in_out = weight.detach().t().contiguous()
            module.weight = nn.Parameter(in_out.t(), requires_grad=weight.requires_grad)
            count += 1
    return count


def linear_over(weight: torch.Tensor, packed: bool) -> nn.Linear:
    """A bias-free inference linear over `weight` [out, in] (rows gathered for it, which it keeps),
    packed like `pack_linears` when `packed`."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if packed:
        pack_linears(layer)
    return layer
