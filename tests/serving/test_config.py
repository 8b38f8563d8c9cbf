from pathlib import Path

import pytest
from click.testing import CliRunner
from dspark.cli import main
from dspark.serving.config import load_config


def test_layers_file_then_env_then_flags(tmp_path: Path):
    f = tmp_path / "serve.yaml"
    f.write_text("port: 9001\npolicy: static:2\nmax_queue: 5\nautoscaling: {max_replicas: 3}\n")
    env = {"DSPARK_PORT": "9002", "DSPARK_DRAFTER": "none"}
    cfg = load_config(f, overrides={"port": 9003, "target": None}, environ=env)
    assert (cfg.port, cfg.policy, cfg.drafter, cfg.max_queue) == (9003, "static:2", "none", 5)
    assert cfg.autoscaling is not None and cfg.autoscaling.max_replicas == 3 and cfg.max_replicas == 3
    assert cfg.engine_overrides() == {"drafter": "none", "policy": "static:2", "build_in_background": True}


def test_env_json_for_nested_and_config_file_env(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("max_num_seqs: 4\n")
    env = {
        "DSPARK_CONFIG": str(f),
        "DSPARK_AUTOSCALING": '{"min_replicas": 0, "max_replicas": 2}',
        "DSPARK_API_KEY": "sekret",
        "DSPARK_KSERVE": "true",
    }
    cfg = load_config(environ=env)
    assert cfg.max_num_seqs == 4 and cfg.autoscaling.max_replicas == 2 and cfg.kserve
    assert cfg.api_key.get_secret_value() == "sekret"
    assert cfg.effective()["server"]["api_key"] == "***"
    assert cfg.effective()["engine"]["max_num_seqs"] == 4


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"port": "x"}, "port"),
        ({"bogus": 1}, "bogus"),
        ({"max_queue": -1}, "max_queue"),
        ({"autoscaling": {"max_replicas": 0}}, "autoscaling.max_replicas"),
        # Engine settings are checked with the rest, before Ray or a model starts.
        ({"policy": "static:x"}, "policy: policy 'static:K' needs an integer K >= 0"),
        ({"gamma": 0}, "gamma: Input should be greater"),
        ({"ingress": "haproxy"}, "ingress"),
        ({"ingress": "direct", "num_replicas": 2}, "several or autoscaled replicas need ingress `proxy`"),
        ({"ingress": "direct", "autoscaling": {"max_replicas": 1}}, "need ingress `proxy`"),
        ({"ingress": "direct", "kserve": True}, "--kserve has its own server"),
    ],
)
def test_invalid_config_names_the_field(values, needle):
    with pytest.raises(ValueError, match=needle):
        load_config(overrides=values, environ={})


def test_bad_file_and_bad_env_json(tmp_path: Path):
    f = tmp_path / "bad.yaml"
    f.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(f, environ={})
    with pytest.raises(ValueError, match="JSON"):
        load_config(environ={"DSPARK_AUTOSCALING": "{nope"})
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})


def test_print_config_shows_effective_settings(monkeypatch):
    monkeypatch.setenv("DSPARK_MAX_BATCH_TOKENS", "256")
    result = CliRunner().invoke(main, ["serve", "--print-config", "--policy", "static:3", "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert "policy: static:3" in result.output and "port: 8123" in result.output
    assert "max_batch_tokens: 256" in result.output and "target: smollm2-135m" in result.output
    bad = CliRunner().invoke(main, ["serve", "--print-config", "--dtype", "float32", "--max-queue", "-2"])
    assert bad.exit_code != 0 and "max_queue" in bad.output


def test_replicas_get_short_openmp_spins_unless_the_user_set_them(monkeypatch):
    from dspark.serving.runtime import replica_env

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = replica_env()
    assert env["GOMP_SPINCOUNT"] == "20000" and env["PYTHONPATH"]
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert replica_env()["GOMP_SPINCOUNT"] == "300000"


def test_engine_placement_and_threads_from_flags_and_defaults():
    result = CliRunner().invoke(
        main, ["serve", "--print-config", "--engine-in-thread", "--engine-threads", "3", "--port", "8123"]
    )
    assert result.exit_code == 0, result.output
    assert "engine_in_thread: true" in result.output and "engine_threads: 3" in result.output
    # Thread counts per placement: tests/serving/test_threads.py.
    assert load_config(overrides={"engine_threads": 2}, environ={}).thread_plan().batch == 2
    with pytest.raises(ValueError, match="engine_threads"):
        load_config(overrides={"engine_threads": 0}, environ={})
