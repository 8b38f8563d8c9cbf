"""Where an engine step's time goes: step and forward times and kernels (computing operators) per
step for each policy and concurrency, and a torch.profiler table of the busiest operators at the
highest concurrency.

Usage: python scripts/step_profile.py --device cuda --out runs/gpu/steps [--target DIR_OR_NAME] [--warm-steps N]
  [--no-cuda-graphs]   (CUDA graphs are on by default on CUDA: compare the two)
  [--single-key-bucket]   (graphs attend over all of max_model_len, not the shortest key-length
                           bucket that holds the batch's contexts: what key buckets save)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dspark.builder import engine_from_config, sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine import llm_engine
from dspark.engine.config import EngineConfig
from dspark.engine.sampling_params import SamplingParams
from dspark.models.compiled_forward import CompiledForward
from dspark.policies.factory import build_policy
from dspark.profiling.operators import OperatorCount
from dspark.profiling.profiler import sync
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", default="dspark")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=8,
        help="steps before timing: past the prefill; more grow the contexts",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/gpu/steps"))
    parser.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=None, help="default: on for CUDA"
    )
    parser.add_argument(
        "--single-key-bucket", action="store_true", help="one key-length bucket: max_model_len"
    )
    args = parser.parse_args()
    if args.single_key_bucket:
        llm_engine.key_buckets = lambda max_len: (max_len,)
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    base = engine_from_config(
        EngineConfig(
            target=args.target,
            drafter=args.drafter,
            policy="none",
            device=args.device,
            max_num_seqs=max(levels),
            max_batch_tokens=2048,
            max_model_len=1024,
            cuda_graphs=args.cuda_graphs,
        )
    )
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    prompt = base.tokenizer.encode("Hello there, how are you doing today? " * 3)
    results = {}
    for policy in ("none", "full"):
        for c in levels:
            drafter = NoDrafter() if policy == "none" else base.drafter
            engine = sibling_engine(base, drafter, build_policy(policy), max_num_seqs=c)
            for _ in range(c):
                engine.add_request(prompt, params)
            for _ in range(args.warm_steps):
                engine.step()
            sync(base.device)
            start, forward = time.perf_counter(), 0.0
            for _ in range(args.steps):
                engine.step()
                forward += engine.last_step_stats.forward_time_s
            sync(base.device)
            step = (time.perf_counter() - start) / args.steps
            if c == levels[-1]:
                _profile(engine, base.device, args.out / f"ops-{policy}.txt")
            with OperatorCount() as ops, _eager_forward(engine):
                engine.step()
            captured = engine.static_runner is not None and engine.static_runner.graphs.num_graphs > 0
            results[f"{policy}@{c}"] = {
                "cuda_graphs": captured,
                "key_buckets": list(engine.static_runner.key_lens) if engine.static_runner else None,
                "step_ms": step * 1e3,
                "forward_ms": forward / args.steps * 1e3,
                "kernels_per_step": ops.computing,
            }
            print(policy, c, results[f"{policy}@{c}"], flush=True)
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
    (args.out / "steps.json").write_text(json.dumps(results, indent=1))


@contextmanager
def _eager_forward(engine) -> Iterator[None]:
    """The target's eager forward: operators are counted under a dispatch mode, which a compiled
    forward refuses (and dynamo then skips its frames for good)."""
    runner = engine.runner
    compiled = runner.forward
    if isinstance(compiled, CompiledForward):
        runner.forward = compiled.model
    try:
        yield
    finally:
        runner.forward = compiled


def _profile(engine, device, path: Path) -> None:
    """The busiest operators of five steps, by self CPU time."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
        sync(device)
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
