"""Held-out eval prompts load from the installed packages; bench and calibration splits are disjoint."""

from __future__ import annotations

import pytest
from dspark.prompts.eval_sets import EVAL_DOMAINS, load_eval_prompts

SIZES = {"math": 1319, "code": 164, "chat": 80}


@pytest.mark.parametrize("domain", EVAL_DOMAINS)
def test_domain_loads_and_splits(domain):
    everything = load_eval_prompts(domain)
    assert len(everything) == SIZES[domain] and all(p.strip() for p in everything)
    bench, calibration = (
        load_eval_prompts(domain, split="bench"),
        load_eval_prompts(domain, split="calibration"),
    )
    assert len(bench) + len(calibration) == len(everything)
    assert not set(bench) & set(calibration)
    assert load_eval_prompts(domain, 5, "bench") == bench[:5]


def test_prompt_content():
    assert load_eval_prompts("math", 1)[0].startswith("Janet’s ducks lay 16 eggs per day.")
    code = load_eval_prompts("code", 1)[0]
    assert code.startswith("Complete the following Python function.") and "def has_close_elements" in code
    # Any 8 consecutive MT-Bench prompts of a split cover all 8 categories (writing, roleplay, ...).
    chat_bench = load_eval_prompts("chat", 8, "bench")
    assert any("travel blog" in p for p in chat_bench) and len(set(chat_bench)) == 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown evaluation domain 'poetry'"):
        load_eval_prompts("poetry")
    with pytest.raises(ValueError, match="unknown split"):
        load_eval_prompts("math", split="train")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit must be positive"):
        load_eval_prompts("math", 0)
