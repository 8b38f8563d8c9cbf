"""Choose the training prompts: load sources, drop evaluation overlaps and duplicates, sample per domain."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from dspark.training.config import DataConfig
from dspark.training.decontaminate import EvalSets, OverlapFilter, normalise
from dspark.training.sources import DOMAINS, Prompt, load_source

log = logging.getLogger(__name__)

PROMPTS_FILE = "prompts.jsonl"
OVERLAP_FILE = "overlap.json"


class NoUsableData(ValueError):
    """The configured sources yield nothing to train on."""


class PromptFilter:
    """Drops duplicates (by normalised text) and prompts overlapping an evaluation set; `report`
    says what it removed and which evaluation sets it checked."""

    def __init__(self, decontaminate: bool, require_eval_sets: bool, ngram: int) -> None:
        sets = EvalSets.installed() if decontaminate else EvalSets()
        if decontaminate and sets.missing:
            message = f"evaluation sets not installed, overlap with them is not checked: {sets.missing}"
            if require_eval_sets:
                raise NoUsableData(message)
            log.warning(message)
        self._overlap = OverlapFilter(sets.prompts, n=ngram)
        self._seen: set[str] = set()
        self.report: dict = {
            "eval_sets": {name: len(p) for name, p in sets.prompts.items()},
            "missing_eval_sets": sets.missing,
            "ngram": ngram,
            "dropped": {},
            "examples": [],
            "duplicates": 0,
            "too_long": 0,
        }

    def admit(self, text: str) -> bool:
        key = normalise(text)
        if key in self._seen:
            self.report["duplicates"] += 1
            return False
        self._seen.add(key)
        hit = self._overlap.match(text)
        if hit is not None:
            self.report["dropped"][hit] = self.report["dropped"].get(hit, 0) + 1
            if len(self.report["examples"]) < 20:
                self.report["examples"].append({"eval_set": hit, "prompt": text[:200]})
            return False
        return True


def select_prompts(cfg: DataConfig, tokenizer, encode) -> tuple[list[dict], dict]:
    """Prompts (dicts with text, domain, source, prompt_ids; raw-text ones also response_ids) and
    an overlap report. Self-distillation prompts come first, then the raw-text ones.

    `encode(tokenizer, text)` gives the chat-templated prompt ids; prompts longer than
    `max_prompt_tokens` are skipped (long ShareGPT pastes would dominate the budget).
    """
    admitted = PromptFilter(cfg.decontaminate, cfg.require_eval_sets, cfg.ngram)
    report = admitted.report
    rng = random.Random(cfg.seed)
    chosen: list[dict] = []
    specs = [(spec, False) for spec in cfg.sources] + [(spec, True) for spec in cfg.raw_text]
    eos = tokenizer.eos_token_id
    for spec, raw in specs:
        unknown = set(spec.domains) - set(DOMAINS)
        if unknown:
            raise ValueError(f"source {spec.source}: unknown domains {sorted(unknown)}; expected {DOMAINS}")
        by_domain: dict[str, list[Prompt]] = {d: [] for d in DOMAINS}
        for prompt in load_source(spec.source):
            by_domain[prompt.domain].append(prompt)
        for domain, wanted in spec.domains.items():
            pool = by_domain[domain]
            rng.shuffle(pool)
            taken = 0
            for prompt in pool:
                if taken >= wanted:
                    break
                if raw and not prompt.response:
                    continue
                if not admitted.admit(prompt.text):
                    continue
                ids = encode(tokenizer, prompt.text)
                if len(ids) > cfg.max_prompt_tokens:
                    report["too_long"] += 1
                    continue
                row = {"text": prompt.text, "domain": domain, "source": prompt.source, "prompt_ids": ids}
                if raw:
                    response = tokenizer.encode(prompt.response, add_special_tokens=False)
                    if len(response) < cfg.max_new_tokens and eos is not None:
                        response = [*response, eos]
                    row["response_ids"] = response[: cfg.max_new_tokens]
                    row["source"] = f"{prompt.source}:raw"
                chosen.append(row)
                taken += 1
            if taken < wanted:
                log.warning(
                    "source %s domain %s: only %d of %d prompts usable", spec.source, domain, taken, wanted
                )
    if not chosen:
        raise NoUsableData(
            "no usable training prompts: every configured source/domain was empty, overlapped the "
            "evaluation sets or exceeded max_prompt_tokens"
        )
    report["selected"] = {d: sum(1 for c in chosen if c["domain"] == d) for d in DOMAINS}
    return chosen, report


def write_prompts(data_dir: Path, prompts: list[dict], report: dict) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / PROMPTS_FILE, "w") as f:
        for row in prompts:
            f.write(json.dumps(row) + "\n")
    (data_dir / OVERLAP_FILE).write_text(json.dumps(report, indent=2) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
