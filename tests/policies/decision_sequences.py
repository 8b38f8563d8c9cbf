"""Random step sequences driven through every verify-length policy, and the digest of their decisions.

Each sequence draws its own settings, load and confidences; every step asks the policy how far to
draft, for verify lengths when it drafts (None, NaN or finite confidences), and feeds it the step's
statistics. The decisions (horizon, fallback, lengths) go into a byte stream, hashed per block of
sequences: the fixture holds the digests, so a change in any decision of any step shows as a changed
block. Record with `python -m tests.policies.decision_sequences` (only when a change of decisions is
intended); `tests/policies/test_policy_decisions.py` checks the first block of each policy, and
`python -m tests.policies.decision_sequences --check` every sequence (about a minute).

Only the factory and the `VerifyPolicy` interface are used, so the recording outlives refactorings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import sys
from pathlib import Path

import numpy as np
from dspark.engine.outputs import StepStats
from dspark.engine.policy_spec import PolicySettings
from dspark.policies.factory import build_policy
from dspark.profiling.synthetic import synthetic_profile

FIXTURE = Path(__file__).with_name("data") / "policy_decisions.json"
SEQUENCES, STEPS, BLOCK = 2000, 24, 100  # sequences in all, steps per sequence, sequences per digest
POLICIES = ("none", "full", "static:3", "threshold:0.6", "dspark", "dspark-async")
PROFILE = synthetic_profile(max_batch_tokens=512, fixed_ms=2.0, per_token_us=40.0, tile=64, tile_ms=0.3)


def random_settings(rng: np.random.Generator) -> PolicySettings:
    """Small memories and intervals, so that a short sequence reaches every branch of the gate."""
    return PolicySettings(
        min_gain=float(rng.choice([0.0, 0.01, 0.2])),
        memory_rows=int(rng.integers(1, 24)),
        judge_steps=int(rng.integers(1, 12)),
        explore_every=int(rng.integers(1, 6)),
        reuse_steps=int(rng.integers(1, 4)),
        acceptance_decay=float(rng.choice([0.9, 0.999])),
        sps_refresh_every=int(rng.integers(1, 5)),
    )


def random_confidences(rng: np.random.Generator, rows: int, width: int) -> np.ndarray | None:
    kind = rng.random()
    if kind < 0.05:
        return None
    conf = rng.random((rows, width)) ** float(rng.choice([0.2, 0.5, 1.0, 3.0]))
    conf[rng.random((rows, width)) < 0.05] = 0.0
    if kind < 0.10 and conf.size:
        conf[rng.integers(rows), rng.integers(width)] = rng.choice([np.nan, np.inf])
    return conf


def step_statistics(
    rng: np.random.Generator, num_requests: int, horizon: int, lengths: np.ndarray, conf: np.ndarray | None
) -> StepStats:
    """What an engine would report for the step: timings around the profile's, acceptance below survival."""
    batch = max(num_requests + int(lengths.sum()), 1)
    forward_s = float(rng.uniform(0.7, 1.6)) / float(PROFILE.sps(float(batch)))
    drafted = horizon > 0 and num_requests > 0
    draft_s = float(rng.uniform(2e-4, 4e-3)) * horizon if drafted else 0.0
    predicted, accepted = [], []
    if drafted and conf is not None and np.isfinite(conf).all():
        survival = np.cumprod(np.clip(conf, 0.0, 1.0), axis=1)
        verified = np.arange(survival.shape[1]) < lengths[:, None]
        predicted = np.where(verified, survival, 0.0).sum(axis=0).tolist()
        accepted = [int(rng.binomial(int(verified[:, j].sum()), 0.6)) for j in range(survival.shape[1])]
    return StepStats(
        verify_batch_tokens=batch,
        verify_budgets=lengths.tolist() if drafted else [0] * num_requests,
        drafted=drafted,
        draft_horizon=horizon if drafted else 0,
        draft_time_s=draft_s,
        forward_time_s=forward_s,
        step_time_s=forward_s + draft_s + float(rng.uniform(0.0, 2e-3)),
        predicted_per_position=predicted,
        accepted_per_position=accepted,
    )


def run_sequence(spec: str, seed: int) -> bytes:
    """The decisions of policy `spec` over random step sequence `seed`, as bytes."""
    rng = np.random.default_rng(seed)
    policy = build_policy(spec, sps=PROFILE, settings=random_settings(rng))
    out = bytearray()
    for _ in range(STEPS):
        num_requests, gamma = int(rng.choice([0, 1, 1, 2, 3, 4, 6, 8, 12, 16])), int(rng.integers(1, 8))
        horizon = policy.max_length(gamma, num_requests)
        lengths, conf, fallback = np.zeros(num_requests, dtype=np.int64), None, False
        if horizon > 0 and num_requests > 0:
            conf = random_confidences(rng, num_requests, horizon)
            before = policy.fallbacks
            lengths = policy.verify_lengths(conf, horizon, num_requests).numpy()
            fallback = policy.fallbacks > before
        out += (
            struct.pack("<bbb?", num_requests, gamma, horizon, fallback) + lengths.astype(np.int8).tobytes()
        )
        policy.observe_step(step_statistics(rng, num_requests, horizon, lengths, conf))
    return bytes(out)


def block_digests(spec: str, blocks: range) -> list[str]:
    """SHA-256 of the decisions over each block of `BLOCK` sequences."""
    digests = []
    for block in blocks:
        h = hashlib.sha256()
        for seed in range(block * BLOCK, (block + 1) * BLOCK):
            h.update(run_sequence(spec, seed))
        digests.append(h.hexdigest())
    return digests


def record() -> dict:
    blocks = range(SEQUENCES // BLOCK)
    return {
        "sequences": SEQUENCES,
        "steps": STEPS,
        "block": BLOCK,
        "digests": {spec: block_digests(spec, blocks) for spec in POLICIES},
    }


def changed_blocks(recorded: dict, spec: str, blocks: range) -> list[int]:
    """The blocks of `spec` whose decisions differ from the recording."""
    got = block_digests(spec, blocks)
    return [b for b, digest in zip(blocks, got, strict=True) if digest != recorded["digests"][spec][b]]


def main(argv: list[str]) -> int:
    logging.disable(logging.WARNING)  # the fallback's warnings, thousands of them
    if argv == ["--check"]:  # every sequence (the test checks the first block of each policy)
        recorded = json.loads(FIXTURE.read_text())
        changed = {spec: changed_blocks(recorded, spec, range(SEQUENCES // BLOCK)) for spec in POLICIES}
        for spec, blocks in changed.items():
            print(f"{spec}: {SEQUENCES} sequences, " + (f"blocks {blocks} differ" if blocks else "identical"))
        return 1 if any(changed.values()) else 0
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(record(), indent=1) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
