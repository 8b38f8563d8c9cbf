"""Pure builders of `runtime: rayservice`: one KubeRay RayService per DSparkService, plain dicts.

Its Ray cluster has a head group and one worker group per profiled node type; its Serve config one
application per placed tier. A tier scales by its engine deployment's `num_replicas` in
`serveConfigV2`, and each worker group holds as many pods as the replicas of the tiers placed on its
node type need.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from dspark.node_resources import node_resources

from dspark_operator import pod_security
from dspark_operator.builders import (
    ANNOTATION_NODE_TYPE,
    LABEL_FINGERPRINT,
    LABEL_NODE_TYPE,
    PROFILE_KEY,
    base_labels,
    model_volumes,
    owner_reference,
    profile_configmap_name,
    scheduling,
    served_model_names,
    slug,
    termination_grace_seconds,
)
from dspark_operator.spec import GROUP, ServiceSpec, flag_args

API_VERSION = "ray.io/v1"
KIND = "RayService"
IMPORT_PATH = "dspark.serving.app:build_app"
# The deployment of a tier's application that holds the engines; its num_replicas is the tier's.
ENGINE_DEPLOYMENT = "EngineBackend"
PROFILES_MOUNT = "/etc/dspark/profiles"
GPU_RESOURCE = "nvidia.com/gpu"
# Read back by a scaling pass: which node type each tier's replicas count against, and how many
# replicas one worker pod holds.
ANNOTATION_PLACEMENTS = f"{GROUP}/placements"
ANNOTATION_REPLICA_SLOTS = f"{GROUP}/replica-slots"
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}


def rayservice_name(service: str) -> str:
    """KubeRay names the cluster, its Services and pods after it: room for their suffixes."""
    return service[:40].rstrip("-")


def serve_service_name(service: str) -> str:
    """The Service KubeRay puts in front of the Serve proxies."""
    return f"{rayservice_name(service)}-serve-svc"


def replica_gpus(spec: ServiceSpec) -> int:
    """GPUs of a worker pod: `resources`' nvidia.com/gpu limit (or request), 0 without."""
    for section in ("limits", "requests"):
        value = (spec.resources.get(section) or {}).get(GPU_RESOURCE)
        if value is not None:
            return int(value)
    return 0


def replica_slots(spec: ServiceSpec) -> int:
    """Replicas one worker pod holds: one per GPU, or one on a pod without GPUs."""
    return max(1, replica_gpus(spec))


def profile_path(node_type: str) -> str:
    return f"{PROFILES_MOUNT}/{slug(node_type)}/{PROFILE_KEY}"


def serve_args(spec: ServiceSpec, service: str, node_types: Iterable[str]) -> dict[str, Any]:
    """The `args` of a tier's application: the settings the Deployment mode's command line and
    environment give `dspark serve`, and the profile of every node type a replica may land on."""
    args: dict[str, Any] = {"target": spec.model.target}
    if spec.model.drafter:
        args["drafter"] = spec.model.drafter
    args |= {
        "policy": spec.policy,
        "dtype": spec.dtype,
        "device": "cuda",
        "served_model_name": served_model_names(spec, service),
        "graceful_shutdown_timeout_s": spec.serving.drain_seconds,
        "sps_profiles": {node_type: profile_path(node_type) for node_type in node_types},
        # The ingress and a routed engine deployment at any replica count, so that the tier's
        # replicas are always the engine deployment's to set.
        "router": "prefix",
    }
    if replica_gpus(spec):
        args["num_gpus_per_replica"] = 1
    return args | flag_args(spec.extra_args)


def fit_workers(
    placements: Mapping[str, str], replicas: Mapping[str, int], slots: int, node_types: Iterable[str]
) -> dict[str, int]:
    """Worker pods per node type: enough slots for the replicas of the tiers placed on it."""
    needed = dict.fromkeys(node_types, 0)
    for tier, node_type in placements.items():
        needed[node_type] = needed.get(node_type, 0) + replicas.get(tier, 0)
    return {node_type: math.ceil(count / slots) for node_type, count in needed.items()}


