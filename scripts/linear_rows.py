"""What verifying more rows costs on the CPU: the time of one forward's linear layers at M rows.

SmolLM2-135M's shapes (30 layers of fused QKV, output, gate-up and down projections, and the LM
head), random weights, best of 5. Every layer has weights of its own, as in the model: a forward
streams all of them from memory, so one layer's weights reused 30 times (in cache) would
understate the cost. `packed` is oneDNN's pre-packed kernel (`PackedLinear` at 2 or
more rows, and at one bf16 row), `dense` is F.linear over an [in, out] copy (`PackedLinear` at one
fp32 row).

Usage: python scripts/linear_rows.py [--threads 1] [--rows 1,2,3,4,6,8,12,16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate-up, down
HEAD = (576, 49152)


def _weights(in_f: int, out_f: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(out_f, in_f, dtype=dtype)
    return w.t().contiguous().t(), torch.ops.mkldnn._reorder_linear_weight(w, 16)


def forward_ms(rows: int, kind: str, layers, head, reps: int = 5) -> float:
    dtype = head[0].dtype
    xs = [torch.randn(rows, i, dtype=dtype) for i, _ in SHAPES]
    xh = torch.randn(rows, HEAD[0], dtype=dtype)

    def linear(x, pair):
        if kind == "dense":
            return F.linear(x, pair[0])
        return torch.ops.mkldnn._linear_pointwise(x, pair[1], None, "none", [], "")

    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for weights in layers:
            for x, pair in zip(xs, weights, strict=True):
                linear(x, pair)
        linear(xh, head)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layers = [[_weights(i, o, dtype) for i, o in SHAPES] for _ in range(LAYERS)]
    head = _weights(*HEAD, dtype)
    print(f"{args.threads} thread(s), {args.dtype}; linear layers of one forward, ms")
    print("| rows | dense | packed | dense / packed |\n|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        dense, packed = forward_ms(rows, "dense", layers, head), forward_ms(rows, "packed", layers, head)
        print(f"| {rows} | {dense:.1f} | {packed:.1f} | {dense / packed:.2f} |", flush=True)


if __name__ == "__main__":
    main()
