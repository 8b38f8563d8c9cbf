"""Collecting held-out rounds: one engine over the target, one drafter at a time, policy `full`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dspark.calibration.recording import RecordingDrafter
from dspark.calibration.rounds import RoundLog
from dspark.drafters.checkpoint import SharedWeights
from dspark.drafters.factory import load_drafter
from dspark.engine.config import EngineConfig
from dspark.engine.sampling_params import SamplingParams

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "drafters" / "shipped"


def resolve_drafter_dir(spec: str, target: str) -> Path:
    """A drafter checkpoint directory, or a shipped drafter's name (`dspark`, `dflash`, `eagle3`) for a
    named target, found at `dspark/drafters/shipped/<target>/<name>`."""
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return path
    shipped = SHIPPED_DIR / Path(target).name / spec
    if (shipped / "config.json").is_file():
        return shipped
    raise ValueError(
        f"drafter {spec!r} is neither a checkpoint directory (with config.json) nor a shipped drafter "
        f"of target {target!r} (looked in {shipped})"
    )


def base_engine(target: str, device: str = "auto", dtype: str = "auto"):
    """An engine over the target with no drafter and a minimal KV cache; runs use sibling engines."""
    from dspark.builder import engine_from_config

    config = EngineConfig(
        target=target,
        drafter="none",
        policy="none",
        device=device,
        dtype=dtype,
        max_num_seqs=1,
        max_model_len=16,
    )
    return engine_from_config(config)


def collect_rounds(
    engine,
    checkpoint: str | Path,
    prompts: dict[str, list[list[int]]],
    *,
    temperature: float,
    max_tokens: int,
    gamma: int | None = None,
    seed: int = 0,
    max_num_seqs: int = 8,
    progress: Callable[[int], None] | None = None,
) -> RoundLog:
    """Every prompt decoded to completion with the raw (uncalibrated) drafter, the whole block verified
    each round; request i of a domain samples with seed `seed + i`."""
    from dspark.builder import sibling_engine
    from dspark.calibration.recording import record_rounds
    from dspark.policies.factory import build_policy

    shared = SharedWeights(engine.model.model.embed_tokens.weight, engine.model.lm_head.weight)
    drafter = load_drafter(
        str(checkpoint),
        engine.model.config,
        engine.device,
        engine.dtype,
        shared=shared,
        gamma=gamma,
        calibrated=False,
    )
    recorder = RecordingDrafter(drafter)
    longest = max((len(p) for ps in prompts.values() for p in ps), default=1)
    run = sibling_engine(
        engine,
        recorder,
        build_policy("full"),
        max_num_seqs=max_num_seqs,
        max_model_len=longest + max_tokens + 1,
        max_batch_tokens=max(512, (1 + recorder.gamma) * max_num_seqs),
    )
    return record_rounds(
        run,
        recorder,
        prompts,
        lambda i: SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i),
        progress,
    )


def encode_eval_prompts(tokenizer, domains: list[str], limit: int, split: str) -> dict[str, list[list[int]]]:
    """Held-out prompts of each domain as token ids, through the target's chat template."""
    from dspark.engine.prompt import encode_prompt
    from dspark.prompts.eval_sets import load_eval_prompts

    return {
        d: [encode_prompt(tokenizer, text) for text in load_eval_prompts(d, limit, split)] for d in domains
    }
