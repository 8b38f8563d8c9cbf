"""An engine reuses its profile across starts, and refuses or replaces one that is not its own."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import dspark.profiling.profiler as profiler
import pytest
from dspark.drafters.ngram import NgramDrafter
from dspark.profiling.acquire import acquire_profile, default_profile_path, engine_identity
from dspark.sps_format import ProfileError, SpsProfile

from tests.engine.helpers import engine_on


@pytest.fixture
def engine(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSPARK_SPS_PROFILE", raising=False)
    return engine_on(tiny_dirs["llama"], NgramDrafter(4), "static:2", max_num_seqs=4, max_batch_tokens=64)


@pytest.fixture
def profiling_calls(monkeypatch):
    calls = []
    real = profiler.profile_engine

    def counted(engine, **kw):
        calls.append(engine)
        return real(engine, grid=[1, 2, 4, 8, 16, 32, 64], repeats=1, min_seconds=0.0)

    monkeypatch.setattr(profiler, "profile_engine", counted)
    return calls


def test_a_profile_is_measured_once_and_reused(engine, profiling_calls):
    first = acquire_profile(engine)
    assert len(profiling_calls) == 1
    assert default_profile_path(*engine_identity(engine)).is_file()
    assert [p.batch_tokens for p in first.points] == [1, 2, 4, 8, 16, 32, 64]
    assert all(p.steps_per_second > 0 for p in first.points)
    second = acquire_profile(engine)  # the next start on the same hardware
    assert len(profiling_calls) == 1 and second == first


@pytest.mark.parametrize("field,value", [("model", "another-model"), ("dtype", "bfloat16")])
def test_a_profile_of_another_model_or_dtype_is_refused(
    engine, profiling_calls, tmp_path, field, value, caplog
):
    mine = acquire_profile(engine)
    foreign = tmp_path / "foreign.json"
    mine.model_copy(update={field: value}).save(foreign)
    with pytest.raises(ProfileError, match=f"{field} '{value}'"):
        acquire_profile(engine, str(foreign), strict=True)
    with caplog.at_level(logging.WARNING):
        replaced = acquire_profile(engine, str(foreign))
    assert f"{field} '{value}'" in caplog.text and "profiling this engine instead" in caplog.text
    assert replaced.model == mine.model and len(profiling_calls) == 2


def test_a_profile_of_the_other_forward_is_refused_and_an_unmarked_one_is_eager(
    engine, profiling_calls, tmp_path
):
    mine = acquire_profile(engine)
    assert mine.engine["forward"] == "eager"
    compiled = tmp_path / "compiled.json"
    mine.model_copy(update={"engine": {**mine.engine, "forward": "compiled"}}).save(compiled)
    with pytest.raises(ProfileError, match="forward 'compiled' \\(engine runs 'eager'\\)"):
        acquire_profile(engine, str(compiled), strict=True)
    unmarked = tmp_path / "unmarked.json"
    mine.model_copy(update={"engine": {k: v for k, v in mine.engine.items() if k != "forward"}}).save(
        unmarked
    )
    assert acquire_profile(engine, str(unmarked), strict=True).engine.get("forward") is None
    assert len(profiling_calls) == 1


@pytest.mark.parametrize(
    "content,problem",
    [
        ("", "empty"),
        ("{not json", "not valid JSON"),
        ('{"version": 1}', "Field required"),
        (None, "not found"),
    ],
)
def test_a_broken_profile_file_is_named_then_replaced(
    engine, profiling_calls, tmp_path, monkeypatch, content, problem, caplog
):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("DSPARK_SPS_PROFILE", str(path))
    with pytest.raises(ProfileError):
        acquire_profile(engine, strict=True)
    with caplog.at_level(logging.WARNING):
        profile = acquire_profile(engine)
    assert isinstance(profile, SpsProfile) and len(profiling_calls) == 1
    assert problem.lower() in caplog.text.lower()


def test_a_profile_short_of_the_engines_batch_budget_is_replaced(engine, profiling_calls, tmp_path, caplog):
    mine = acquire_profile(engine)
    short = tmp_path / "short.json"
    mine.model_copy(update={"points": mine.points[:-2]}).save(short)  # measured up to B = 16 only
    with pytest.raises(ProfileError, match=r"up to 16 batch tokens .* up to 64"):
        acquire_profile(engine, str(short), strict=True)
    with caplog.at_level(logging.WARNING):
        replaced = acquire_profile(engine, str(short))
    assert replaced.points[-1].batch_tokens == 64 and len(profiling_calls) == 2


def test_the_context_shrinks_to_fit_a_batch_as_long_as_max_model_len(tiny_dirs):
    engine = engine_on(
        tiny_dirs["llama"], NgramDrafter(4), "none", max_num_seqs=4, max_model_len=64, max_batch_tokens=64
    )
    profile = profiler.profile_engine(engine, grid=[1, 64], repeats=1, min_seconds=0.0)
    assert profile.engine["context_len"] == 64 - 16  # 64 tokens over 4 requests: 16 each
    single = engine_on(
        tiny_dirs["llama"], NgramDrafter(4), "none", max_num_seqs=1, max_model_len=64, max_batch_tokens=64
    )
    with pytest.raises(ValueError, match=r"max_model_len 64 leaves no room .* 64 verified tokens"):
        profiler.profile_engine(single, grid=[1, 64], repeats=1, min_seconds=0.0)


def test_progress_is_reported_after_every_timed_forward(engine, monkeypatch):
    forwards, reported = [], []
    forward = engine.model.forward

    def counted(*args, **kw):
        forwards.append(1)
        return forward(*args, **kw)

    monkeypatch.setattr(engine.model, "forward", counted)
    profile = profiler.profile_engine(
        engine,
        grid=[1, 8, 64],
        repeats=3,
        min_seconds=0.0,
        progress=lambda b, sps: reported.append((b, len(forwards))),
    )
    assert [p.batch_tokens for p in profile.points] == [1, 8, 64]
    assert [b for b, _ in reported] == [1, 8, 64, 64, 8, 1, 1, 8, 64]  # interleaved passes
    timed = len(forwards) - len(reported)  # the context fill and the warm-up come first, unreported
    assert [n for _, n in reported] == list(range(timed + 1, len(forwards) + 1))


def test_a_quick_profile_measures_one_size_per_doubling(engine):
    profile = acquire_profile(engine, quick=True)
    assert [p.batch_tokens for p in profile.points] == [1, 2, 4, 8, 16, 32, 64]
    assert profile.engine["context_len"] == 128
    assert default_profile_path(*engine_identity(engine)).is_file()


def test_a_quick_start_takes_the_stored_profile_of_the_forward_it_will_switch_to(
    engine, profiling_calls, monkeypatch
):
    eager = acquire_profile(engine)
    model, dtype, device, _ = engine_identity(engine)
    compiled = eager.model_copy(update={"engine": {**eager.engine, "forward": "compiled"}, "node_type": "x"})
    compiled.save(default_profile_path(model, dtype, device, "compiled"))
    monkeypatch.setattr(engine, "background", SimpleNamespace(compile=True))
    assert acquire_profile(engine, quick=True) == compiled
    assert acquire_profile(engine) == eager  # the forward it runs now, without `quick`
    monkeypatch.setattr(engine, "background", None)
    assert acquire_profile(engine, quick=True) == eager
    assert len(profiling_calls) == 1
