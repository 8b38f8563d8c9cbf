"""The profiling grid and the PNG plots."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from dspark.policies.sps_curve import OnlineSps
from dspark.profiling.grid import default_grid
from dspark.profiling.plots import plot_lines, plot_sps_profile
from dspark.profiling.synthetic import synthetic_profile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_grid_is_fine_at_small_b_and_coarser_above() -> None:
    grid = default_grid(2048)
    assert grid[:16] == list(range(1, 17))
    assert grid[-1] == 2048 and grid == sorted(set(grid))
    steps = [b - a for a, b in itertools.pairwise(grid)]
    assert steps == sorted(steps)  # never finer again once coarse
    assert {128, 256, 512, 1024} <= set(grid)  # lands on tile boundaries
    assert len(grid) < 100
    assert default_grid(1) == [1]
    assert default_grid(100)[-1] == 100


@pytest.mark.parametrize(("args", "message"), [((0,), "max_batch_tokens"), ((64, 3), "power of two")])
def test_grid_refuses_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        default_grid(*args)


def test_profile_plot_writes_a_png(tmp_path: Path) -> None:
    profile = synthetic_profile(max_batch_tokens=256)
    online = OnlineSps(profile)
    online.observe(100, 0.05)
    path = plot_sps_profile(profile, tmp_path / "plots" / "sps.png", refined=online)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5_000


def test_line_plot_writes_a_png(tmp_path: Path) -> None:
    path = plot_lines({"a": ([1, 2, 3], [3, 2, 1]), "b": ([1, 2], [1, 2])}, tmp_path / "l.png", "x", "y", "t")
    assert path.read_bytes().startswith(PNG_MAGIC)
