"""Scaled dot-product attention kept off cuDNN's backend."""

from __future__ import annotations

from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's SDPA plans every new shape on the host: 2-4 ms a call on an H200 (docs/gpu.md), against
# about 30 us of GPU work. Decode and verification shapes change every step as contexts grow, so a
# plan is never reused; the other backends launch at once.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def without_cudnn_attention():
    """A context in which `F.scaled_dot_product_attention` never picks the cuDNN backend."""
    return sdpa_kernel(_BACKENDS)
