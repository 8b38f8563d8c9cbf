"""Prompt sources, the evaluation-overlap filter and prompt selection."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dspark.training.config import DataConfig
from dspark.training.decontaminate import OverlapFilter
from dspark.training.prompts import NoUsableData, select_prompts
from dspark.training.sources import classify, iter_json_array, load_source

EVAL = {
    "gsm8k-test": ["Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning."],
    "humaneval": ['def add(a, b):\n    """Return the sum of a and b."""'],
}


def test_overlap_filter_exact_and_ngram_matches():
    f = OverlapFilter(EVAL, n=8)
    assert (
        f.match("janet's ducks LAY 16 eggs per day.  She eats three for breakfast every morning")
        == "gsm8k-test"
    )
    # a paraphrase that keeps an 8-word run is still caught
    assert f.match("Question: ducks lay 16 eggs per day she eats three for lunch") == "gsm8k-test"
    assert f.match("def mul(x, y): multiply x by y and give back the product") is None
    assert f.match('def add(a, b):\n    """Return the sum of a and b."""') == "humaneval"
    assert f.match("Write a haiku about autumn leaves.") is None


def test_truncated_json_array_yields_the_complete_records():
    text = json.dumps([{"a": 1}, {"b": 2}, {"c": 3}])[:-8]  # cut inside the last record
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": 2}]


def test_classify_domains():
    assert classify("Write a python function to reverse a list") == "code"
    assert classify("Solve the equation 3x + 5 = 20") == "math"
    assert classify("Tell me about the history of Rome") == "chat"


class _Tok:
    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [len(w) + 2 for w in text.split()]


def _encode(tok, text):
    return tok.encode(text)


def test_selection_drops_eval_overlaps_duplicates_and_long_prompts(tmp_path, monkeypatch):
    rows = [
        {"prompt": EVAL["gsm8k-test"][0], "domain": "math"},
        {"prompt": "How many apples are left if I eat two of five?", "domain": "math"},
        {"prompt": "How many apples are left if I eat two of five?", "domain": "math"},
        {"prompt": "word " * 50, "domain": "chat", "response": "fine"},
        {
            "prompt": "Tell me a story about a lighthouse keeper",
            "domain": "chat",
            "response": "Once upon a time there was a lighthouse keeper who",
        },
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(
        "dspark.training.prompts.EvalSets.installed", classmethod(lambda cls: cls(prompts=EVAL))
    )
    cfg = DataConfig(
        sources=[{"source": f"jsonl:{path}", "domains": {"math": 5}}],
        raw_text=[{"source": f"jsonl:{path}", "domains": {"chat": 5}}],
        max_prompt_tokens=20,
        max_new_tokens=8,
    )
    chosen, report = select_prompts(cfg, _Tok(), _encode)
    assert [c["text"] for c in chosen] == [rows[1]["prompt"], rows[4]["prompt"]]
    assert report["dropped"] == {"gsm8k-test": 1} and report["duplicates"] == 1 and report["too_long"] == 1
    assert "response_ids" not in chosen[0]
    assert chosen[1]["response_ids"] == [6, 6, 3, 6, 7, 5, 3, 12]  # truncated to max_new_tokens, so no eos
    assert chosen[1]["source"].endswith(":raw")


def test_selection_with_nothing_usable_raises(tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": EVAL["gsm8k-test"][0], "domain": "math"}) + "\n")
    monkeypatch.setattr(
        "dspark.training.prompts.EvalSets.installed", classmethod(lambda cls: cls(prompts=EVAL))
    )
    cfg = DataConfig(sources=[{"source": f"jsonl:{path}", "domains": {"math": 5}}])
    with pytest.raises(NoUsableData, match="no usable training prompts"):
        select_prompts(cfg, _Tok(), _encode)


def test_a_missing_source_wheel_names_its_install(monkeypatch):
    from dspark.training.sources import SourceUnavailable

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # the wheel not installed
    with pytest.raises(SourceUnavailable, match=r"'rg-math' is not installed \(pip install reasoning-gym\)"):
        load_source("rg-math")


def test_unknown_source_and_missing_sources_are_refused():
    with pytest.raises(ValueError, match="unknown training source"):
        load_source("wikipedia")
    with pytest.raises(ValueError, match="at least one entry in sources, raw_text or corpus"):
        DataConfig()


_RG_DIGEST = """
import hashlib, json
import dspark.training.sources as sources
sources.RG_MATH_PER_TASK = 12  # every task, few problems each: a second per process
digest = hashlib.sha256()
for p in sources.load_source("rg-math"):
    digest.update(json.dumps([p.source, p.domain, p.text]).encode())
print(digest.hexdigest())
"""


def test_rg_math_prompts_do_not_depend_on_the_hash_seed():
    """The corpus's prompt order must be the same in every process: shard N + 1 may be added on
    another machine. Two hash seeds, as two processes would get by chance."""

    def digest(hash_seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            [sys.executable, "-c", _RG_DIGEST], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    first = digest("1")
    assert len(first) == 64
    assert digest("2") == first
