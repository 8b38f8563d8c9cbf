"""The one-call decode path (`write_and_attend`) against the general path it replaces, bit for bit,
and the groups it is built for."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dspark.models import cpu_attention
from dspark.models.cpu_attention import MAX_QUERY_ROWS, write_kv
from dspark.models.forward_batch import ForwardBatch
from dspark.models.transformer import _attend_short

HEADS, KV_HEADS, DIM, SLOTS, MAX_LEN = 9, 3, 64, 12, 96
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_attention.short_attention_kernel() is not None, "the kernel must build where the suite runs"


def step(slots: list[int], starts: list[int], n: int, dtype: torch.dtype, seed: int = 0):
    """A batch adding n tokens to each slot, its new q / k / v and a filled cache."""
    g = torch.Generator().manual_seed(seed)
    batch = ForwardBatch.build(slots, starts, [n] * len(slots), [], CPU)
    tokens = batch.num_tokens
    q, k, v = (torch.randn(tokens, h, DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    caches = [torch.randn(SLOTS, KV_HEADS, MAX_LEN, DIM, generator=g).to(dtype) for _ in range(2)]
    return batch, q, k, v, caches


def general_path(batch, q, k, v, k_cache, v_cache):
    """`Attention.attend` without the one-call path: index_put_ writes, then `_attend_short`."""
    where = (batch.token_slots, batch.positions)
    k_cache.transpose(1, 2).index_put_(where, k)
    v_cache.transpose(1, 2).index_put_(where, v)
    return _attend_short(q, k_cache, v_cache, batch.short).reshape(q.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, MAX_QUERY_ROWS])
@pytest.mark.parametrize(
    ("slots", "starts"), [([5], [40]), ([0, 1, 2, 3], [10, 60, 33, 70]), ([3, 4, 5], [0, 7, 50])]
)
def test_write_and_attend_equals_the_general_path_bit_for_bit(dtype, n, slots, starts):
    batch, q, k, v, (k_cache, v_cache) = step(slots, starts, n, dtype)
    decode = batch.short.decode
    assert decode is not None
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected = general_path(batch, q, k, v, expected_k, expected_v)
    out = decode(q, k, v, k_cache, v_cache, batch.token_slots, batch.positions)
    assert out is not None and out.shape == expected.shape and out.dtype == dtype
    assert torch.equal(out, expected)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_strided_new_keys_are_written_as_index_put_writes_them():
    batch, q, k, v, (k_cache, v_cache) = step([2, 3], [20, 30], 1, torch.float32)
    wide = torch.randn(k.shape[0], KV_HEADS, 2 * DIM)
    k = wide[..., :DIM]  # rows strided like a split of a fused projection
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected = general_path(batch, q, k, v, expected_k, expected_v)
    assert torch.equal(
        batch.short.decode(q, k, v, k_cache, v_cache, batch.token_slots, batch.positions), expected
    )
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize(
    ("slots", "lengths", "why"),
    [
        ([4, 2, 3], [1, 1, 1], "slots out of order"),
        ([0, 9], [1, 1], "slots too far apart: gathered"),
        ([2, 3], [1, 3], "rows of different lengths"),
        ([2, 3], [MAX_QUERY_ROWS + 1] * 2, "rows too long for the kernel"),
        ([2, 3], [1, 40], "a prompt chunk beside a decode row"),
    ],
)
def test_no_one_call_path_where_the_group_is_not_dense_and_in_place(slots, lengths, why):
    batch = ForwardBatch.build(slots, [10] * len(slots), lengths, [], CPU)
    assert batch.short is None or batch.short.decode is None, why


def test_no_one_call_path_off_the_cpu_or_with_the_kernel_off(monkeypatch):
    assert ForwardBatch.build([1, 2], [5, 5], [1, 1], [], torch.device("meta")).short.decode is None
    monkeypatch.setenv("DSPARK_CPU_ATTENTION", "sdpa")
    cpu_attention.short_attention_kernel.cache_clear()
    try:
        assert ForwardBatch.build([1, 2], [5, 5], [1, 1], [], CPU).short.decode is None
    finally:
        monkeypatch.delenv("DSPARK_CPU_ATTENTION")
        cpu_attention.short_attention_kernel.cache_clear()


def test_steps_aside_without_writing_where_it_does_not_apply():
    batch, q, k, v, (k_cache, v_cache) = step([2, 3], [20, 30], 1, torch.float32)
    before = k_cache.clone()
    decode = batch.short.decode
    args = (k_cache, v_cache, batch.token_slots, batch.positions)
    assert decode(q.clone().requires_grad_(), k, v, *args) is None  # no backward
    assert decode(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), *args) is None
    assert decode(q[..., ::2], k, v, *args) is None  # a strided head dim
    assert torch.equal(k_cache, before)


def test_a_position_outside_the_cache_is_an_error_not_a_stray_write():
    batch, q, k, v, (k_cache, v_cache) = step([2, 3], [20, 30], 1, torch.float32)
    outside = dataclasses.replace(batch, positions=torch.tensor([20, MAX_LEN]))
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        batch.short.decode(q, k, v, k_cache, v_cache, outside.token_slots, outside.positions)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_the_general_path_writes_new_keys_as_index_put_does():
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(SLOTS, KV_HEADS, MAX_LEN, DIM, generator=g) for _ in range(2))
    k, v = (
        torch.randn(7, KV_HEADS, DIM, generator=g),
        torch.randn(7, KV_HEADS, 2 * DIM, generator=g)[..., :DIM],
    )
    slots, positions = torch.tensor([4, 4, 4, 0, 9, 9, 2]), torch.tensor([10, 11, 12, 0, 95, 94, 50])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.transpose(1, 2).index_put_((slots, positions), k)
    expected_v.transpose(1, 2).index_put_((slots, positions), v)
    assert write_kv(k_cache, v_cache, k, v, slots, positions)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not write_kv(k_cache, v_cache, k.requires_grad_(), v, slots, positions)  # autograd: index_put_
    assert not write_kv(k_cache, v_cache, k.detach()[..., ::2], v[..., ::2], slots, positions)
