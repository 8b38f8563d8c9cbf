"""What the defaults cost where drafting does not pay: closed loops of plain decoding (twice: the
noise floor), of the shipped DSpark drafter under policy `none` (features kept for it, nothing
drafted) and of the defaults, stepped in turn as `dspark bench serve` steps its policies, so that
the machine's drift falls on all alike. Prints each loop's tokens/s over its own steps' time and
its ratio to plain.

    python scripts/closed_gate_cost.py --concurrency 16
"""

from __future__ import annotations

import argparse

from dspark.bench.serve import ClosedLoop, output_lengths, policy_engine, run_closed_loop, run_lockstep
from dspark.builder import engine_from_config, sibling_engine
from dspark.engine.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.prompt import encode_prompt
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy
from dspark.prompts.builtin import BUILTIN_PROMPTS


def engines(base: LLMEngine, concurrency: int) -> dict[str, LLMEngine]:
    """Each with a drafter of its own (`policy_engine`): a shared one would charge one loop for
    context another queued."""
    defaults = build_policy("dspark", sps=base.policy.sps.prior, settings=base.config.policy_settings)
    features_kept = sibling_engine(
        base, base.drafter.fresh_copy(), build_policy("none"), max_num_seqs=concurrency
    )
    return {
        "plain": policy_engine(base, "none", build_policy("none"), concurrency),
        "plain (twin)": policy_engine(base, "none", build_policy("none"), concurrency),
        "features kept": features_kept,
        "defaults": policy_engine(base, "dspark", defaults, concurrency),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="finished requests per loop")
    parser.add_argument("--max-tokens", type=int, default=128, help="mean output length")
    args = parser.parse_args()

    base = engine_from_config(EngineConfig(target="smollm2-135m", max_num_seqs=args.concurrency))
    base.wait_for_background_build()
    prompts = [encode_prompt(base.tokenizer, p) for d in ("code", "chat", "math") for p in BUILTIN_PROMPTS[d]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    lengths = output_lengths(args.max_tokens, 0.5)
    c = args.concurrency
    running = engines(base, c)
    for engine in running.values():  # unmeasured: the policy learns its costs at this load
        run_closed_loop(engine, prompts, c, c, params, lengths)
    loops = [
        ClosedLoop(engine, prompts, c, args.requests, params, f"{i}-", lengths, name)
        for i, (name, engine) in enumerate(running.items())
    ]
    points = run_lockstep(loops)
    plain = points[0].aggregate_tokens_per_s
    print(f"{base.drafter.name} drafter, {base.dtype}, {c} requests in flight")
    print("| loop | tokens/s | vs plain | drafted share of decode steps |")
    print("|---|---|---|---|")
    for p in points:
        print(
            f"| {p.policy} | {p.aggregate_tokens_per_s:.1f} | {p.aggregate_tokens_per_s / plain:.3f} | {p.drafted_share:.3f} |"
        )


if __name__ == "__main__":
    main()
