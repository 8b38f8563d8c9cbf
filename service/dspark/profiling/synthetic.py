"""A plausible accelerator step curve, for tests and for benchmarking the scheduler itself."""

from __future__ import annotations

from dspark.profiling.grid import default_grid
from dspark.sps_format import SpsPoint, SpsProfile


def synthetic_profile(
    max_batch_tokens: int = 2048,
    fixed_ms: float = 20.0,
    per_token_us: float = 15.0,
    tile: int = 128,
    tile_ms: float = 0.8,
    model: str = "synthetic",
    device: str = "synthetic",
) -> SpsProfile:
    """Step time = fixed cost + per-token cost + a jump at every `tile` tokens (jagged like a GPU)."""
    points = []
    for b in default_grid(max_batch_tokens):
        ms = fixed_ms + per_token_us * b / 1000.0 + tile_ms * ((b - 1) // tile)
        points.append(SpsPoint(batch_tokens=b, steps_per_second=1000.0 / ms))
    return SpsProfile(
        device=device,
        node_type="synthetic",
        model=model,
        dtype="bfloat16",
        engine={"max_batch_tokens": max_batch_tokens},
        points=points,
    )
