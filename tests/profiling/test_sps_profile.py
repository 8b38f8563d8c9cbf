"""SpsProfile: the JSON format, validation of bad files, lookup, matching, cache paths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dspark.policies.sps_curve import table_lookup
from dspark.profiling.acquire import default_profile_path
from dspark.profiling.device import current_device_name
from dspark.sps_format import ProfileError, SpsPoint, SpsProfile


def valid_dict(**overrides) -> dict:
    data = {
        "version": 1,
        "device": "NVIDIA H200",
        "node_type": "gpu-h200",
        "model": "Qwen3-4B",
        "dtype": "bfloat16",
        "engine": {"max_batch_tokens": 1024, "context_len": 4096},
        "created": "2026-11-29T07:38:14+00:00",
        # Out of order and jagged on purpose: SPS rises again at 64.
        "points": [
            {"batch_tokens": 64, "steps_per_second": 45.0},
            {"batch_tokens": 1, "steps_per_second": 60.0},
            {"batch_tokens": 32, "steps_per_second": 40.0},
            {"batch_tokens": 128, "steps_per_second": 30.0},
        ],
    }
    data.update(overrides)
    return data


def parse(data: dict) -> SpsProfile:
    return SpsProfile.parse(json.dumps(data))


def test_round_trip_keeps_the_layout_and_the_measured_jags(tmp_path: Path) -> None:
    profile = parse(valid_dict())
    assert profile.batch_tokens() == [1, 32, 64, 128]
    assert profile.steps_per_second() == [60.0, 40.0, 45.0, 30.0]  # not smoothed
    path = profile.save(tmp_path / "nested" / "p.json")
    on_disk = json.loads(path.read_text())
    assert set(on_disk) == {"version", "device", "node_type", "model", "dtype", "engine", "created", "points"}
    assert on_disk["points"][0] == {"batch_tokens": 1, "steps_per_second": 60.0}
    loaded = SpsProfile.load(path)
    assert loaded == profile and loaded.source == str(path)


def test_created_defaults_to_now_in_iso8601() -> None:
    profile = SpsProfile(
        device="cpu", model="m", dtype="float32", points=[SpsPoint(batch_tokens=1, steps_per_second=2.0)]
    )
    assert profile.created.endswith("+00:00") and profile.version == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (valid_dict(points=[]), "points: List should have at least 1 item"),
        (valid_dict(points=[{"batch_tokens": 0, "steps_per_second": 1.0}]), "points.0.batch_tokens"),
        (valid_dict(points=[{"batch_tokens": 2.5, "steps_per_second": 1.0}]), "points.0.batch_tokens"),
        (valid_dict(points=[{"batch_tokens": 2, "steps_per_second": 0}]), "greater than 0"),
        (valid_dict(points=[{"batch_tokens": 2, "steps_per_second": -3.0}]), "greater than 0"),
        (valid_dict(points=[{"batch_tokens": 2, "steps_per_second": float("nan")}]), "finite"),
        (valid_dict(points=[{"batch_tokens": 2, "steps_per_second": float("inf")}]), "finite"),
        (valid_dict(points=[{"batch_tokens": 2}]), "points.0.steps_per_second: Field required"),
        (
            valid_dict(
                points=[
                    {"batch_tokens": 8, "steps_per_second": 1.0},
                    {"batch_tokens": 8, "steps_per_second": 2.0},
                ]
            ),
            "duplicate batch_tokens [8]",
        ),
        (valid_dict(version=2), "version"),
        (valid_dict(dtype="float16"), "dtype"),
        (valid_dict(model=""), "model"),
        (valid_dict(created="last tuesday"), "not an ISO 8601 timestamp"),
        (valid_dict(engine=[1, 2]), "engine"),
        (valid_dict(extra_field=1), "extra_field: Extra inputs are not permitted"),
        ({k: v for k, v in valid_dict().items() if k != "points"}, "points: Field required"),
    ],
)
def test_invalid_profiles_name_the_problem(data: dict, message: str) -> None:
    with pytest.raises(ProfileError, match="is invalid") as err:
        parse(data)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "is empty"), ("   \n", "is empty"), ("{not json", "not valid JSON"), ("[1, 2]", "(top level)")],
)
def test_malformed_text_is_refused(text: str, message: str) -> None:
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpsProfile.parse(text)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not found"):
        SpsProfile.load(tmp_path / "absent.json")
    with pytest.raises(ProfileError, match="cannot read"):
        SpsProfile.load(tmp_path)  # a directory


def test_lookup_interpolates_and_extrapolates() -> None:
    profile = parse(valid_dict())
    assert profile.sps(1) == 60.0 and profile.sps(64) == 45.0
    assert profile.sps(48) == pytest.approx(42.5)  # halfway between 40 and 45
    assert profile.sps(0.5) == 60.0  # flat below the first point
    # Beyond 128: step time grows by the steeper of the last segment (1/30 - 1/45)/64 and the
    # whole curve (1/30 - 1/60)/127 per token.
    slope = max((1 / 30 - 1 / 45) / 64, (1 / 30 - 1 / 60) / 127)
    assert profile.sps(256) == pytest.approx(1 / (1 / 30 + slope * 128))
    beyond = profile.sps(torch.arange(128, 4096, 7))
    assert bool((beyond[1:] <= beyond[:-1]).all()) and bool((beyond > 0).all())


def test_extrapolation_never_rises_when_the_last_segment_dips() -> None:
    rising_end = parse(
        valid_dict(
            points=[
                {"batch_tokens": 1, "steps_per_second": 50.0},
                {"batch_tokens": 10, "steps_per_second": 60.0},
            ]
        )
    )
    assert rising_end.sps(1000) == 60.0  # no negative slope: flat at the last measurement
    single = parse(valid_dict(points=[{"batch_tokens": 16, "steps_per_second": 100.0}]))
    assert single.sps(4) == 100.0 and single.sps(32) == pytest.approx(50.0)  # time proportional to B


def test_tensor_lookup_matches_scalar_lookup_and_the_dense_table() -> None:
    profile = parse(valid_dict())
    b = torch.tensor([1, 2, 31, 33, 64, 100, 128, 129, 500])
    vector = profile.sps(b)
    assert vector.dtype == torch.float64
    assert vector.tolist() == [profile.sps(int(x)) for x in b]
    assert torch.equal(profile.table(600)[b], vector)


def test_the_scheduler_reads_a_profile_through_its_right_envelope() -> None:
    """table_lookup: SPS(B) = max over B' >= B, so an inverted point (32 slower than 64) is read
    as 64's rate, a real drop stays, and the profile itself keeps its measured jags."""
    profile = parse(valid_dict())
    lookup = table_lookup(profile)
    b = np.arange(1, 200)
    envelope = lookup(b)
    measured = profile.sps(b)
    assert isinstance(measured, np.ndarray) and measured.dtype == np.float64  # NumPy in, NumPy out
    assert np.all(envelope[1:] <= envelope[:-1])  # never rises with B
    assert np.all(envelope >= measured)
    assert float(envelope[31]) == 45.0 and profile.sps(32) == 40.0  # B = 32 reads 64's rate
    assert float(envelope[0]) == 60.0 and float(envelope[127]) == 30.0  # the drops to 45 and 30 stay
    assert np.array_equal(envelope[b >= 64], measured[b >= 64])  # past the last rise: as measured


