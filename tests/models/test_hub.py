"""Targets by hub id: downloaded from a loopback hub (tests/hub_emulator.py), then read from the cache."""

from __future__ import annotations

import socket

import pytest
from dspark.models.hub import parse_hub_id, served_name, with_revision
from dspark.models.pull import ModelError, resolve_target

from tests.conftest import write_tiny_model
from tests.hub_emulator import HubEmulator, HubRepo, repo_from_dir

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def tiny_repo(tmp_path) -> HubRepo:
    model = write_tiny_model(tmp_path / "model", "llama")
    (model / "pytorch_model.bin").write_bytes(b"not fetched: the engine reads safetensors")
    (model / "model.gguf").write_bytes(b"not fetched either")
    return repo_from_dir(model)


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """A fresh hub cache under HF_HOME; no token, online."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hf" / "hub"


def test_downloads_once_then_serves_from_the_offline_cache(tiny_repo, hub_env, monkeypatch):
    with HubEmulator({REPO: tiny_repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        path = resolve_target(REPO)
        assert path.is_relative_to(hub_env) and tiny_repo.commit in str(path)
        assert (path / "config.json").read_bytes() == tiny_repo.files["config.json"].read_bytes()
        assert (path / "model.safetensors").read_bytes() == tiny_repo.files["model.safetensors"].read_bytes()
        assert not (path / "pytorch_model.bin").exists() and not (path / "model.gguf").exists()
        fetched = sorted(p.rsplit("/", 1)[1] for p in hub.file_downloads())
        assert fetched == ["config.json", "generation_config.json", "model.safetensors"]
    # The server is gone: offline mode answers from the cache without a request.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_target(REPO) == path
    assert resolve_target(f"{REPO}@{tiny_repo.commit}") == path


def test_revision_pins_a_commit_and_an_unknown_one_is_named(tiny_repo, hub_env, monkeypatch):
    with HubEmulator({REPO: tiny_repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        assert tiny_repo.commit in str(resolve_target(f"{REPO}@{tiny_repo.commit}"))
        with pytest.raises(ModelError, match=rf"'{REPO}@v9'.*{hub.endpoint}.*no revision 'v9'"):
            resolve_target(f"{REPO}@v9")


def test_unknown_repository_is_named_with_the_cause(tiny_repo, hub_env, monkeypatch):
    with HubEmulator({REPO: tiny_repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(ModelError, match=r"'tiny-org/missing'.*no such repository .*HF_TOKEN"):
            resolve_target("tiny-org/missing")


def test_token_is_sent_as_bearer(tiny_repo, hub_env, monkeypatch):
    with HubEmulator({REPO: tiny_repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        resolve_target(REPO)
    assert hub.requests and {auth for _, _, auth in hub.requests} == {"Bearer hf_secret"}


def test_offline_without_a_cached_copy_says_so(hub_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match=rf"'{REPO}'.*HF_HUB_OFFLINE is set and it is not in the cache"):
        resolve_target(REPO)


def test_unreachable_hub_without_a_cached_copy_says_so(hub_env, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelError, match=rf"'{REPO}'.*cannot be reached and it is not in the cache"):
        resolve_target(REPO)


def test_hub_cache_env_wins_over_hf_home(tiny_repo, hub_env, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with HubEmulator({REPO: tiny_repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        assert resolve_target(REPO).is_relative_to(tmp_path / "elsewhere")


def test_local_directories_and_short_names_are_not_hub_ids(tmp_path, monkeypatch):
    local = write_tiny_model(tmp_path / "org" / "model", "llama")
    monkeypatch.chdir(tmp_path)
    assert resolve_target("org/model") == local.relative_to(tmp_path)
    assert served_name("org/model") == "org/model"
    with pytest.raises(ModelError, match="not a directory, not a hub id"):
        resolve_target("no-such-model")


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("Qwen/Qwen3-8B", ("Qwen/Qwen3-8B", None)),
        ("org/name@v1.0", ("org/name", "v1.0")),
        ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),
        ("smollm2-135m", None),
        ("./org/name", None),
        ("/abs/path", None),
        ("a/b/c", None),
    ],
)
def test_parse_hub_id(spec, parsed):
    hub = parse_hub_id(spec)
    assert (hub and (hub.repo_id, hub.revision)) == parsed


def test_revision_flag_pins_hub_ids_only():
    assert with_revision("org/name", "abc") == "org/name@abc"
    assert with_revision("org/name@abc", "abc") == "org/name@abc"
    with pytest.raises(ValueError, match="names revision 'x' but revision is 'y'"):
        with_revision("org/name@x", "y")
    with pytest.raises(ValueError, match="applies to a hub id"):
        with_revision("smollm2-135m", "y")
    assert served_name("org/name@abc") == "org/name"
