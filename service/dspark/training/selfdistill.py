"""Self-distillation: the target's own responses to the training prompts, generated in batches.

Responses are appended to `samples.jsonl` a few engine batches at a time, so an interrupted run
continues where it stopped. A fixed share of prompts (`greedy_fraction`) is answered greedily and
the rest sampled at `temperature` with a per-prompt seed: evaluation happens at both T=0 and T=1,
and the TV loss supervises the whole target distribution at every position either way, so the
mix only decides which trajectories (contexts) the drafter sees.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from dspark.training.config import DataConfig
from dspark.training.prompts import read_jsonl
from tqdm import tqdm

SAMPLES_FILE = "samples.jsonl"


def sampling_for(index: int, cfg: DataConfig) -> tuple[float, int]:
    """(temperature, seed) of prompt `index`: deterministic in the data seed."""
    rng = random.Random(cfg.seed * 1_000_003 + index)
    temperature = 0.0 if rng.random() < cfg.greedy_fraction else cfg.temperature
    return temperature, cfg.seed * 1_000_003 + index


def generate_samples(
    engine, prompts: list[dict], cfg: DataConfig, data_dir: Path, progress: bool = True
) -> int:
    """Generate responses for prompts not yet in samples.jsonl; returns the number of samples written."""
    from dspark.engine.sampling_params import SamplingParams

    path = data_dir / SAMPLES_FILE
    done = len(read_jsonl(path)) if path.is_file() else 0
    bar = tqdm(total=len(prompts), initial=done, desc="self-distill", unit="prompt", disable=not progress)
    start = time.perf_counter()
    new_tokens = 0
    # Several engine batches per call: the engine refills finished slots from the queue, so short
    # responses do not leave the batch idle while the longest one finishes.
    chunk = 4 * cfg.generation_batch
    with open(path, "a") as out:
        for first in range(done, len(prompts), chunk):
            batch = prompts[first : first + chunk]
            params = []
            for i in range(first, first + len(batch)):
                temperature, seed = sampling_for(i, cfg)
                params.append(
                    SamplingParams(temperature=temperature, seed=seed, max_tokens=cfg.max_new_tokens)
                )
            results = engine.generate([p["prompt_ids"] for p in batch], params)
            for i, (prompt, result, sp) in enumerate(zip(batch, results, params, strict=True)):
                row = {
                    "index": first + i,
                    "domain": prompt["domain"],
                    "source": prompt["source"],
                    "temperature": sp.temperature,
                    "prompt_ids": prompt["prompt_ids"],
                    "response_ids": result.token_ids,
                    "finish_reason": result.finish_reason,
                }
                out.write(json.dumps(row) + "\n")
                new_tokens += len(result.token_ids)
            out.flush()
            bar.update(len(batch))
            elapsed = time.perf_counter() - start
            bar.set_postfix(tok_s=f"{new_tokens / max(elapsed, 1e-9):.0f}")
    bar.close()
    return len(prompts)
