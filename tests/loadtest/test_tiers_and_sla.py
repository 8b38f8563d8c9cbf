"""Tier files, load shapes, SLA checks and the report, without a server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from dspark.tier_format import SHARED_FIELDS, SlaTier
from dspark_loadtest.report import build_report
from dspark_loadtest.run_state import parse_mix, resolve_tier
from dspark_loadtest.shapes import Stage, stage_at, stages
from dspark_loadtest.sla import evaluate, format_table, summarize
from dspark_loadtest.stream import RequestSample
from dspark_loadtest.tiers import (
    DEFAULT_TIERS_FILE,
    ConstantLoad,
    SpikeLoad,
    StepLoad,
    Tier,
    load_tiers,
)
from dspark_operator.spec import TierSpec

ROOT = Path(__file__).resolve().parents[2]


def chart_tiers(values_path: Path) -> list[dict]:
    """The `example.tiers` list of a chart values file."""
    values = yaml.safe_load(values_path.read_text()) or {}
    return list((values.get("example") or {}).get("tiers") or [])


def tier(**overrides) -> Tier:
    raw = {
        "name": "t",
        "tokensPerSecondPerUser": 20,
        "tokensPerSecondPerUserP10": 10,
        "ttftP95Seconds": 1.0,
        "maxErrorRatio": 0.1,
        "load": {"shape": "constant", "users": 2, "duration": 10},
    }
    return Tier.model_validate({**raw, **overrides})


def sample(
    ttft: float = 0.2,
    tokens: int = 11,
    decode: float = 0.5,
    ok: bool = True,
    cut: bool = False,
    start: float = 0.0,
) -> RequestSample:
    s = RequestSample(
        api="chat",
        domain="math",
        start=start,
        ok=ok,
        cut=cut,
        ttft_s=ttft if ok or cut else None,
        output_tokens=tokens if ok or cut else 0,
        chunks=tokens,
        decode_s=decode if ok or cut else None,
        e2e_s=ttft + decode,
    )
    if ok or cut:
        s.chunk_gaps = [(decode / (tokens - 1), 1)] * (tokens - 1)
    return s


# Tier files ---------------------------------------------------------------------------------------
def test_packaged_tiers_load_and_the_checkout_path_points_at_them():
    tiers = load_tiers()
    assert [t.name for t in tiers.tiers] == ["interactive", "batch", "interactive-spike"]
    assert {type(t.load) for t in tiers.tiers} == {ConstantLoad, StepLoad, SpikeLoad}
    assert (ROOT / "loadtest" / "tiers.yaml").resolve() == DEFAULT_TIERS_FILE.resolve()


def test_shared_fields_agree_with_the_chart_and_the_crd_model():
    """Tiers named as in the chart's example mean the same thing: same targets, same replica bounds."""
    ours = {t["name"]: t for t in yaml.safe_load(DEFAULT_TIERS_FILE.read_text())["tiers"]}
    chart = chart_tiers(ROOT / "charts" / "dspark" / "values.yaml")
    assert chart, "the chart's example tiers are gone"
    for entry in chart:
        assert entry["name"] in ours, f"chart tier {entry['name']!r} has no load-test scenario"
        mine, theirs = TierSpec.model_validate(ours[entry["name"]]), TierSpec.model_validate(entry)
        for field in SHARED_FIELDS:
            assert getattr(mine, _snake(field)) == getattr(theirs, _snake(field)), (entry["name"], field)
    for raw in ours.values():  # every scenario is also a valid CRD tier
        TierSpec.model_validate(raw)


def test_the_load_test_and_the_operator_share_one_tier_format():
    """Both extend `SlaTier` and redefine none of its fields: one definition of targets and bounds."""
    for model in (Tier, TierSpec):
        assert issubclass(model, SlaTier)
        assert not set(model.__annotations__) & set(SlaTier.model_fields), model
    assert set(SHARED_FIELDS) == {
        "tokensPerSecondPerUser",
        "ttftP95Seconds",
        "minReplicas",
        "maxReplicas",
        "priority",
    }


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokensPerSecondPerUserP10": 30}, "exceeds the p50 target"),
        ({"load": {"shape": "constant", "users": 2, "duration": 7200}}, "less than or equal to 3600"),
        ({"load": {"shape": "ramp", "users": 2, "duration": 10}}, "does not match any of the expected tags"),
        ({"workload": {"mix": {"math": 0}}}, "positive sum"),
        ({"workload": {"mix": {"poetry": 1}}}, "poetry"),
        ({"tokensPerSecondPerUser": 0}, "greater than 0"),
        ({"speed": 3}, "Extra inputs are not permitted"),
    ],
)
def test_bad_tiers_are_rejected_with_the_reason(tmp_path, change, message):
    raw = {
        "name": "t",
        "tokensPerSecondPerUser": 20,
        "ttftP95Seconds": 1.0,
        "load": {"shape": "constant", "users": 2, "duration": 10},
        **change,
    }
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml.safe_dump({"tiers": [raw]}))
    with pytest.raises(ValueError, match=message) as e:
        load_tiers(path)
    assert str(path) in str(e.value)


