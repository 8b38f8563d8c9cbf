"""`runtime: rayservice`'s RayService: valid for KubeRay's published CRD and for Ray Serve's own
config schema, with each tier's application configured as the Deployment mode's pods are."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from crd_schemas import kuberay_validator
from dspark.commands.serve import serve
from dspark.node_resources import REPLICA_SLOTS, node_resources
from dspark.serving.app import build_app
from dspark.serving.config import ServeConfig
from dspark_operator import builders, ray_builders
from dspark_operator.ray_serving import reconcile_rayservice
from dspark_operator.spec import ServiceSpec
from dspark_operator.status import service_status
from operator_fixtures import SERVICE, service
from ray.serve.schema import ServeDeploySchema

BODY = {**SERVICE, "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}
LABEL = "nvidia.com/gpu.product"
READY = {"NVIDIA-H200": "fp-h200", "NVIDIA-L40S": "fp-l40s"}
PLACED = {"interactive": "NVIDIA-H200", "batch": "NVIDIA-L40S"}


def ray_spec(**fields) -> ServiceSpec:
    return ServiceSpec.model_validate(service(runtime="rayservice", **fields)["spec"])


def build(spec: ServiceSpec, replicas=None, ready=READY, placed=PLACED) -> dict:
    return ray_builders.build_rayservice(
        BODY, spec, LABEL, ready, placed, replicas or {"interactive": 3, "batch": 1}
    )


def serve_config(obj: dict) -> dict:
    return yaml.safe_load(obj["spec"]["serveConfigV2"])


def groups(obj: dict) -> dict[str, dict]:
    specs = obj["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return {g["template"]["metadata"]["annotations"]["dspark.ai/node-type"]: g for g in specs}


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {
            "model": {**SERVICE["spec"]["model"], "pvc": {"claimName": "models"}, "calibration": "/m/c.json"},
            "tolerations": [{"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
            "imagePullSecrets": [{"name": "registry"}],
            "rayService": {"rayVersion": "2.60.0", "headResources": {"requests": {"cpu": "2"}}},
            "resources": {"limits": {"nvidia.com/gpu": 8, "cpu": "64"}},
        },
    ],
)
def test_the_rayservice_validates_against_kuberays_crd_and_ray_serves_schema(fields):
    obj = build(ray_spec(**fields))
    kuberay_validator().validate(obj)
    ServeDeploySchema.model_validate(serve_config(obj))
    assert obj["apiVersion"] == "ray.io/v1" and obj["kind"] == "RayService"
    assert obj["metadata"]["ownerReferences"][0]["kind"] == "DSparkService"


def test_a_manifest_breaking_the_crd_is_caught():
    obj = build(ray_spec())
    del obj["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError, match="groupName"):
        kuberay_validator().validate(obj)
    obj = build(ray_spec())
    obj["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 1
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        kuberay_validator().validate(obj)


def test_one_application_per_placed_tier_with_its_replicas():
    apps = {a["name"]: a for a in serve_config(build(ray_spec()))["applications"]}
    assert set(apps) == {"interactive", "batch"}
    for name, replicas in (("interactive", 3), ("batch", 1)):
        assert apps[name]["import_path"] == "dspark.serving.app:build_app"
        assert apps[name]["route_prefix"] == f"/{name}"
        assert apps[name]["deployments"] == [
            {"name": ray_builders.ENGINE_DEPLOYMENT, "num_replicas": replicas}
        ]
    # A tier still waiting for a profile has no application.
    only = build(ray_spec(), replicas={"interactive": 2}, placed={"interactive": "NVIDIA-H200"})
    assert [a["name"] for a in serve_config(only)["applications"]] == ["interactive"]


def test_a_worker_group_per_profiled_node_type_placed_and_sized_like_the_deployment_mode():
    spec = ray_spec(
        tolerations=[{"key": "team", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    )
    obj = build(spec)
    deployment = builders.build_serving_deployment(BODY, spec, spec.tiers[0], LABEL, "NVIDIA-H200", "fp", 1)
    deployment_pod = deployment["spec"]["template"]["spec"]
    assert set(groups(obj)) == {"NVIDIA-H200", "NVIDIA-L40S"}
    args = serve_config(obj)["applications"][0]["args"]
    for node_type, group in groups(obj).items():
        pod = group["template"]["spec"]
        for field in ("tolerations", "affinity", "securityContext", "automountServiceAccountToken"):
            assert pod[field] == deployment_pod[field], field
        assert pod["nodeSelector"] == {LABEL: node_type}
        container = pod["containers"][0]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        # Its node type's profile, mounted where the applications' sps_profiles look for it.
        volume = next(v for v in pod["volumes"] if v["name"] == "sps-profile")
        assert volume["configMap"]["name"] == builders.profile_configmap_name("chat", node_type)
        mount = next(m for m in container["volumeMounts"] if m["name"] == "sps-profile")
        assert args["sps_profiles"][node_type] == f"{mount['mountPath']}/profile.json"
        assert (
            group["template"]["metadata"]["annotations"]["dspark.ai/profile-fingerprint"] == READY[node_type]
        )
        # The contract with the serving side: the node type and its replica slots as Ray resources.
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == node_resources(node_type, 1)
    assert groups(obj)["NVIDIA-H200"]["replicas"] == 3 and groups(obj)["NVIDIA-L40S"]["replicas"] == 1
    head = obj["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in head and "nvidia.com/gpu" not in json.dumps(
        head["containers"][0]["resources"]
    )


def test_worker_pods_with_several_gpus_hold_a_replica_per_gpu():
    obj = build(
        ray_spec(resources={"limits": {"nvidia.com/gpu": 4}}), replicas={"interactive": 5, "batch": 1}
    )
    h200 = groups(obj)["NVIDIA-H200"]
    assert h200["replicas"] == 2  # ceil(5 / 4)
    assert json.loads(json.loads(h200["rayStartParams"]["resources"]))["dspark/replica-slots"] == 4
    assert serve_config(obj)["applications"][0]["args"]["num_gpus_per_replica"] == 1


def test_scaling_a_tier_changes_its_replicas_and_refits_its_worker_group_only():
    obj = build(ray_spec())
    patch = ray_builders.scale_patch(obj, "interactive", 6)
    scaled = {**obj, "spec": {**obj["spec"], **patch["spec"]}}
    scaled["spec"]["rayClusterConfig"] = {
        **obj["spec"]["rayClusterConfig"],
        **patch["spec"]["rayClusterConfig"],
    }
    assert ray_builders.tier_replicas(scaled) == {"interactive": 6, "batch": 1}
    assert groups(scaled)["NVIDIA-H200"]["replicas"] == 6 and groups(scaled)["NVIDIA-L40S"]["replicas"] == 1
    assert groups(scaled)["NVIDIA-H200"]["maxReplicas"] >= 6
    assert serve_config(scaled)["applications"][0]["args"] == serve_config(obj)["applications"][0]["args"]
    kuberay_validator().validate(scaled)


def served_config(command: list[str], env: list[dict]) -> dict:
    """What `dspark serve` makes of a Deployment-mode pod's command line and environment."""
    environ = {e["name"]: e["value"] for e in env if "value" in e} | {"DSPARK_CONFIG": ""}
    result = CliRunner().invoke(serve, [*command[2:], "--print-config"], env=environ)
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)


