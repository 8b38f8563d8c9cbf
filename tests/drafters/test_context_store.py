"""The paged per-request context store: writes land where reads find them, across growth and reuse."""

from __future__ import annotations

import pytest
import torch
from dspark.drafters.context_store import ContextStore


def test_paged_roundtrip_with_growth_and_reuse():
    store = ContextStore({"kv": (2, 3)}, torch.device("cpu"), torch.float32, page_size=4)
    lengths = {f"r{i}": 5 + 7 * i for i in range(12)}  # more rows than the table starts with, > initial pages
    expected = {}
    for rid, n in lengths.items():
        store.admit(rid)
        store.reserve(rid, n)
        values = torch.randn(n, 2, 3)
        expected[rid] = values
        row = torch.tensor(store.rows([rid]) * n)
        store.write("kv", row, torch.arange(n), values)  # written before later requests grow the pools
    ids = list(lengths)
    rows = torch.tensor(store.rows(ids))
    batch = store.read("kv", rows, max(lengths.values()))
    for i, rid in enumerate(ids):
        torch.testing.assert_close(batch[i, : lengths[rid]], expected[rid], atol=0, rtol=0)
    positions = torch.tensor([[0, 3], [4, 1]])
    picked = store.read_at("kv", rows[:2], positions)
    torch.testing.assert_close(picked[1, 0], expected["r1"][4], atol=0, rtol=0)

    store.release("r3")
    store.admit("late")
    store.reserve("late", 9)
    store.write("kv", torch.tensor(store.rows(["late"]) * 9), torch.arange(9), torch.ones(9, 2, 3))
    torch.testing.assert_close(
        store.read("kv", torch.tensor(store.rows(["late"])), 9)[0], torch.ones(9, 2, 3)
    )
    # Reusing r3's pages did not disturb anyone else.
    torch.testing.assert_close(store.read("kv", torch.tensor(store.rows(["r11"])), 82)[0], expected["r11"])
    with pytest.raises(KeyError, match="not admitted"):
        store.rows(["r3"])


def _chunk(rows: list[int], positions: list[int]):
    from dspark.drafters.feature_batch import CommittedChunk

    return CommittedChunk(
        torch.tensor([[float(r), float(p)] for r, p in zip(rows, positions, strict=True)]),
        torch.tensor(rows),
        torch.tensor(positions),
    )


def test_pending_commits_drop_rows_released_before_they_were_written():
    from dspark.drafters.feature_batch import PendingCommits

    pending = PendingCommits(max_tokens=100)
    assert pending.take() is None
    pending.add(_chunk([0, 1, 2], [5, 7, 3]))
    pending.add(_chunk([1, 2], [8, 4]))
    pending.release(1)  # row 1 ends; a new request takes the row and commits from position 0
    pending.add(_chunk([1, 0], [0, 6]))
    pending.release(2)
    chunk = pending.take()
    assert chunk.rows.tolist() == [0, 1, 0]
    assert chunk.positions.tolist() == [5, 0, 6]
    assert chunk.features.tolist() == [[0.0, 5.0], [1.0, 0.0], [0.0, 6.0]]
    assert pending.take() is None and pending.num_tokens == 0
    pending.release(0)  # nothing queued: nothing to drop later
    pending.add(_chunk([0], [7]))
    assert pending.take().positions.tolist() == [7]


def test_pending_commits_ask_to_be_written_when_full():
    from dspark.drafters.feature_batch import PendingCommits

    pending = PendingCommits(max_tokens=4)
    assert not pending.add(_chunk([0, 1, 2], [0, 0, 0]))
    assert pending.add(_chunk([0], [1]))
    assert pending.num_tokens == 4


def test_copy_prefix_and_rename_keep_the_entries():
    """A prefix-cache hit copies a kept context; the tables may have grown inside inference mode."""
    store = ContextStore({"kv": (2,)}, torch.device("cpu"), torch.float32, page_size=4)
    store.admit("a")
    with torch.inference_mode():  # commits grow the tables in inference mode
        store.reserve("a", 40)
        store.length["a"] = 40
        values = torch.randn(40, 2)
        store.write("kv", torch.tensor(store.rows(["a"]) * 40), torch.arange(40), values)
    store.rename("a", ("slot", 0))
    store.admit("b")
    store.copy_prefix(("slot", 0), "b", 23)
    assert store.length["b"] == 23
    torch.testing.assert_close(store.read("kv", torch.tensor(store.rows(["b"])), 23)[0], values[:23])
    with pytest.raises(ValueError, match="holds 40"):
        store.copy_prefix(("slot", 0), "b", 41)