def test_matches_and_refusal_message() -> None:
    profile = parse(valid_dict())
    assert profile.matches("Qwen3-4B", "bfloat16", "NVIDIA H200")
    assert not profile.matches("Qwen3-8B", "bfloat16", "NVIDIA H200")
    with pytest.raises(ProfileError) as err:
        profile.ensure_matches("Qwen3-8B", "float32", "NVIDIA H200")
    text = str(err.value)
    assert "model 'Qwen3-4B' (engine runs 'Qwen3-8B')" in text
    assert "dtype 'bfloat16' (engine runs 'float32')" in text
    assert "device" not in text.split("measured for")[1].split(";")[0]
    with pytest.raises(ProfileError, match="device 'NVIDIA H200' \\(engine runs 'NVIDIA A100"):
        profile.ensure_matches("Qwen3-4B", "bfloat16", "NVIDIA A100-SXM4-80GB")


def test_default_profile_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    a = default_profile_path("/models/a/Qwen3-4B.gguf", "bfloat16", "NVIDIA H200")
    b = default_profile_path("/models/b/Qwen3-4B.gguf", "bfloat16", "NVIDIA H200")
    assert a.parent == tmp_path / "profiles" and a.suffix == ".json"
    assert a.name.startswith("qwen3-4b-gguf__bfloat16__nvidia-h200__")
    assert a != b  # same file name, different model: different profiles
    assert a == default_profile_path("/models/a/Qwen3-4B.gguf", "bfloat16", "NVIDIA H200")
    compiled = default_profile_path("/models/a/Qwen3-4B.gguf", "bfloat16", "AMD EPYC", "compiled")
    assert compiled.name.startswith("qwen3-4b-gguf__bfloat16__amd-epyc__compiled__")
    assert compiled != default_profile_path("/models/a/Qwen3-4B.gguf", "bfloat16", "AMD EPYC")
    monkeypatch.delenv("DSPARK_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert (
        default_profile_path("m", "float32", "cpu").parent
        == tmp_path / "home" / ".cache" / "dspark" / "profiles"
    )


def test_current_device_name_is_a_name() -> None:
    name = current_device_name()
    assert isinstance(name, str) and name.strip() == name and name


def test_profile_format_imports_without_torch() -> None:
    # The operator image has no torch (nor NumPy) but reads, validates and looks up profiles.
    import subprocess
    import sys

    service = Path(__file__).resolve().parents[2] / "service"
    code = (
        "import sys; import dspark.sps_format as m; "
        'p = m.SpsProfile.parse(\'{"device": "d", "model": "m", "dtype": "float32", '
        '"points": [{"batch_tokens": 1, "steps_per_second": 2.0}, {"batch_tokens": 4, "steps_per_second": 1.0}]}\'); '
        "assert p.sps(2.5) == 1.5 and abs(p.sps(8) - 0.6) < 1e-12 and p.summary()['points'] == 2; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch or NumPy was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(service)}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
