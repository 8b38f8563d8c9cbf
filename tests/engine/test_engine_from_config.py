"""`engine_from_config`: the default drafter and policy, and the SPS profile of the profiled policies."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import dspark.profiling.profiler as profiler
import pytest
from dspark.builder import engine_from_config
from dspark.engine.config import EngineConfig
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.dspark import DSparkPolicy
from dspark.profiling.acquire import default_profile_path, engine_identity
from dspark.serving.config import ServeConfig
from dspark.serving.replica import EngineReplica
from dspark.sps_format import ProfileError

from tests.conftest import write_tiny_model
from tests.serving.conftest import make_client
from tests.training.conftest import write_tiny_tokenizer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "deepspec-qwen3-dspark-tiny"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSPARK_SPS_PROFILE", raising=False)
    return tmp_path / "home"


@pytest.fixture
def profiling_calls(monkeypatch) -> list:
    """Counts profiler runs, each a short one (the engines here have a batch budget of 32)."""
    calls = []
    real = profiler.profile_engine

    def counted(engine, **kw):
        calls.append(engine)
        kw.update(grid=[1, 2, 4, 8, 16, 32], repeats=1, min_seconds=0.0, context_len=16)
        return real(engine, **kw)

    monkeypatch.setattr(profiler, "profile_engine", counted)
    return calls


@pytest.fixture(scope="module")
def dspark_target(tmp_path_factory) -> Path:
    """The published-layout fixture's tiny Qwen3 target, with a tokenizer so an engine can load it."""
    path = tmp_path_factory.mktemp("qwen3-target")
    shutil.copytree(FIXTURE / "target", path, dirs_exist_ok=True)
    write_tiny_tokenizer(path)
    return path


def dspark_config(target: Path, **updates) -> EngineConfig:
    fields = dict(
        target=str(target),
        drafter=str(FIXTURE / "draft_vanilla"),
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        max_model_len=128,
        max_batch_tokens=32,
    )
    return EngineConfig(**(fields | updates))


def test_auto_gives_a_confidence_drafter_the_dspark_policy_with_a_profile_measured_once(
    dspark_target, home, profiling_calls
):
    engine = engine_from_config(dspark_config(dspark_target))
    assert (engine.config.drafter, engine.config.policy) == (str(FIXTURE / "draft_vanilla"), "dspark")
    assert isinstance(engine.policy, DSparkPolicy) and len(profiling_calls) == 1
    assert default_profile_path(*engine_identity(engine)).is_file()
    again = engine_from_config(dspark_config(dspark_target))  # the next start reuses it
    assert len(profiling_calls) == 1 and isinstance(again.policy, DSparkPolicy)
    plain = engine_from_config(dspark_config(dspark_target, drafter="none"))
    prompt = [5, 9, 17, 33, 65]
    assert engine.generate([prompt], GREEDY)[0].token_ids == plain.generate([prompt], GREEDY)[0].token_ids


def test_a_configured_profile_path_is_used_and_a_foreign_one_replaced(
    dspark_target, home, profiling_calls, tmp_path, caplog
):
    mine = engine_from_config(dspark_config(dspark_target))
    saved = default_profile_path(*engine_identity(mine))
    kept = tmp_path / "kept.json"
    shutil.copy(saved, kept)
    saved.unlink()
    engine_from_config(dspark_config(dspark_target, sps_profile=kept))
    assert len(profiling_calls) == 1  # read from the configured path, not measured again
    foreign = tmp_path / "foreign.json"
    foreign.write_text(kept.read_text().replace(str(dspark_target), "another-model"))
    with pytest.raises(ProfileError, match="another-model"):
        engine_from_config(dspark_config(dspark_target, sps_profile=foreign, strict_profile=True))
    with caplog.at_level(logging.WARNING):
        engine_from_config(dspark_config(dspark_target, sps_profile=foreign))
    assert "profiling this engine instead" in caplog.text and len(profiling_calls) == 2


def test_a_replica_is_ready_on_the_profile_it_measured_when_the_named_one_is_broken(
    dspark_target, home, profiling_calls, tmp_path, monkeypatch
):
    broken = tmp_path / "mounted.json"
    broken.write_text("{not json")
    monkeypatch.setenv("DSPARK_SPS_PROFILE", str(broken))
    replica = EngineReplica(ServeConfig(), engine_from_config(dspark_config(dspark_target)))
    try:
        assert len(profiling_calls) == 1 and isinstance(replica.engine.policy, DSparkPolicy)
        with make_client(replica) as c:
            assert c.get("/ready").json() == {"ready": True}
    finally:
        replica.shutdown()


def test_strict_mode_refuses_to_start_without_a_profile(dspark_target, home, profiling_calls):
    with pytest.raises(ProfileError, match="not found"):
        engine_from_config(dspark_config(dspark_target, strict_profile=True))
    assert profiling_calls == []


@pytest.mark.parametrize("drafter,policy", [("auto", "static:4"), ("ngram", "static:4"), ("none", "none")])
def test_auto_without_a_confidence_head(tmp_path, home, profiling_calls, drafter, policy):
    """A target with no shipped drafter gets n-gram lookup; no confidences, no profiled policy."""
    write_tiny_model(tmp_path, "llama")
    write_tiny_tokenizer(tmp_path)
    config = EngineConfig(target=str(tmp_path), drafter=drafter, dtype="float32", device="cpu")
    engine = engine_from_config(config)
    expected_drafter = "ngram" if drafter == "auto" else drafter
    assert (engine.config.drafter, engine.config.policy, engine.policy.name) == (
        expected_drafter,
        policy,
        policy,
    )
    assert profiling_calls == []


@pytest.mark.slow
def test_the_default_target_serves_its_shipped_dspark_drafter_by_default(home, profiling_calls):
    config = EngineConfig(dtype="float32", device="cpu", max_model_len=256, max_batch_tokens=32)
    engine = engine_from_config(config)
    assert (engine.config.drafter, engine.config.policy) == ("dspark", "dspark")
    assert engine.drafter.gives_confidences and engine.drafter.calibration is not None
    assert isinstance(engine.policy, DSparkPolicy) and len(profiling_calls) == 1
