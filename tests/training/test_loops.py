"""Looping answers: found where the tail only repeats itself, cut a fixed length into the loop."""

from __future__ import annotations

import random

import pytest
from dspark.training import pipeline
from dspark.training.config import TrainConfig
from dspark.training.loops import loop_start, truncate_loop
from dspark.training.trainer import Trainer

from tests.training.conftest import tiny_config, write_prompts


def _text(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_cycle_after_free_text_is_found_where_it_starts():
    head, cycle = _text(100, 0), _text(13, 1)
    tokens = head + cycle * 20
    start = loop_start(tokens)
    assert start is not None and 100 <= start <= 100 + 13  # its first repeat follows one cycle
    cut = truncate_loop(tokens, keep=32)
    assert cut == tokens[: start + 32]


@pytest.mark.parametrize(
    "tokens",
    [_text(300, 2), _text(100, 3) + _text(9, 4) * 3 + _text(100, 5)],  # free text; a short repeat inside it
)
def test_text_that_does_not_end_in_a_loop_is_kept_whole(tokens):
    assert loop_start(tokens) is None
    assert truncate_loop(tokens) == tokens


def test_a_loop_shorter_than_the_minimum_tail_is_kept():
    tokens = _text(200, 6) + _text(5, 7) * 5  # 25 tokens of repeats: under 32 repeated 8-grams
    assert loop_start(tokens) is None


@pytest.mark.parametrize("loops", ["keep", "truncate"])
def test_the_data_stage_cuts_looping_responses_only_when_asked(tmp_path, tiny_target, monkeypatch, loops):
    raw = tiny_config(tmp_path, tiny_target, "dspark", write_prompts(tmp_path / "p.jsonl", 3))
    raw["data"] = {"corpus": [str(tmp_path)], "loops": loops, "decontaminate": False}
    cfg = TrainConfig.model_validate(raw)
    looping, free = _text(50, 8) + _text(11, 9) * 20, _text(120, 10)
    samples = [{"prompt_ids": [1, 2], "response_ids": r, "domain": "chat"} for r in (looping, free)]
    monkeypatch.setattr(pipeline, "_corpus_samples", lambda *a: [(tmp_path / "f", samples)])
    [(_, got)] = pipeline.collect_samples(cfg, None, None, progress=False)
    expected = truncate_loop(looping) if loops == "truncate" else looping
    assert len(expected) < len(looping) or loops == "keep"
    assert [s["response_ids"] for s in got] == [expected, free]


def test_configs_stored_before_the_kl_and_loops_fields_still_resume(tmp_path, tiny_target):
    raw = tiny_config(tmp_path, tiny_target, "dspark", write_prompts(tmp_path / "p.jsonl", 3))
    now = TrainConfig.model_validate(raw).model_dump(mode="json")
    old = {**now, "loss": dict(now["loss"]), "data": dict(now["data"])}
    del old["loss"]["kl"], old["data"]["loops"]
    assert "kl" not in old["loss"] and "loops" not in old["data"]  # as a run from before them stored it
    assert Trainer._resume_key(old) == Trainer._resume_key(now)
    raw["loss"] = {"kl": 1.0}
    changed = TrainConfig.model_validate(raw).model_dump(mode="json")
    assert Trainer._resume_key(old) != Trainer._resume_key(changed)
