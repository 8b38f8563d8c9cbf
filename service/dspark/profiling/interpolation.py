"""Piecewise-linear lookup on tensors (torch has no `interp`)."""

from __future__ import annotations

import torch


def interp_flat(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Linear interpolation of (xp, fp) at x, constant beyond both ends; xp ascending, float64.

    Returns float64 on x's device (xp and fp are moved there if needed).
    """
    x = x.to(torch.float64)
    xp = xp.to(x.device)
    fp = fp.to(x.device)
    if xp.numel() == 1:
        return fp.expand(x.shape).clone()
    right = torch.searchsorted(xp, x, right=True).clamp(1, xp.numel() - 1)
    left = right - 1
    x0, x1 = xp[left], xp[right]
    w = ((x - x0) / (x1 - x0)).clamp(0.0, 1.0)
    return fp[left] + w * (fp[right] - fp[left])