def serve_config(
    spec: ServiceSpec, service: str, placements: Mapping[str, str], replicas: Mapping[str, int]
) -> dict[str, Any]:
    """serveConfigV2 as a dict: one application per placed tier, under the route prefix /<tier>."""
    node_types = sorted(set(placements.values()))
    applications = [
        {
            "name": tier.name,
            "route_prefix": f"/{tier.name}",
            "import_path": IMPORT_PATH,
            "args": serve_args(spec, service, node_types),
            "deployments": [{"name": ENGINE_DEPLOYMENT, "num_replicas": replicas[tier.name]}],
        }
        for tier in spec.tiers
        if tier.name in placements
    ]
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": spec.serving.port},
        "applications": applications,
    }


def _ray_container(
    spec: ServiceSpec, name: str, ports: dict[str, int], env: list[dict[str, Any]], mounts: list[dict]
) -> dict[str, Any]:
    """The Ray container of a head or worker pod; KubeRay supplies its `ray start` command and probes."""
    return {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "ports": [
            {"name": port, "containerPort": number, "protocol": "TCP"} for port, number in ports.items()
        ],
        "env": [
            *env,
            *pod_security.writable_env(),
            *(
                [{"name": "DSPARK_CALIBRATION", "value": spec.model.calibration}]
                if spec.model.calibration
                else []
            ),
            *pod_security.user_env(spec, with_api_key=True),
        ],
        "volumeMounts": [
            *pod_security.writable_mounts(),
            {"name": "shm", "mountPath": "/dev/shm"},  # Ray's object store; the default is 64 MiB
            *mounts,
        ],
        "securityContext": pod_security.container_security_context(),
    }


def _pod_spec(spec: ServiceSpec, container: dict[str, Any], volumes: list[dict]) -> dict[str, Any]:
    return {
        "automountServiceAccountToken": False,
        "securityContext": pod_security.pod_security_context(spec),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [container],
        "volumes": [
            *pod_security.writable_volumes(),
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            *volumes,
        ],
    }


def _quoted_resources(resources: Mapping[str, float]) -> str:
    """rayStartParams' `resources`: JSON inside double quotes, as `ray start --resources` takes it
    through KubeRay's shell command line."""
    return '"' + json.dumps(dict(resources)).replace('"', '\\"') + '"'


def _head_group(spec: ServiceSpec, service: str) -> dict[str, Any]:
    volumes, mounts = model_volumes(spec)
    container = _ray_container(spec, "ray-head", {**HEAD_PORTS, "serve": spec.serving.port}, [], mounts)
    container["resources"] = spec.ray_service.head_resources
    pod = _pod_spec(spec, container, volumes)
    # No node-type selector or affinity: the head runs no engine. The service's tolerations and
    # pull secrets still apply.
    if spec.tolerations:
        pod["tolerations"] = list(spec.tolerations)
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": secret.name} for secret in spec.image_pull_secrets]
    return {
        "rayStartParams": {"dashboard-host": "0.0.0.0"},
        "template": {"metadata": {"labels": base_labels(service, "ray")}, "spec": pod},
    }


def _worker_group(
    spec: ServiceSpec,
    service: str,
    node_label: str,
    node_type: str,
    fingerprint: str,
    workers: int,
    max_workers: int,
) -> dict[str, Any]:
    """A worker group on one node type, its profile mounted where `sps_profiles` names it."""
    volumes, mounts = model_volumes(spec)
    profile_dir = profile_path(node_type).rsplit("/", 1)[0]
    env = [{"name": "DSPARK_NODE_TYPE", "value": node_type}]
    mounts = [{"name": "sps-profile", "mountPath": profile_dir, "readOnly": True}, *mounts]
    container = _ray_container(spec, "ray-worker", {"serve": spec.serving.port}, env, mounts)
    if spec.resources:
        container["resources"] = spec.resources
    profile_volume = {
        "name": "sps-profile",
        "configMap": {
            "name": profile_configmap_name(service, node_type),
            "items": [{"key": PROFILE_KEY, "path": PROFILE_KEY}],
        },
    }
    pod = {
        **_pod_spec(spec, container, [profile_volume, *volumes]),
        **scheduling(spec, node_label, node_type),
    }
    resources = node_resources(node_type, replica_slots(spec))
    return {
        "groupName": slug(node_type),
        "replicas": workers,
        "minReplicas": 0,
        "maxReplicas": max(workers, max_workers),
        "rayStartParams": {"resources": _quoted_resources(resources)},
        "template": {
            "metadata": {
                "labels": {**base_labels(service, "ray"), LABEL_NODE_TYPE: slug(node_type)},
                # A new profile changes the template, and KubeRay upgrades the cluster onto it.
                "annotations": {ANNOTATION_NODE_TYPE: node_type, LABEL_FINGERPRINT: fingerprint},
            },
            "spec": pod,
        },
    }