def test_duplicate_names_and_unknown_tier(tmp_path):
    raw = {
        "name": "t",
        "tokensPerSecondPerUser": 20,
        "ttftP95Seconds": 1.0,
        "load": {"shape": "constant", "users": 2, "duration": 10},
    }
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml.safe_dump({"tiers": [raw, raw]}))
    with pytest.raises(ValueError, match="unique"):
        load_tiers(path)
    with pytest.raises(KeyError, match="known: interactive, batch"):
        load_tiers().get("gold")


def test_overrides_are_validated_again():
    tiers = load_tiers()
    t = resolve_tier(tiers, "batch", concurrency=3, seconds=12, api="chat", mix="math=2,code=1", max_tokens=8)
    assert t.load == ConstantLoad(shape="constant", users=3, duration=12)
    assert (
        t.workload.api == "chat"
        and t.workload.mix == {"math": 2.0, "code": 1.0}
        and t.workload.max_tokens == 8
    )
    assert resolve_tier(tiers, "batch", seconds=5).load.users == 32  # the step shape's peak
    assert resolve_tier(tiers, None).name == "interactive"
    with pytest.raises(ValueError, match="domain=weight"):
        parse_mix("math=lots")
    with pytest.raises(ValueError, match="less than or equal to 3600"):
        resolve_tier(tiers, "batch", seconds=10000)


# Load shapes --------------------------------------------------------------------------------------
def test_constant_step_and_spike_stages():
    assert stages(ConstantLoad(shape="constant", users=4, duration=30)) == [Stage(30, 4, 10.0)]
    step = stages(StepLoad(shape="step", startUsers=2, stepUsers=3, stepSeconds=10, maxUsers=7, duration=45))
    assert [(s.until_s, s.users) for s in step] == [(10, 2), (20, 5), (45, 7)]
    spike = stages(
        SpikeLoad(shape="spike", baseUsers=2, spikeUsers=20, spikeAt=10, spikeSeconds=5, duration=30)
    )
    assert [(s.until_s, s.users) for s in spike] == [(10, 2), (15, 20), (30, 2)]
    assert (
        stage_at(spike, 0).users == 2 and stage_at(spike, 12).users == 20 and stage_at(spike, 29.9).users == 2
    )
    assert stage_at(spike, 30) is None  # the run stops by itself


# SLA checks ---------------------------------------------------------------------------------------
def test_summary_uses_exact_percentiles_of_the_raw_samples():
    samples = [sample(ttft=0.1 * i, decode=1.0, tokens=11) for i in range(1, 21)]
    s = summarize(samples)
    assert s.requests == 20 and s.failures == 0 and s.cut == 0
    assert s.ttft_p50_s == pytest.approx(1.05) and s.ttft_p95_s == pytest.approx(1.905)
    assert s.tokens_per_s_p50 == pytest.approx(10.0) and s.tpot_p50_s == pytest.approx(0.1)
    assert s.itl_p50_s == pytest.approx(0.1) and s.output_tokens == 220


def test_checks_pass_and_fail_in_each_direction():
    good = [sample(ttft=0.2, decode=0.25, tokens=11) for _ in range(10)]  # 40 tok/s, TTFT 0.2 s
    assert all(c.passed for c in evaluate(tier(), summarize(good)))

    slow_tail = good[:8] + [sample(decode=2.0, tokens=11)] * 2  # p10 at 5 tok/s < 10
    failed = {c.name for c in evaluate(tier(), summarize(slow_tail)) if not c.passed}
    assert failed == {"tokens/s per user p10"}

    late = good + [sample(ttft=3.0, decode=0.25)]
    assert {c.name for c in evaluate(tier(), summarize(late)) if not c.passed} == {"TTFT p95 (s)"}

    table = format_table("t", evaluate(tier(), summarize(late)))
    assert re.search(r"^TTFT p95 \(s\)\s+<= 1\s+1\.6\s+FAIL$", table, re.M) and table.endswith(
        "verdict: FAIL"
    )


def test_recoverable_errors_pass_below_the_ratio_and_fail_above():
    good = [sample(ttft=0.2, decode=0.25) for _ in range(19)]
    checks = evaluate(tier(), summarize([*good, sample(ok=False)]))  # 1 of 20 = 5% <= 10%
    assert all(c.passed for c in checks)
    checks = evaluate(tier(), summarize([*good[:8], sample(ok=False), sample(ok=False)]))  # 20%
    assert [c.name for c in checks if not c.passed] == ["error ratio"]


def test_no_successful_request_is_a_failure_not_a_pass():
    checks = evaluate(tier(), summarize([]))
    assert not any(c.passed for c in checks if c.name != "error ratio")
    assert not evaluate(tier(maxErrorRatio=1.0), summarize([sample(ok=False)]))[0].passed


def test_cut_requests_count_their_ttft_and_speed_but_not_as_outcomes():
    s = summarize([sample(), sample(ttft=5.0, cut=True), sample(ok=False)])
    assert (s.requests, s.failures, s.cut, s.ttft_count) == (2, 1, 1, 2)
    assert s.ttft_p95_s > 4


def test_report_holds_checks_summary_and_server_view():
    report = build_report(tier(), [sample()], None, "http://127.0.0.1:8000")
    assert report["passed"] and report["tier"]["tokensPerSecondPerUser"] == 20
    assert report["summary"]["tokens_per_s_p50"] == pytest.approx(20.0)
    assert report["server"] is None and report["ttft_agreement"] is None
