"""`bench decode`'s summary: ratios paired per prompt, so the machine's drift between prompts
(and, with mirrored repeats, within one) does not show up as a difference between systems."""

from __future__ import annotations

import pytest
from dspark.bench.decode import Measurement, summarize


def _runs(slowdown_per_run: float) -> list[Measurement]:
    """Two systems, the spec one 1.2x faster at the same speed, two prompts, mirrored repeats
    (plain, spec, spec, plain) on a machine whose step time grows by `slowdown_per_run` each run."""
    runs, speed = [], 1.0
    for prompt, base_seconds in enumerate([1.0, 4.0]):  # a short and a long prompt
        for system in ("engine plain", "engine spec", "engine spec", "engine plain"):
            seconds = base_seconds * speed / (1.2 if system == "engine spec" else 1.0)
            runs.append(Measurement(system, "chat", 100, seconds, 1.0, prompt))
            speed += slowdown_per_run
    return runs


def _row(rows: list[dict], system: str, domain: str = "chat") -> dict:
    return next(r for r in rows if r["system"] == system and r["domain"] == domain)


def test_paired_ratio_recovers_the_speedup_despite_linear_drift() -> None:
    rows = summarize(_runs(0.0))
    assert _row(rows, "engine spec")["vs_engine_plain"] == pytest.approx(1.2, abs=1e-3)
    drifting = summarize(_runs(0.3))  # +30% of the first run's time every run
    assert _row(drifting, "engine spec")["vs_engine_plain"] == pytest.approx(1.2, abs=1e-3)
    assert _row(drifting, "engine plain")["vs_engine_plain"] == 1.0
    assert _row(drifting, "engine spec", "all")["vs_hf_plain"] is None  # HF not run


def test_ratio_is_the_median_of_per_prompt_ratios_not_a_ratio_of_medians() -> None:
    plain = [100.0, 50.0, 10.0]
    spec = [60.0, 100.0, 20.0]  # per prompt: 0.6x, 2x, 2x; medians 60 / 50 = 1.2x
    runs = [
        Measurement(system, "math", 100, 100 / rate, 1.0, prompt)
        for system, rates in (("engine plain", plain), ("engine spec", spec))
        for prompt, rate in enumerate(rates)
    ]
    assert _row(summarize(runs), "engine spec", "math")["vs_engine_plain"] == pytest.approx(2.0)


def test_median_tokens_per_s_is_over_prompts_each_over_its_repeats() -> None:
    rows = summarize(_runs(0.0))
    assert _row(rows, "engine plain")["median_tokens_per_s"] == pytest.approx((100 + 25) / 2)
