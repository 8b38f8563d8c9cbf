"""Confidences on the host and the survival probabilities they imply.

A drafter's confidences c [R, gamma] give c[r, k] = P(draft k+1 accepted | all before it accepted),
so a[r, j] = prod_{i<=j} c[r, i] is the probability that draft j+1 survives verification. The
engine predicts accepted tokens from them and the verify-length policies rank candidates by them.

The arithmetic runs in NumPy on the host: R x gamma is tiny, and a small NumPy op costs about a
microsecond where a CPU torch op costs five to ten (this runs every step, on the critical path
between drafting and verification).
"""

from __future__ import annotations

import numpy as np
import torch


def host_array(confidences: torch.Tensor | np.ndarray) -> np.ndarray:
    """Confidences as a float64 NumPy array on the host (one device copy for a tensor)."""
    if isinstance(confidences, torch.Tensor):
        # Through a list: between two forwards (caches cold) a torch dtype conversion takes 90 us.
        return np.array(confidences.detach().tolist(), dtype=np.float64).reshape(confidences.shape)
    return np.asarray(confidences, dtype=np.float64)


def survival_probabilities(confidences: torch.Tensor | np.ndarray) -> np.ndarray:
    """a[r, j] = prod_{i<=j} c[r, i] in float64; confidences are clamped into [0, 1] first."""
    return np.cumprod(np.clip(host_array(confidences), 0.0, 1.0), axis=1)
