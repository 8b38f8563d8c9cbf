"""The CPU attention kernel for decode and verification rows against SDPA, and where it steps aside."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dspark.models import cpu_attention
from dspark.models.cpu_attention import MAX_QUERY_ROWS, short_attention

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention


@pytest.fixture(scope="module")
def kernel():
    built = cpu_attention.short_attention_kernel()
    assert built is not None, "the kernel must build where the suite runs (a C++ compiler is installed)"
    return built


def rows_case(rows: int, n: int, length: int, dtype: torch.dtype, seed: int = 0):
    """Queries [R, H, n, D] over a strided view of a larger cache, with per-row contexts, padding
    rows (queries that see key 0 only) and causal blocks, as the engine's groups build them."""
    g = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(rows + 3, KV_HEADS, length + 40, DIM, generator=g).to(dtype)
    cache_v = torch.randn(rows + 3, KV_HEADS, length + 40, DIM, generator=g).to(dtype)
    k, v = cache_k[1 : rows + 1, :, :length], cache_v[1 : rows + 1, :, :length]
    q = torch.randn(rows, n, HEADS, DIM, generator=g).to(dtype).transpose(1, 2)
    ends = torch.randint(max(n, length // 2), length + 1, (rows,), generator=g)
    ends[0] = length
    keys = torch.arange(length)[None, None, :]
    query_pos = (ends[:, None, None] - n) + torch.arange(n)[None, :, None]
    valid = torch.ones(rows, n, 1, dtype=torch.bool)
    valid[-1, n // 2 :] = False  # a shorter row's padding queries
    mask = torch.where(valid, keys <= query_pos, keys == 0)[:, None]
    return q, k, v, mask


def reference(q, k, v, mask):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)


CASES = [(1, 1)] + [(n, length) for n in range(1, MAX_QUERY_ROWS + 1) for length in (7, 141, 300)]


@pytest.mark.parametrize(("n", "length"), CASES)
def test_matches_exact_attention_in_fp32(kernel, n, length):
    q, k, v, mask = rows_case(6, n, length, torch.float32)
    out = short_attention(q, k, v, mask)
    assert out is not None and out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 5])
def test_bf16_is_as_close_to_exact_as_sdpa(kernel, n):
    q, k, v, mask = rows_case(16, n, 141, torch.bfloat16)
    exact = reference(q, k, v, mask)
    ours = (short_attention(q, k, v, mask).double() - exact).abs().max()
    sdpa = (
        (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).double() - exact)
        .abs()
        .max()
    )
    assert ours <= sdpa * 1.05


def test_no_mask_attends_every_key(kernel):
    q, k, v, _ = rows_case(1, 1, 50, torch.float32)
    torch.testing.assert_close(
        short_attention(q, k, v, None).double(), reference(q, k, v, None), atol=2e-6, rtol=1e-5
    )


def test_a_query_has_the_same_bits_alone_or_in_a_block(kernel):
    """Decode row vs the same position verified in a block beside longer rows: identical output."""
    q, k, v, mask = rows_case(4, 5, 200, torch.bfloat16)
    block = short_attention(q, k, v, mask)
    for r in range(4):
        for m in range(5):
            keys = int(mask[r, 0, m].nonzero().max()) + 1  # that query's own context, unpadded
            alone = short_attention(
                q[r : r + 1, :, m : m + 1],
                k[r : r + 1, :, :keys],
                v[r : r + 1, :, :keys],
                mask[r : r + 1, :, m : m + 1, :keys],
            )
            assert torch.equal(alone, block[r : r + 1, :, m : m + 1])


def test_steps_aside_where_it_does_not_apply(kernel, monkeypatch):
    q, k, v, mask = rows_case(2, MAX_QUERY_ROWS + 1, 40, torch.float32)
    assert short_attention(q, k, v, mask) is None  # long blocks: SDPA's tiled kernel
    q, k, v, mask = rows_case(2, 1, 40, torch.float32)
    assert short_attention(q, k, v, mask.float()) is None  # an additive mask
    with torch.enable_grad():
        assert short_attention(q.requires_grad_(), k, v, mask) is None  # no backward: training
    q = q.detach()
    assert (
        short_attention(q[..., :6].contiguous(), k[..., :6].contiguous(), v[..., :6].contiguous(), mask)
        is None
    )
    monkeypatch.setenv("DSPARK_CPU_ATTENTION", "sdpa")
    cpu_attention.short_attention_kernel.cache_clear()
    try:
        assert short_attention(q, k, v, mask) is None
    finally:
        cpu_attention.short_attention_kernel.cache_clear()


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    cpu_attention._build.cache_clear()
    cpu_attention.short_attention_kernel.cache_clear()
    try:
        q, k, v, mask = rows_case(2, 1, 40, torch.float32)
        with caplog.at_level(logging.WARNING, logger="dspark.models.cpu_attention"):
            assert short_attention(q, k, v, mask) is None
        assert "g++: command not found" in caplog.text
    finally:
        cpu_attention._build.cache_clear()
        cpu_attention.short_attention_kernel.cache_clear()


def test_a_builder_killed_mid_build_holds_up_the_next_only_while_it_lives(tmp_path):
    """A live builder makes the next wait; once it is killed, the next builds, clearing its lock file."""
    from dspark.models.cpu_attention import _build_lock

    builder = (
        "import sys, time; from pathlib import Path; from dspark.models.cpu_attention import _build_lock\n"
        f"with _build_lock(Path({str(tmp_path)!r})):\n"
        f"    Path({str(tmp_path / 'lock')!r}).touch(); print('building', flush=True); time.sleep(120)"
    )
    code_path = str(Path(cpu_attention.__file__).parents[2])  # this checkout's dspark, not an install's
    env = {**os.environ, "PYTHONPATH": code_path}
    proc = subprocess.Popen([sys.executable, "-c", builder], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "building"
        entered, lock_seen = threading.Event(), []

        def build() -> None:
            with _build_lock(tmp_path):
                lock_seen.append((tmp_path / "lock").exists())
                entered.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not entered.wait(1.0)  # the live builder holds the build
        proc.kill()
        assert entered.wait(30)
        assert lock_seen == [False]  # the killed builder's lock file is gone before the next builds
    finally:
        proc.kill()
        proc.wait()