def test_each_application_runs_the_settings_of_the_deployment_modes_command_line():
    extra = [
        "--max-num-seqs",
        "12",
        "--no-compile",
        "--max-batch-tokens=384",
        "--max-queue",
        "5",
        "--prefix-caching",
    ]
    spec = ray_spec(extraArgs=extra, serving={"drainSeconds": 12})
    deployment = builders.build_serving_deployment(BODY, spec, spec.tiers[0], LABEL, "NVIDIA-H200", "fp", 1)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    expected = served_config(container["command"], container["env"])
    args = serve_config(build(spec))["applications"][0]["args"]
    got = ServeConfig.model_validate(args).effective()
    assert got["engine"] == {**expected["engine"], "sps_profile": None}
    # Where the Serve proxy listens (http_options), how replicas are placed and routed: the cluster's.
    listen = {"host", "port", "sps_profiles", "num_gpus_per_replica", "router"}
    assert {k: v for k, v in got["server"].items() if k not in listen} == {
        k: v for k, v in expected["server"].items() if k not in listen
    }
    assert got["server"]["max_queue"] == 5 and got["server"]["graceful_shutdown_timeout_s"] == 12


def test_flags_become_fields():
    assert ray_builders.flag_args(["--a-b", "1", "--c", "--no-d", "--e=x", "--f", "1", "2"]) == {
        "a_b": "1",
        "c": True,
        "d": False,
        "e": "x",
        "f": ["1", "2"],
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"extraArgs": ["32"]}, "'32' follows no --flag"),
        ({"serving": {"kind": "InferenceService"}}, "runs only with runtime deployment"),
        ({"runtime": "ray"}, "runtime"),
        ({"apiKeySecretRef": {"name": "key"}}, "apiKeySecretRef runs only with runtime deployment"),
    ],
)
def test_a_spec_the_rayservice_mode_cannot_run_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ServiceSpec.model_validate({**service(runtime="rayservice")["spec"], **fields})


class WithoutKubeRay:
    """An API server without KubeRay's CRD: any call beyond discovery fails the test."""

    def serves(self, api_version: str, plural: str) -> bool:
        return False

    def __getattr__(self, name: str):
        raise AssertionError(f"Kube.{name} called while KubeRay is absent")


def test_without_kuberay_what_serves_keeps_serving_and_the_status_says_why():
    spec = ray_spec()
    previous = {"interactive": {"state": "Deployed", "kind": "Deployment", "workload": "chat-interactive"}}
    outcome = reconcile_rayservice(WithoutKubeRay(), BODY, spec, LABEL, READY, previous)
    assert outcome.kuberay_missing
    assert {t["state"] for t in outcome.tiers.values()} == {"WaitingForKubeRay"}
    profiles = {t: {"state": "Ready", "fingerprint": f} for t, f in READY.items()}
    status = service_status(spec, {}, LABEL, list(READY), profiles, outcome, None, 1, 0.0)
    assert status["phase"] == "Degraded"
    kuberay = next(c for c in status["conditions"] if c["type"] == "KubeRayAvailable")
    assert kuberay["status"] == "False" and "RayService CRD" in kuberay["message"]


def test_each_tiers_replicas_are_the_engine_deployment_its_application_builds():
    """The deployment whose num_replicas a tier's replicas set is the one build_app builds behind
    the HTTP ingress, at any count, and its replicas take a worker's replica slot and a GPU."""
    for app in serve_config(build(ray_spec(), replicas={"interactive": 1, "batch": 1}))["applications"]:
        ingress = build_app(app["args"])._bound_deployment
        engine = ingress.init_args[0]._bound_deployment
        assert [d["name"] for d in app["deployments"]] == [engine.name] == [ray_builders.ENGINE_DEPLOYMENT]
        assert engine.ray_actor_options["resources"] == {REPLICA_SLOTS: 1.0}
        assert engine.ray_actor_options["num_gpus"] == 1
