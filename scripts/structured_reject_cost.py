"""What speculation costs a structured request when its grammar forbids every draft: wall time of
plain constrained decoding, of speculative constrained decoding under an adversarial drafter (the
shipped drafter's work, each proposed token then replaced by one the grammar never allows), and
that drafter's own time, side by side. Without the forward cut at the first forbidden draft, the
verification forward carries every rejected draft; the last variant shows that for comparison. The variants run in lockstep, one step each in turn.

Usage: python scripts/structured_reject_cost.py [--requests 8] [--max-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from unittest import mock

import torch
from dspark.builder import engine_from_config, sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine import drafting
from dspark.engine.config import EngineConfig
from dspark.engine.drafter import DraftBlock, Drafter, WrappingDrafter
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.prompt import encode_prompt
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.sampling_params import SamplingParams, StructuredOutput
from dspark.policies.factory import build_policy

# Compact JSON of integers only: no whitespace and no letters past the one key, so " Paris" never fits.
SCHEMA = {
    "type": "object",
    "properties": {
        "numbers": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 24,
            "maxItems": 24,
        }
    },
    "required": ["numbers"],
    "additionalProperties": False,
}
FORBIDDEN_TEXT = " Paris"


class ForbiddenDrafter(WrappingDrafter):
    """The inner drafter's proposal, every token replaced by `token` (one-hot drafts); `seconds`
    sums the inner drafter's own time (proposals and context commits)."""

    def __init__(self, inner: Drafter, token: int) -> None:
        super().__init__(inner)
        self.token = token
        self.seconds = 0.0

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        started = time.perf_counter()
        block = self.inner.propose(requests, sampling, horizon)
        tokens = torch.full_like(block.tokens, self.token)
        self.seconds += time.perf_counter() - started
        return DraftBlock(tokens, None, block.confidences, block.num_valid)

    def commit(self, requests: Sequence[Request], features: Sequence[torch.Tensor | None]) -> None:
        started = time.perf_counter()
        self.inner.commit(requests, features)
        self.seconds += time.perf_counter() - started


def lockstep(engines: dict[str, tuple[LLMEngine, Callable]], prompt: list[int], params, n: int) -> dict:
    """n requests on each engine, stepped in turn (one step each, round-robin), so that changes in
    the machine's load hit every variant alike. Per variant: step, forward and drafter seconds,
    steps, outputs, drafts verified and accepted. Each engine steps under its context manager."""
    tracked = {}
    for name, (engine, _) in engines.items():
        for _ in range(n):
            engine.add_request(prompt, params)
        tracked[name] = list(engine.requests.values())
    totals = {name: {"wall_s": 0.0, "forward_s": 0.0, "steps": 0} for name in engines}
    for engine, _ in engines.values():
        if isinstance(engine.drafter, ForbiddenDrafter):
            engine.drafter.seconds = 0.0
    while any(engine.has_unfinished_requests() for engine, _ in engines.values()):
        for name, (engine, context) in engines.items():
            if not engine.has_unfinished_requests():
                continue
            with context():
                started = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - started
            stats, t = engine.last_step_stats, totals[name]
            t["wall_s"] += wall
            t["forward_s"] += stats.forward_time_s
            t["steps"] += 1
    for name, requests in tracked.items():
        drafter = engines[name][0].drafter
        totals[name]["draft_s"] = drafter.seconds if isinstance(drafter, ForbiddenDrafter) else 0.0
        totals[name]["tokens"] = [list(r.output_token_ids) for r in requests]
        totals[name]["draft_tokens"] = sum(r.stats.draft_tokens for r in requests)
        totals[name]["accepted_tokens"] = sum(r.stats.accepted_tokens for r in requests)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", default="dspark", help="the drafter whose work the adversary does")
    parser.add_argument("--verify", type=int, default=4, help="static verify length of the adversary")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    base = engine_from_config(
        EngineConfig(
            target=args.target,
            drafter=args.drafter,
            policy="none",
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=args.requests,
            prefix_caching=False,  # repeated runs must prefill as the first one did
        )
    )
    tok = base.tokenizer
    (forbidden,) = tok.encode(FORBIDDEN_TEXT, add_special_tokens=False)
    prompt = encode_prompt(tok, "Write 24 numbers between 0 and 999 as JSON.")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        structured=StructuredOutput(kind="json_schema", value=json.dumps(SCHEMA)),
    )
    plain = sibling_engine(base, NoDrafter(), build_policy("none"))
    adversary = ForbiddenDrafter(base.drafter.fresh_copy(), forbidden)
    spec = sibling_engine(base, adversary, build_policy(f"static:{args.verify}"))
    uncut_adversary = ForbiddenDrafter(base.drafter.fresh_copy(), forbidden)
    spec_uncut = sibling_engine(base, uncut_adversary, build_policy(f"static:{args.verify}"))

    def uncut():  # the forward carries every verified draft, as before the cut
        return mock.patch.object(
            drafting, "cut_at_grammars", lambda decodes, tokens, lengths: (lengths, lengths)
        )

    engines = {
        "plain": (plain, contextlib.nullcontext),
        "speculative": (spec, contextlib.nullcontext),
        "speculative, no cut": (spec_uncut, uncut),
    }
    lockstep(engines, prompt, params, args.requests)  # warm-up: first-call costs, llguidance's tokenizer view
    rounds = [lockstep(engines, prompt, params, args.requests) for _ in range(args.repeats)]
    results = {name: [r[name] for r in rounds] for name in engines}

    reference = results["plain"][0]["tokens"]
    for name, runs in results.items():
        for r in runs:
            assert r["tokens"] == reference, f"{name}: output differs from plain constrained decoding"
            if name != "plain":
                assert r["draft_tokens"] > 0 and r["accepted_tokens"] == 0, (name, r["accepted_tokens"])
    print(
        f"{args.target} {args.dtype} on {args.device}, threads {torch.get_num_threads()}, "
        f"{args.requests} requests x {len(reference[0])} tokens, adversary: {args.drafter} drafter's "
        f"work, every token {FORBIDDEN_TEXT!r}, static:{args.verify}"
    )
    print("| variant | run | steps s | forward s | drafter s | steps | drafts verified |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        for i, r in enumerate(runs, 1):
            print(
                f"| {name} | {i} | {r['wall_s']:.3f} | {r['forward_s']:.3f} | {r['draft_s']:.3f} "
                f"| {r['steps']} | {r['draft_tokens']} |"
            )
    for i in range(args.repeats):
        a, b = results["plain"][i], results["speculative"][i]
        bound = a["wall_s"] + b["draft_s"]
        verdict = "within" if b["wall_s"] <= bound else "over"
        print(
            f"run {i + 1}: speculative {b['wall_s']:.3f} s vs plain + draft {a['wall_s']:.3f} + "
            f"{b['draft_s']:.3f} = {bound:.3f} s: {verdict}"
        )


if __name__ == "__main__":
    main()
