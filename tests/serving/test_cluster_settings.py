"""Settings for a Ray cluster without one: node-type resources, `--address` / RAY_ADDRESS, the
RayService import path's `args`, and what a replica placed by node type takes from its node."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from dspark.cli import main
from dspark.node_resources import REPLICA_SLOTS, node_resources, node_type_of
from dspark.serving.app import build_app, config_from_args
from dspark.serving.config import ServeConfig, load_config
from dspark.serving.deployment import deployment_options
from dspark.serving.node_placement import settings_on_node

PROFILES = {"cpu-small": Path("/profiles/small.json"), "gpu-h100": Path("/profiles/h100.json")}


def test_a_node_types_resources_name_it_back():
    resources = {"CPU": 8.0, **node_resources("gpu-h100", 2)}
    assert resources[REPLICA_SLOTS] == 2 and resources["dspark/node-type/gpu-h100"] == 1
    assert node_type_of(resources) == "gpu-h100"
    assert node_type_of({"CPU": 8.0, REPLICA_SLOTS: 1.0}) is None
    with pytest.raises(ValueError, match="one node type"):
        node_type_of({**node_resources("a", 1), **node_resources("b", 1)})
    with pytest.raises(ValueError, match="at least one replica"):
        node_resources("a", 0)


def test_ray_address_from_the_environment_and_the_flag_wins():
    assert load_config(environ={}).address is None
    assert load_config(environ={"RAY_ADDRESS": "ray://head:10001"}).address == "ray://head:10001"
    cfg = load_config(overrides={"address": "auto"}, environ={"RAY_ADDRESS": "ray://head:10001"})
    assert cfg.address == "auto" and not cfg.direct_ingress
    with pytest.raises(ValueError, match="direct"):
        load_config(overrides={"address": "auto", "ingress": "direct"}, environ={})


def test_profiles_per_node_type_from_env_json_and_their_checks():
    env = {"DSPARK_SPS_PROFILES": '{"cpu-small": "/profiles/small.json"}'}
    cfg = load_config(environ=env)
    assert cfg.sps_profiles == {"cpu-small": Path("/profiles/small.json")} and cfg.placed_by_node_type
    assert not ServeConfig().placed_by_node_type
    for values, needle in [
        ({"sps_profiles": {}}, "sps_profiles"),
        ({"sps_profiles": {"": "/p.json"}}, "non-empty"),
        ({"sps_profiles": PROFILES, "sps_profile": "/p.json"}, "not both"),
    ]:
        with pytest.raises(ValueError, match=needle):
            load_config(overrides=values, environ={})


def test_replicas_placed_by_node_type_take_a_slot_not_this_machines_cpus():
    plain = deployment_options(ServeConfig(num_replicas=2))["ray_actor_options"]
    assert "resources" not in plain and plain["num_cpus"] >= 1
    placed = deployment_options(ServeConfig(num_replicas=4, sps_profiles=PROFILES))["ray_actor_options"]
    assert placed["resources"] == {REPLICA_SLOTS: 1.0} and placed["num_cpus"] == 0
    sized = ServeConfig(num_replicas=4, sps_profiles=PROFILES, num_cpus_per_replica=3, num_gpus_per_replica=1)
    opts = deployment_options(sized)["ray_actor_options"]
    assert (opts["num_cpus"], opts["num_gpus"], opts["resources"]) == (3, 1, {REPLICA_SLOTS: 1.0})


def test_a_replica_takes_its_node_types_profile_and_cpu_share():
    cfg = ServeConfig(num_replicas=3, sps_profiles=PROFILES)
    on_small = settings_on_node(cfg, {"CPU": 8.0, **node_resources("cpu-small", 2)})
    assert on_small.sps_profile == PROFILES["cpu-small"] and on_small.num_cpus_per_replica == 4
    assert on_small.engine_config().sps_profile == PROFILES["cpu-small"]
    on_h100 = settings_on_node(
        cfg.model_copy(update={"num_cpus_per_replica": 2.0}), node_resources("gpu-h100", 1)
    )
    assert on_h100.sps_profile == PROFILES["gpu-h100"] and on_h100.num_cpus_per_replica == 2
    unplaced = ServeConfig()
    assert settings_on_node(unplaced, {"CPU": 4.0}) is unplaced


def test_a_node_type_without_a_profile_measures_one_unless_strict():
    cfg = ServeConfig(num_replicas=3, sps_profiles=PROFILES)
    on_big = settings_on_node(cfg, {"CPU": 4.0, **node_resources("cpu-big", 1)})
    assert on_big.sps_profile is None and on_big.sps_profiles is None and on_big.num_cpus_per_replica == 4
    assert on_big.engine_config().sps_profile is None  # the engine's own lookup, as on one server
    strict = cfg.model_copy(update={"strict_profile": True})
    with pytest.raises(RuntimeError, match=r"'cpu-big'.*cpu-small.*strict_profile"):
        settings_on_node(strict, node_resources("cpu-big", 1))
    with pytest.raises(RuntimeError, match="no dspark/node-type"):
        settings_on_node(strict, {"CPU": 4.0, REPLICA_SLOTS: 1.0})


def test_the_import_paths_args_are_the_command_lines_settings():
    args = {"target": "smollm2-135m", "num_replicas": 2, "max_queue": 3, "sps_profiles": {"a": "/a.json"}}
    config = config_from_args(args)
    assert config == ServeConfig(**args)
    ingress = build_app(args)._bound_deployment
    # Two replicas: the HTTP ingress in front of the engine deployment, whose router sees prompts.
    assert ingress.name == "OpenAIIngress" and ingress.num_replicas == 1
    deployment = ingress.init_args[0]._bound_deployment
    assert deployment.name == "EngineBackend" and deployment.num_replicas == 2
    assert deployment.ray_actor_options["resources"] == {REPLICA_SLOTS: 1.0}
    assert ServeConfig.model_validate(deployment.init_args[0]) == config


def test_the_import_path_ignores_the_environment(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setenv("DSPARK_MAX_QUEUE", "7")
    config = config_from_args({})
    assert config.address is None and config.max_queue == ServeConfig().max_queue


@pytest.mark.parametrize(
    ("args", "needle"),
    [({"num_replica": 2}, "num_replica"), ({"max_queue": -1}, "max_queue"), ({"kserve": True}, "kserve")],
)
def test_bad_import_path_args_name_the_field(args, needle):
    with pytest.raises(ValueError, match=needle):
        build_app(args)


def test_address_flag_in_the_effective_config():
    result = CliRunner().invoke(main, ["serve", "--address", "ray://head:10001", "--print-config"], env={})
    assert result.exit_code == 0, result.output
    assert "address: ray://head:10001" in result.output
