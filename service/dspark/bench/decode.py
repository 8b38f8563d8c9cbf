"""`dspark bench decode`: this engine (plain, n-gram) vs. HF transformers generate() on the same prompts."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspark.builder import engine_from_config, sibling_engine
from dspark.drafters.factory import load_drafter
from dspark.engine.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy


@dataclass
class Measurement:
    system: str
    domain: str
    tokens: int
    seconds: float
    tau: float
    prompt: int = 0  # index of the prompt within the run, to pair systems on the same prompt

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def time_engine(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> tuple[int, float, float]:
    start = time.perf_counter()
    result = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return len(result.token_ids), time.perf_counter() - start, result.stats.tau


def time_hf(model, prompt_ids: list[int], max_tokens: int, eos_ids, lookup: int | None) -> tuple[int, float]:
    ids = torch.tensor([prompt_ids], device=model.device)
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=next(iter(eos_ids)),
            **kwargs,
        )
    return out.shape[1] - ids.shape[1], time.perf_counter() - start


def run_decode_bench(
    config: EngineConfig,
    prompts: dict[str, list[str]],
    max_tokens: int,
    lookup: int,
    include_hf: bool = True,
    progress=None,
    repeats: int = 2,
) -> list[Measurement]:
    """Every system on every prompt at batch 1, greedy, `repeats` times per prompt in mirrored
    order (A B C, C B A, ...): this machine's speed drifts by tens of percent within seconds,
    and a mirrored pair cancels a drift that is linear over the pair."""
    from transformers import AutoModelForCausalLM

    from dspark.engine.prompt import encode_prompt
    from dspark.models.pull import resolve_target

    # One load of the target (and of the --drafter with its policy and SPS profile, resolved by
    # engine_from_config); every system is a sibling over it, and `base` itself never steps.
    base = engine_from_config(config)
    plain = sibling_engine(base, load_drafter("none", base.model.config, base.device), build_policy("none"))
    systems = {
        "engine plain": plain,
        f"engine ngram (static:{lookup})": sibling_engine(
            plain,
            load_drafter("ngram", plain.model.config, plain.device, gamma=config.gamma),
            build_policy(f"static:{lookup}"),
        ),
    }
    if base.config.drafter not in ("none", "ngram"):
        name = f"engine {Path(base.config.drafter).name} ({base.config.policy})"
        systems[name] = sibling_engine(base, base.drafter, base.policy)
    hf = None
    if include_hf:
        hf = (
            AutoModelForCausalLM.from_pretrained(resolve_target(config.target), dtype=plain.dtype)
            .to(plain.device)
            .eval()
        )
    warm = encode_prompt(plain.tokenizer, "Hello")
    for engine in systems.values():
        time_engine(engine, warm, 8)
    if hf is not None:
        time_hf(hf, warm, 8, plain.eos_ids, None)

    runners = {
        name: (lambda ids, e=engine: time_engine(e, ids, max_tokens)) for name, engine in systems.items()
    }
    if hf is not None:
        for name, k in (("HF generate plain", None), (f"HF generate prompt-lookup {lookup}", lookup)):
            runners[name] = lambda ids, k=k: (*time_hf(hf, ids, max_tokens, plain.eos_ids, k), 1.0)
    results: list[Measurement] = []
    order = list(runners)
    flat = [(domain, text) for domain, texts in prompts.items() for text in texts]
    for index, (domain, text) in enumerate(flat):
        ids = encode_prompt(plain.tokenizer, text)
        for repeat in range(repeats):
            for name in order if repeat % 2 == 0 else reversed(order):
                n, s, tau = runners[name](ids)
                results.append(Measurement(name, domain, n, s, tau, index))
        if progress:
            progress(1)
    return results


def summarize(results: list[Measurement]) -> list[dict]:
    """Per system and domain: median tokens/s over prompts; the median over prompts of its paired
    ratio to HF plain (None when HF was not run) and to engine plain, each prompt's ratio taken
    over all its repeats (the same tokens, so the ratio of total times)."""
    rows = []
    domains = sorted({m.domain for m in results})
    systems = list(dict.fromkeys(m.system for m in results))
    for domain in [*domains, "all"]:
        picked = [m for m in results if domain in ("all", m.domain)]
        rates = _per_prompt_rates(picked)
        for s in systems:
            mine = rates[s]
            taus = [m.tau for m in picked if m.system == s]
            rows.append(
                {
                    "domain": domain,
                    "system": s,
                    "median_tokens_per_s": round(statistics.median(mine.values()), 2),
                    "vs_hf_plain": _paired(mine, rates.get("HF generate plain")),
                    "vs_engine_plain": _paired(mine, rates["engine plain"]),
                    "median_tau": round(statistics.median(taus), 3),
                }
            )
    return rows


def _per_prompt_rates(results: list[Measurement]) -> dict[str, dict[int, float]]:
    """system -> prompt -> tokens/s over all its repeats of that prompt."""
    totals: dict[str, dict[int, list[float]]] = {}
    for m in results:
        tokens_seconds = totals.setdefault(m.system, {}).setdefault(m.prompt, [0.0, 0.0])
        tokens_seconds[0] += m.tokens
        tokens_seconds[1] += m.seconds
    return {s: {p: t / sec for p, (t, sec) in per.items()} for s, per in totals.items()}


def _paired(rates: dict[int, float], base: dict[int, float] | None) -> float | None:
    if not base:
        return None
    return round(statistics.median(rates[p] / base[p] for p in rates), 3)


def write_report(results: list[Measurement], rows: list[dict], meta: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": meta,
        "summary": rows,
        "runs": [asdict(m) | {"tokens_per_s": m.tokens_per_second} for m in results],
    }
    path.write_text(json.dumps(payload, indent=2))


def format_table(rows: list[dict]) -> str:
    header = f"{'domain':6s} {'system':32s} {'tok/s (median)':>14s} {'vs HF plain':>11s} {'vs engine plain':>15s} {'tau':>5s}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['domain']:6s} {r['system']:32s} {r['median_tokens_per_s']:14.1f} "
            f"{'-' if r['vs_hf_plain'] is None else format(r['vs_hf_plain'], '.2f'):>11s} "
            f"{r['vs_engine_plain']:15.2f} {r['median_tau']:5.2f}"
        )
    return "\n".join(lines)
