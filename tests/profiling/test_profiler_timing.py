"""The profiler times batch sizes in interleaved passes, so a slow spell bends no stretch of the curve."""

from __future__ import annotations

from types import SimpleNamespace

import dspark.profiling.profiler as profiler
import pytest
import torch
from dspark.profiling.profiler import time_forwards


class FakeTarget:
    """Stands in for the target on a fake clock: each forward records its size and takes 1 s, or
    10 s while the machine is in a slow spell (forwards number `slow`)."""

    def __init__(self, slow: range = range(0)) -> None:
        self.config = SimpleNamespace(vocab_size=50)
        self.calls: list[int] = []
        self.slow = slow
        self.now = 0.0

    def __call__(self, tokens: torch.Tensor, batch, cache, hidden_layers=()) -> None:
        self.now += 10.0 if len(self.calls) in self.slow else 1.0
        self.calls.append(tokens.numel())


@pytest.fixture
def target(monkeypatch) -> FakeTarget:
    target = FakeTarget()
    monkeypatch.setattr(profiler, "time", SimpleNamespace(perf_counter=lambda: target.now))
    return target


def engine(target: FakeTarget) -> SimpleNamespace:
    drafter = SimpleNamespace(target_layers=())
    return SimpleNamespace(
        model=target,
        runner=SimpleNamespace(forward=target),
        cache=None,
        device=torch.device("cpu"),
        drafter=drafter,
    )


def test_passes_alternate_direction_and_every_size_gets_its_repeats(target) -> None:
    finished = []
    medians = time_forwards(
        engine(target),
        [[1], [2], [1, 2]],
        8,
        repeats=3,
        min_seconds=0.0,
        timed=lambda i, s: finished.append(i),
    )
    assert target.calls == [1, 2, 3, 3, 2, 1, 1, 2, 3]
    assert finished == [0, 1, 2, 2, 1, 0, 0, 1, 2] and medians == [1.0, 1.0, 1.0]


def test_a_slow_spell_spreads_over_all_sizes_instead_of_bending_one(target) -> None:
    # Three slow forwards in a row: timed size after size they would all be the first size's,
    # making its median 10 s; interleaved, each size gets one slow forward of three.
    target.slow = range(3)
    assert time_forwards(engine(target), [[1], [2], [3]], 8, repeats=3, min_seconds=0.0) == [1.0, 1.0, 1.0]


def test_min_seconds_and_the_cap_decide_how_many_forwards(target) -> None:
    assert time_forwards(engine(target), [[1]], 8, repeats=1, min_seconds=4.0) == [1.0]
    assert len(target.calls) == 4
    time_forwards(engine(target), [[2]], 8, repeats=1, min_seconds=1e9, max_forwards=6)
    assert len(target.calls) == 4 + 6