def build_rayservice(
    body: dict[str, Any],
    spec: ServiceSpec,
    node_label: str,
    ready: Mapping[str, str],
    placements: Mapping[str, str],
    replicas: Mapping[str, int],
) -> dict[str, Any]:
    """The service's RayService: a worker group per node type with a ready profile (`ready`: node
    type -> fingerprint), an application per placed tier (`placements`: tier -> node type) with
    `replicas[tier]` engine replicas."""
    service = body["metadata"]["name"]
    slots = replica_slots(spec)
    node_types = [t for t in spec.node_types if t in ready]
    workers = fit_workers(placements, replicas, slots, node_types)
    most = fit_workers(placements, {t.name: t.max_replicas for t in spec.tiers}, slots, node_types)
    cluster: dict[str, Any] = {
        "headGroupSpec": _head_group(spec, service),
        "workerGroupSpecs": [
            _worker_group(spec, service, node_label, t, ready[t], workers[t], most[t]) for t in node_types
        ],
    }
    if spec.ray_service.ray_version:
        cluster = {"rayVersion": spec.ray_service.ray_version, **cluster}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": rayservice_name(service),
            "namespace": body["metadata"]["namespace"],
            "labels": base_labels(service, "serving"),
            "annotations": {
                ANNOTATION_PLACEMENTS: json.dumps(dict(placements), sort_keys=True),
                ANNOTATION_REPLICA_SLOTS: str(slots),
            },
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "serveConfigV2": yaml.safe_dump(
                serve_config(spec, service, placements, replicas), sort_keys=False
            ),
            "rayClusterConfig": cluster,
        },
    }


def tier_replicas(rayservice: dict[str, Any]) -> dict[str, int]:
    """Each application's engine replicas, as serveConfigV2 holds them."""
    config = yaml.safe_load(rayservice["spec"].get("serveConfigV2") or "") or {}
    found: dict[str, int] = {}
    for app in config.get("applications") or []:
        for deployment in app.get("deployments") or []:
            if deployment.get("name") == ENGINE_DEPLOYMENT:
                found[app["name"]] = int(deployment.get("num_replicas", 1))
    return found


def scale_patch(rayservice: dict[str, Any], tier: str, replicas: int) -> dict[str, Any]:
    """A merge patch setting one tier's engine replicas and refitting the worker groups to them."""
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    for app in config["applications"]:
        if app["name"] == tier:
            for deployment in app["deployments"]:
                if deployment["name"] == ENGINE_DEPLOYMENT:
                    deployment["num_replicas"] = replicas
    annotations = rayservice["metadata"].get("annotations") or {}
    placements = json.loads(annotations.get(ANNOTATION_PLACEMENTS) or "{}")
    slots = int(annotations.get(ANNOTATION_REPLICA_SLOTS) or 1)
    groups = [dict(g) for g in rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []]
    node_types = {
        g["groupName"]: g["template"]["metadata"]["annotations"][ANNOTATION_NODE_TYPE] for g in groups
    }
    workers = fit_workers(
        placements, {**tier_replicas(rayservice), tier: replicas}, slots, node_types.values()
    )
    for group in groups:
        group["replicas"] = workers[node_types[group["groupName"]]]
        group["maxReplicas"] = max(group["maxReplicas"], group["replicas"])
    return {
        "spec": {
            "serveConfigV2": yaml.safe_dump(config, sort_keys=False),
            "rayClusterConfig": {"workerGroupSpecs": groups},
        }
    }
