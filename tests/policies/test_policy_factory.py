"""`build_policy` spellings and its errors."""

from __future__ import annotations

import math

import pytest
from dspark.drafters.ngram import NoDrafter
from dspark.engine.config import EngineConfig
from dspark.engine.policy_spec import PolicySettings, parse_policy
from dspark.engine.verify_policy import VerifyPolicy
from dspark.policies.baselines import StaticPolicy, ThresholdPolicy
from dspark.policies.dspark import DSparkPolicy
from dspark.policies.factory import build_policy, resolve_policy_spec
from dspark.policies.split import AsyncSplit, SynchronousSplit
from dspark.policies.sps_curve import OnlineSps
from dspark.profiling.synthetic import synthetic_profile

PROFILE = synthetic_profile(max_batch_tokens=256)


@pytest.mark.parametrize(
    ("spec", "cls", "name", "split"),
    [
        ("none", StaticPolicy, "none", None),
        ("full", StaticPolicy, "full", None),
        ("static:4", StaticPolicy, "static:4", None),
        ("threshold:0.6", ThresholdPolicy, "threshold:0.6", None),
        ("dspark", DSparkPolicy, "dspark", SynchronousSplit),
        ("dspark-async", DSparkPolicy, "dspark-async", AsyncSplit),
    ],
)
def test_specs_build_their_policy(spec: str, cls: type, name: str, split: type | None) -> None:
    policy = build_policy(spec, sps=PROFILE)
    assert isinstance(policy, cls) and policy.name == name
    assert split is None or isinstance(policy.split, split)


def test_dspark_policies_refine_a_profile_online_and_accept_a_refined_curve() -> None:
    assert isinstance(build_policy("dspark", sps=PROFILE).sps, OnlineSps)
    online = OnlineSps(PROFILE)
    assert build_policy("dspark-async", sps=online).sps is online


def test_policy_settings_reach_every_part_of_the_dspark_policy() -> None:
    settings = PolicySettings(
        min_gain=0.05,
        memory_rows=8,
        explore_every=5,
        reuse_steps=2,
        draft_cost_alpha=0.5,
        overhead_alpha=0.3,
        acceptance_decay=0.9,
        acceptance_prior_tokens=1.0,
        sps_alpha=0.02,
        sps_prior_weight=2.0,
        sps_max_jump=3.0,
        sps_refresh_every=4,
        sps_drift_alpha=0.2,
    )
    policy = build_policy("dspark-async", sps=PROFILE, settings=settings)
    gate, acceptance, curve = policy.gate.settings, policy.acceptance.settings, policy.sps.settings
    assert (gate.min_gain, gate.memory_rows, gate.explore_every, gate.reuse_steps) == (0.05, 8, 5, 2)
    assert policy.gate.cost.alpha == 0.5 and gate.overhead_alpha == 0.3
    assert (acceptance.acceptance_decay, acceptance.acceptance_prior_tokens) == (0.9, 1.0)
    refinement = (curve.sps_alpha, curve.sps_prior_weight, curve.sps_refresh_every, curve.sps_drift_alpha)
    assert refinement == (0.02, 2.0, 4, 0.2)
    assert policy.sps.max_log_jump == pytest.approx(math.log(3.0))
    # The defaults are the parts' own, and an engine configuration carries the settings.
    default = build_policy("dspark", sps=PROFILE)
    gate, acceptance = default.gate.settings, default.acceptance.settings
    assert (gate.min_gain, gate.memory_rows, acceptance.acceptance_decay) == (0.01, 64, 0.999)
    assert EngineConfig(policy_settings={"min_gain": 0.05}).policy_settings.min_gain == 0.05
    with pytest.raises(ValueError, match="min_gain"):
        EngineConfig(policy_settings={"min_gain": -1})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("threshold:0", "0 < X < 1"),
        ("threshold:1", "0 < X < 1"),
        ("threshold:1.5", "0 < X < 1"),
        ("threshold:nan", "0 < X < 1"),
        ("threshold:high", "0 < X < 1"),
        ("threshold", "0 < X < 1"),
        ("static:x", "integer K >= 0"),
        ("static:-1", ">= 0"),
        ("dspark:3", "unknown verify policy"),
        ("eagle", "unknown verify policy"),
        ("", "unknown verify policy"),
    ],
)
def test_bad_specs_are_refused_clearly(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_policy(spec, sps=PROFILE)
    with pytest.raises(ValueError, match=message):  # without a profile too, before a model loads
        parse_policy(spec)


def test_good_specs_parse_without_a_profile() -> None:
    assert parse_policy(" dspark ") == ("dspark", None)
    assert parse_policy("static:2") == ("static", 2) and parse_policy("threshold:0.5") == ("threshold", 0.5)


@pytest.mark.parametrize("spec", ["dspark", "dspark-async"])
def test_dspark_without_a_profile_says_what_is_missing(spec: str) -> None:
    with pytest.raises(ValueError, match="needs an SPS profile"):
        build_policy(spec)


@pytest.mark.parametrize("spec", ["dspark", "full", "static:4", "threshold:0.5"])
def test_a_policy_that_verifies_drafts_is_refused_without_a_drafter(spec: str) -> None:
    with pytest.raises(ValueError, match=f"policy '{spec}' .* drafter 'none' drafts none"):
        resolve_policy_spec(spec, NoDrafter())


def test_auto_and_none_resolve_to_none_without_a_drafter() -> None:
    assert resolve_policy_spec("auto", NoDrafter()) == "none"
    assert resolve_policy_spec("none", NoDrafter()) == "none"


def test_every_policy_implements_the_interface_directly() -> None:
    """Composition, not inheritance: no policy class builds on another."""
    built = {
        type(build_policy(spec, sps=PROFILE)) for spec in ("none", "threshold:0.6", "dspark", "dspark-async")
    }
    assert built == {StaticPolicy, ThresholdPolicy, DSparkPolicy}
    assert all(cls.__bases__ == (VerifyPolicy,) for cls in built)
    assert not [sub for cls in VerifyPolicy.__subclasses__() for sub in cls.__subclasses__()]
