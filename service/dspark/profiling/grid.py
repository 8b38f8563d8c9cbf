"""Which batch sizes a profiling run measures."""

from __future__ import annotations


def default_grid(max_batch_tokens: int, points_per_octave: int = 8) -> list[int]:
    """Batch sizes 1..max_batch_tokens: every size up to 2 * points_per_octave, then
    `points_per_octave` evenly spaced sizes per doubling, always ending at max_batch_tokens.

    Steps are powers of two, so the sizes land on the tile and CUDA-graph boundaries
    (multiples of 16, 64, 128, ...) where real step curves jump.
    """
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if points_per_octave < 1 or points_per_octave & (points_per_octave - 1):
        raise ValueError(f"points_per_octave must be a power of two, got {points_per_octave}")
    grid: list[int] = []
    size = 1
    while size <= max_batch_tokens:
        grid.append(size)
        size += max(1, (1 << (size.bit_length() - 1)) // points_per_octave)
    if grid[-1] != max_batch_tokens:
        grid.append(max_batch_tokens)
    return grid
