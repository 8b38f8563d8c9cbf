"""Measure the engine's verification step rate SPS(B) over a grid of batch sizes."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch

from dspark.models.compiled_forward import forward_kind
from dspark.models.forward_batch import ForwardBatch
from dspark.profiling.device import current_device_name
from dspark.profiling.grid import default_grid
from dspark.sps_format import SpsPoint, SpsProfile

log = logging.getLogger(__name__)

TOKENS_PER_REQUEST = 4  # a verification row is 1 anchor + l_r drafts; 4 sits between decode and full blocks


def node_type() -> str:
    """The node label value the operator passes in, else the host name."""
    return os.environ.get("DSPARK_NODE_TYPE") or socket.gethostname()


def batch_shape(batch_tokens: int, max_requests: int) -> list[int]:
    """Split B tokens over requests the way verification batches look: ~4 tokens each."""
    requests = max(1, min(max_requests, -(-batch_tokens // TOKENS_PER_REQUEST)))
    base, extra = divmod(batch_tokens, requests)
    return [base + (1 if i < extra else 0) for i in range(requests)]


def time_forwards(
    engine,
    shapes: list[list[int]],
    context_len: int,
    repeats: int,
    min_seconds: float,
    timed: Callable[[int, float], None] | None = None,
    max_forwards: int = 50,
) -> list[float]:
    """Median seconds of one verification forward per batch shape (per-request token counts);
    `timed(i, seconds)` after every forward, of shape i.

    The shapes are timed in interleaved passes (one forward each, the order reversed every pass)
    until each has `repeats` forwards and `min_seconds` of them, or `max_forwards`. A shared
    machine's slow spells, which last seconds, then fall on every batch size alike instead of
    bending the curve over the sizes timed during one: on the development CPU two profiles taken
    in a row differed by a median 3-10% per point timed one size after another, 2.5-4.4% interleaved.
    """
    inputs = [_verification_input(engine, lengths, context_len) for lengths in shapes]
    times: list[list[float]] = [[] for _ in shapes]
    order = list(range(len(shapes)))
    while order:
        for i in list(order):
            times[i].append(_forward_seconds(engine, *inputs[i]))
            if timed:
                timed(i, times[i][-1])
            enough = len(times[i]) >= repeats and sum(times[i]) >= min_seconds
            if enough or len(times[i]) >= max_forwards:
                order.remove(i)
        order.reverse()
    return [statistics.median(t) for t in times]


def _forward_seconds(engine, tokens: torch.Tensor, batch: ForwardBatch) -> float:
    """Wall-clock seconds of one forward of the engine's target, its queued device work included."""
    sync(engine.device)
    start = time.perf_counter()
    engine.runner.forward(tokens, batch, engine.cache, hidden_layers=engine.drafter.target_layers)
    sync(engine.device)
    return time.perf_counter() - start


def _verification_input(engine, lengths: list[int], context_len: int) -> tuple[torch.Tensor, ForwardBatch]:
    """Random tokens and the batch layout of one forward: request i verifies lengths[i] tokens."""
    tokens = torch.randint(0, engine.model.config.vocab_size, (sum(lengths),), device=engine.device)
    rows = list(range(sum(lengths)))
    slots = list(range(len(lengths)))
    return tokens, ForwardBatch.build(slots, [context_len] * len(lengths), lengths, rows, engine.device)


def profile_engine(
    engine,
    grid: list[int] | None = None,
    context_len: int = 256,
    repeats: int = 3,
    min_seconds: float = 0.25,
    progress: Callable[[int, float], None] | None = None,
    points_per_octave: int | None = None,
) -> SpsProfile:
    """Fill every KV slot with a context, then time forwards of B tokens for each B in the grid (by
    default `points_per_octave` sizes per doubling: 8 on CUDA, 4 elsewhere);
    `progress(B, forwards per second)` after every timed forward.

    `min_seconds` of forwards per size: at B <= 8 on a 2-core EPYC two profiles in a row differed
    in shape by a median 10% (up to 16%) at 0.05 s, three 20 ms forwards, and 3% (up to 6%) at
    0.25 s, for 2-4 s more (docs/bench/profile-twins); the policy ranks verify lengths by those
    differences."""
    if engine.has_unfinished_requests():
        raise RuntimeError("profile an idle engine: requests are running")
    max_requests = engine.cache.num_free_slots
    per_octave = points_per_octave or (8 if engine.device.type == "cuda" else 4)
    grid = grid or default_grid(engine.config.max_batch_tokens, per_octave)
    # A request's context plus its share of the largest batch must fit in max_model_len.
    widest = max(batch_shape(grid[-1], max_requests))
    context_len = min(context_len, engine.max_model_len - widest)
    if context_len < 1:
        raise ValueError(
            f"max_model_len {engine.max_model_len} leaves no room for a context next to {widest} "
            "verified tokens per request; raise --max-model-len or --max-num-seqs, or lower --max-batch-tokens"
        )
    _fill_context(engine, max_requests, context_len)
    time_forwards(engine, [batch_shape(grid[-1], max_requests)], context_len, 2, 0.0)  # warm-up
    shapes = [batch_shape(b, max_requests) for b in grid]
    # Every forward is reported: interleaved, the sizes all finish in the last passes.
    timed = (lambda i, seconds: progress(grid[i], 1.0 / seconds)) if progress else None
    medians = time_forwards(engine, shapes, context_len, repeats, min_seconds, timed)
    points = [SpsPoint(batch_tokens=b, steps_per_second=1.0 / s) for b, s in zip(grid, medians, strict=True)]
    return SpsProfile(
        device=current_device_name()
        if engine.device.type != "cuda"
        else torch.cuda.get_device_name(engine.device),
        node_type=node_type(),
        model=engine.model_name,
        dtype=str(engine.dtype).removeprefix("torch."),
        engine={
            "max_batch_tokens": engine.config.max_batch_tokens,
            "max_num_seqs": engine.config.max_num_seqs,
            "context_len": context_len,
            "tokens_per_request": TOKENS_PER_REQUEST,
            "threads": torch.get_num_threads(),
            "forward": forward_kind(engine.runner.forward),
        },
        points=points,
    )


def decode_seconds_by_threads(
    engine, counts: list[int], context_len: int = 256, repeats: int = 12
) -> dict[int, list[float]]:
    """`repeats` timings (seconds) of one request's decode forward at each intra-op thread count in
    `counts`, taken in alternation after two warm-up passes; torch's thread count is restored after."""
    if engine.has_unfinished_requests():
        raise RuntimeError("time an idle engine: requests are running")
    context_len = max(1, min(context_len, engine.max_model_len - 1))
    _fill_context(engine, 1, context_len)
    tokens, batch = _verification_input(engine, [1], context_len)
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        for i in range(repeats + 2):
            for n in counts if i % 2 else reversed(counts):
                torch.set_num_threads(n)
                seconds = _forward_seconds(engine, tokens, batch)
                if i >= 2:
                    times[n].append(seconds)
    finally:
        torch.set_num_threads(before)
    return times


def _fill_context(engine, requests: int, context_len: int) -> None:
    """Write `context_len` tokens of K/V into the first slots in chunks of the batch budget."""
    chunk = engine.config.max_batch_tokens
    for start in range(0, context_len, chunk):
        n = min(chunk, context_len - start)
        for slot in range(requests):
            tokens = torch.randint(0, engine.model.config.vocab_size, (n,), device=engine.device)
            batch = ForwardBatch.build([slot], [start], [n], [n - 1], engine.device)
            engine.model(tokens, batch, engine.cache)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
