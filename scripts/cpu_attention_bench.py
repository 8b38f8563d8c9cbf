"""The CPU attention kernel against SDPA: per layer at the engine's shapes, or in the engine.

Usage:
  python scripts/cpu_attention_bench.py [--threads 2] [--rows 16] [--queries 1,5,16] [--keys 141,300,1000]
  python scripts/cpu_attention_bench.py --engine [--requests 16] [--context 141]

Per layer: the kernel called directly (the engine sends it rows of up to MAX_QUERY_ROWS queries)
and SDPA, SmolLM2-135M's heads (9 query, 3 KV, 64 dims) in bf16 over a view of a larger cache, the
median of 5 repeats of 200 calls each, and each result's largest error against fp64. `--engine`
decodes `--requests` requests past `--context` tokens, then alternates 8 steps on each attention
path five times in one process and prints tokens/s: SDPA (`DSPARK_CPU_ATTENTION=sdpa`), the kernel
behind the general path's index_put_ writes and tensor ops, and the kernel's one call a layer
(`cpu_attention.DecodeAttention`, the engine's path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from dspark.models import cpu_attention, forward_batch, transformer
from dspark.models.cpu_attention import short_attention_kernel

HEADS, KV_HEADS, DIM = 9, 3, 64


def timed(fn, calls: int = 200, repeats: int = 5) -> float:
    """Median microseconds per call."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def per_layer(rows: int, queries: list[int], keys: list[int]) -> None:
    print("| query rows | keys | kernel us | SDPA us | kernel max error | SDPA max error |")
    print("|---|---|---|---|---|---|")
    for n in queries:
        for length in keys:
            print("| " + " | ".join(_compare(rows, n, length)) + " |", flush=True)


def _compare(rows: int, n: int, length: int) -> list[str]:
    cache = torch.randn(2, rows + 8, KV_HEADS, length + 64, DIM, dtype=torch.bfloat16)
    k, v = cache[0, 4 : rows + 4, :, :length], cache[1, 4 : rows + 4, :, :length]
    q = torch.randn(rows, n, HEADS, DIM, dtype=torch.bfloat16).transpose(1, 2)
    ends = torch.randint(max(n, length - 60), length + 1, (rows,))
    positions = ends[:, None, None] - n + torch.arange(n)[None, :, None]
    mask = (torch.arange(length)[None, None, :] <= positions)[:, None]
    exact = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True
    )

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    built = short_attention_kernel()
    if built is None:
        raise SystemExit("the CPU attention kernel is unavailable here (see the warning above)")

    def kernel():  # called directly: past MAX_QUERY_ROWS the engine would not take it
        return built.short_attention(q, k, v, mask[:, 0].expand(rows, n, length), DIM**-0.5)

    with torch.inference_mode():
        kernel_us, kernel_err = timed(kernel), (kernel().double() - exact).abs().max().item()
        sdpa_us, sdpa_err = timed(sdpa), (sdpa().double() - exact).abs().max().item()
    return [str(n), str(length), f"{kernel_us:.0f}", f"{sdpa_us:.0f}", f"{kernel_err:.1e}", f"{sdpa_err:.1e}"]


def use_path(mode: str) -> None:
    """Switch the engine's CPU attention path (an ablation: the engine always takes the fastest)."""
    os.environ["DSPARK_CPU_ATTENTION"] = "sdpa" if mode == "sdpa" else "kernel"
    short_attention_kernel.cache_clear()
    one_call = mode == "kernel, one call"
    forward_batch.decode_attention = cpu_attention.decode_attention if one_call else lambda *args: None
    transformer.write_kv = cpu_attention.write_kv if one_call else lambda *args: False


def in_engine(requests: int, context: int) -> None:
    from dspark.builder import engine_from_config
    from dspark.engine.config import EngineConfig
    from dspark.engine.prompt import encode_prompt
    from dspark.engine.sampling_params import SamplingParams

    engine = engine_from_config(EngineConfig(drafter="none", policy="none"))
    prompt = encode_prompt(engine.tokenizer, "Write a long story about a dragon and a knight.")
    params = SamplingParams(max_tokens=context + 200, temperature=0.0, ignore_eos=True)
    for _ in range(requests):
        engine.add_request(list(prompt), params)
    while min((r.num_cached for r in engine.requests.values()), default=0) < context:
        engine.step()
    rates: dict[str, list[float]] = {"sdpa": [], "kernel, general path": [], "kernel, one call": []}
    for _ in range(5):
        for mode, rate in rates.items():
            use_path(mode)
            start, tokens = time.perf_counter(), 0
            for _ in range(8):
                tokens += sum(len(out.new_token_ids) for out in engine.step())
            rate.append(tokens / (time.perf_counter() - start))
    for mode, rate in rates.items():
        print(f"{mode}: median {statistics.median(rate):.1f} tokens/s, rounds {[round(r, 1) for r in rate]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--queries", default="1,5,16")
    parser.add_argument("--keys", default="141,300,1000")
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--context", type=int, default=141)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        in_engine(args.requests, args.context)
    else:
        per_layer(
            args.rows, [int(n) for n in args.queries.split(",")], [int(n) for n in args.keys.split(",")]
        )


if __name__ == "__main__":
    main()
