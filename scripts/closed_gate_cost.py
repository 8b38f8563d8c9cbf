"""What the defaults cost where drafting does not pay: steps of plain decoding, of the shipped
DSpark drafter under policy `none` (features kept for it, nothing drafted) and of the defaults,
each engine with `--requests` greedy requests decoding, stepped in turn so that the machine's drift
falls on all three alike. Prints each engine's median forward, step and wall time per step, and
the paired median difference from plain.

    python scripts/closed_gate_cost.py --requests 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from dspark.builder import engine_from_config, sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy

PROMPT = "Write a long story about a dragon who learns to cook. " * 2


def engines(base: LLMEngine, requests: int) -> dict[str, LLMEngine]:
    defaults = build_policy("dspark", sps=base.policy.sps.prior, settings=base.config.policy_settings)
    return {
        "plain": sibling_engine(base, NoDrafter(), build_policy("none"), max_num_seqs=requests),
        "features kept": sibling_engine(base, base.drafter, build_policy("none"), max_num_seqs=requests),
        "defaults": sibling_engine(base, base.drafter, defaults, max_num_seqs=requests),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150, help="measured steps per engine")
    parser.add_argument("--warmup", type=int, default=40, help="steps per engine before measuring")
    args = parser.parse_args()

    config = EngineConfig(target="smollm2-135m", max_num_seqs=args.requests)
    base = engine_from_config(config)
    base.wait_for_background_build()
    print(
        f"{base.drafter.name} drafter, {torch.get_num_threads()} threads, {base.dtype}, {args.requests} requests"
    )
    params = SamplingParams(max_tokens=args.warmup + args.steps + 8, temperature=0.0, ignore_eos=True)
    prompt = base.tokenizer.encode(PROMPT)
    running = engines(base, args.requests)
    for name, engine in running.items():  # the drafter is shared: request ids must differ
        for i in range(args.requests):
            engine.add_request(prompt, params, request_id=f"{name}-{i}")
    for _ in range(args.warmup):
        for engine in running.values():
            engine.step()
    times = {name: {"forward": [], "step": [], "wall": []} for name in running}
    drafted = dict.fromkeys(running, 0)
    for _ in range(args.steps):
        for name, engine in running.items():
            started = time.perf_counter()
            engine.step()
            times[name]["wall"].append(time.perf_counter() - started)
            stats = engine.last_step_stats
            times[name]["forward"].append(stats.forward_time_s)
            times[name]["step"].append(stats.step_time_s)
            drafted[name] += stats.num_draft_tokens > 0
    plain = times["plain"]["wall"]
    print("| engine | forward ms | step ms | wall ms | wall - plain, paired median ms | drafted steps |")
    print("|---|---|---|---|---|---|")
    for name, t in times.items():
        paired = statistics.median(b - a for a, b in zip(plain, t["wall"], strict=True))
        cells = " | ".join(f"{statistics.median(t[k]) * 1e3:.2f}" for k in ("forward", "step", "wall"))
        print(f"| {name} | {cells} | {paired * 1e3:+.2f} | {drafted[name]} |")


if __name__ == "__main__":
    main()
