"""Pure builders of every object the operator creates: plain dicts, no API calls."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from dspark.sps_format import PROFILE_BEGIN, PROFILE_END

from dspark_operator import pod_security
from dspark_operator.spec import GROUP, KIND, VERSION, ServiceSpec, TierSpec

MANAGED_BY = "dspark-operator"
LABEL_SERVICE = f"{GROUP}/service"
LABEL_TIER = f"{GROUP}/tier"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_NODE_TYPE = f"{GROUP}/node-type"  # a DNS-safe slug of the node-type label value
LABEL_FINGERPRINT = f"{GROUP}/profile-fingerprint"
ANNOTATION_NODE_TYPE = f"{GROUP}/node-type"  # the exact label value
PROFILE_KEY = "profile.json"
PROFILE_MOUNT = "/etc/dspark/profile"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
RAY_DRAINING_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
RAY_STOP_SECONDS = 30  # serve.shutdown() and ray.shutdown() after the drain, with room to spare


def slug(value: str, max_len: int = 20) -> str:
    """A DNS-1123 label fragment for an arbitrary string, unique by a short hash suffix."""
    digest = hashlib.sha256(value.encode()).hexdigest()[:6]
    clean = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:max_len].strip("-")
    return f"{clean}-{digest}" if clean else digest


def profile_fingerprint(spec: ServiceSpec, node_type: str) -> str:
    """Changes whenever a profile would measure something different: image, model, drafter, dtype, args."""
    material = {
        "image": spec.image,
        "target": spec.model.target,
        "drafter": spec.model.drafter,
        "dtype": spec.dtype,
        "args": list(spec.profiling.extra_args),
        "node_type": node_type,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:10]


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def base_labels(service: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dspark",
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_SERVICE: service,
        LABEL_COMPONENT: component,
    }


def profile_job_name(service: str, node_type: str, fingerprint: str) -> str:
    return f"{service[:20].rstrip('-')}-prof-{slug(node_type)}-{fingerprint[:6]}"


def profile_configmap_name(service: str, node_type: str) -> str:
    return f"{service}-profile-{slug(node_type)}"


def workload_name(service: str, tier: str) -> str:
    return f"{service[:42].rstrip('-')}-{tier}"


def model_volumes(spec: ServiceSpec) -> tuple[list[dict], list[dict]]:
    if spec.model.pvc is None:
        return [], []
    pvc = spec.model.pvc
    mount: dict[str, Any] = {"name": "models", "mountPath": pvc.mount_path, "readOnly": True}
    if pvc.sub_path:
        mount["subPath"] = pvc.sub_path
    volume = {"name": "models", "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True}}
    return [volume], [mount]


def scheduling(spec: ServiceSpec, node_label: str, node_type: str) -> dict[str, Any]:
    """Pod spec fields placing a pod on one node type: its selector, the GPU toleration and the
    service's own tolerations, affinity and image pull secrets."""
    fields: dict[str, Any] = {
        "nodeSelector": {node_label: node_type},
        "tolerations": [GPU_TOLERATION, *(t for t in spec.tolerations if t != GPU_TOLERATION)],
    }
    if spec.affinity:
        fields["affinity"] = spec.affinity
    if spec.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": secret.name} for secret in spec.image_pull_secrets]
    return fields


def build_profile_job(
    body: dict[str, Any], spec: ServiceSpec, node_label: str, node_type: str, fingerprint: str
) -> dict[str, Any]:
    """A one-shot Job measuring the SPS curve on one node type.

    The pod prints the profile JSON between marker lines on stdout; the operator reads it from
    the pod log once the Job succeeds. Retries are the operator's (with backoff), so the Job
    itself never retries (backoffLimit 0) and is bounded by activeDeadlineSeconds.
    """
    service = body["metadata"]["name"]
    labels = {
        **base_labels(service, "profile"),
        LABEL_NODE_TYPE: slug(node_type),
        LABEL_FINGERPRINT: fingerprint,
    }
    annotations = {ANNOTATION_NODE_TYPE: node_type}
    volumes, mounts = model_volumes(spec)
    # Through TMPDIR (the pod's /tmp emptyDir): the command names no path of the pod's own.
    output = '"$TMPDIR/profile.json"'
    script = (
        f'set -e; dspark profile "$@" --output {output}; '
        f"echo '{PROFILE_BEGIN}'; cat {output}; echo; echo '{PROFILE_END}'"
    )
    # The serving replicas' drafter too: the forward they time captures its target layers.
    drafter = ["--drafter", spec.model.drafter] if spec.model.drafter else []
    args = ["--target", spec.model.target, *drafter, "--dtype", spec.dtype, *spec.profiling.extra_args]
    container: dict[str, Any] = {
        "name": "profile",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["/bin/sh", "-c", script, "dspark-profile", *args],
        "env": [
            {"name": "DSPARK_NODE_TYPE", "value": node_type},
            *pod_security.writable_env(),
            *pod_security.user_env(spec, with_api_key=False),
        ],
        "volumeMounts": [*pod_security.writable_mounts(), *mounts],
        "securityContext": pod_security.container_security_context(),
    }
    if spec.resources:
        container["resources"] = spec.resources
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": profile_job_name(service, node_type, fingerprint),
            "namespace": body["metadata"]["namespace"],
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": spec.profiling.timeout_seconds,
            "ttlSecondsAfterFinished": 24 * 3600,
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security.pod_security_context(spec),
                    **scheduling(spec, node_label, node_type),
                    "containers": [container],
                    "volumes": [*pod_security.writable_volumes(), *volumes],
                },
            },
        },
    }


def build_profile_configmap(
    body: dict[str, Any], node_type: str, fingerprint: str, profile_json: str
) -> dict[str, Any]:
    service = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": profile_configmap_name(service, node_type),
            "namespace": body["metadata"]["namespace"],
            "labels": {
                **base_labels(service, "profile"),
                LABEL_NODE_TYPE: slug(node_type),
                LABEL_FINGERPRINT: fingerprint,
            },
            "annotations": {ANNOTATION_NODE_TYPE: node_type},
            "ownerReferences": [owner_reference(body)],
        },
        "data": {PROFILE_KEY: profile_json},
    }


def served_model_names(spec: ServiceSpec, service: str) -> list[str]:
    """The model ids a tier's server answers to: `model.servedModelNames`, else the service's name
    (what clients of every tier send) and the target as the server would name it itself."""
    if spec.model.served_model_names:
        return list(spec.model.served_model_names)
    target = spec.model.target.split("@", 1)[0]
    return [service] if target.startswith("/") or target == service else [service, target]


def _serving_pod_spec(
    spec: ServiceSpec,
    service: str,
    tier: TierSpec,
    node_label: str,
    node_type: str,
    profile_configmap: str,
    kserve: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(container, pod spec) of a serving replica of one tier on one node type; `kserve` serves
    KServe's protocols (v2 and /openai) for an InferenceService."""
    volumes, mounts = model_volumes(spec)
    port = spec.serving.port
    command = ["dspark", "serve", "--target", spec.model.target]
    if spec.model.drafter:
        command += ["--drafter", spec.model.drafter]
    command += ["--policy", spec.policy, "--dtype", spec.dtype, "--device", "cuda"]
    # Probes and the Service reach the pod's IP; the server's default host is loopback only.
    command += ["--host", "0.0.0.0", "--port", str(port)]
    command += ["--served-model-name", *served_model_names(spec, service)]
    if kserve:
        command.append("--kserve")
    command += list(spec.extra_args)
    env = [
        {"name": "DSPARK_SPS_PROFILE", "value": f"{PROFILE_MOUNT}/{PROFILE_KEY}"},
        {"name": "DSPARK_TIER", "value": tier.name},
        {"name": "DSPARK_NODE_TYPE", "value": node_type},
        {"name": "DSPARK_GRACEFUL_SHUTDOWN_TIMEOUT_S", "value": str(spec.serving.drain_seconds)},
        *pod_security.writable_env(),
    ]
    if spec.model.calibration:
        env.append({"name": "DSPARK_CALIBRATION", "value": spec.model.calibration})
    container: dict[str, Any] = {
        "name": "dspark",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": [*env, *pod_security.user_env(spec, with_api_key=True)],
        # Loading weights can take minutes: the startup probe guards liveness until /health answers.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 90,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "volumeMounts": [
            {"name": "sps-profile", "mountPath": PROFILE_MOUNT, "readOnly": True},
            *pod_security.writable_mounts(),
            *mounts,
        ],
        "securityContext": pod_security.container_security_context(),
    }
    if spec.serving.pre_stop_seconds:
        # Kubernetes takes a stopping pod out of its Service's endpoints while this runs, and
        # kube-proxy stops sending it new connections; the SIGTERM (and the drain) comes after.
        container["lifecycle"] = {
            "preStop": {"exec": {"command": ["sleep", str(spec.serving.pre_stop_seconds)]}}
        }
    if spec.resources:
        container["resources"] = spec.resources
    pod_spec = {
        "automountServiceAccountToken": False,  # the server never calls the Kubernetes API
        "securityContext": pod_security.pod_security_context(spec),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        **scheduling(spec, node_label, node_type),
        "volumes": [
            {
                "name": "sps-profile",
                "configMap": {
                    "name": profile_configmap,
                    "items": [{"key": PROFILE_KEY, "path": PROFILE_KEY}],
                },
            },
            *pod_security.writable_volumes(),
            *volumes,
        ],
    }
    return container, pod_spec


def termination_grace_seconds(spec: ServiceSpec) -> int:
    """Longer than a serving pod's slowest stop, so the kubelet never kills a drain halfway.

    The stop is the preStop wait, then up to two drains of `drainSeconds` (KServe's front end
    finishes its requests, then the Ray replica its own; Ray stretches the replica's to a
    direct-ingress draining period set in `env`, plus 5 s), then Ray's own shutdown.
    """
    drain = spec.serving.drain_seconds
    draining = next((e.get("value") for e in spec.env if e.get("name") == RAY_DRAINING_ENV), None)
    try:
        replica_drain = max(drain, float(draining) + 5) if draining is not None else drain
    except ValueError:
        replica_drain = drain
    return int(spec.serving.pre_stop_seconds + drain + replica_drain + RAY_STOP_SECONDS)


def _serving_meta(
    body: dict[str, Any], tier: TierSpec, node_type: str, fingerprint: str
) -> tuple[dict, dict, dict]:
    service = body["metadata"]["name"]
    selector = {LABEL_SERVICE: service, LABEL_TIER: tier.name}
    labels = {**base_labels(service, "serving"), **selector, LABEL_NODE_TYPE: slug(node_type)}
    annotations = {ANNOTATION_NODE_TYPE: node_type, LABEL_FINGERPRINT: fingerprint}
    return selector, labels, annotations


def build_serving_deployment(
    body: dict[str, Any],
    spec: ServiceSpec,
    tier: TierSpec,
    node_label: str,
    node_type: str,
    fingerprint: str,
    replicas: int,
) -> dict[str, Any]:
    """A tier's serving Deployment pinned to one node type with that type's profile mounted.

    The profile fingerprint sits in the pod template, so a new profile rolls the replicas.
    """
    selector, labels, annotations = _serving_meta(body, tier, node_type, fingerprint)
    name = body["metadata"]["name"]
    container, pod_spec = _serving_pod_spec(
        spec, name, tier, node_label, node_type, profile_configmap_name(name, node_type)
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": workload_name(body["metadata"]["name"], tier.name),
            "namespace": body["metadata"]["namespace"],
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": {**pod_spec, "containers": [container]},
            },
        },
    }


def build_serving_service(body: dict[str, Any], spec: ServiceSpec, tier: TierSpec) -> dict[str, Any]:
    service = body["metadata"]["name"]
    selector = {LABEL_SERVICE: service, LABEL_TIER: tier.name}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": workload_name(service, tier.name),
            "namespace": body["metadata"]["namespace"],
            "labels": {**base_labels(service, "serving"), **selector},
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": spec.serving.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_inference_service(
    body: dict[str, Any],
    spec: ServiceSpec,
    tier: TierSpec,
    node_label: str,
    node_type: str,
    fingerprint: str,
    replicas: int,
) -> dict[str, Any]:
    """A KServe InferenceService in raw deployment mode whose replica count the operator owns.

    KServe's own autoscaler is switched off (autoscalerClass external) and min = max replicas,
    so the only writer of the replica count is this operator.
    """
    _, labels, annotations = _serving_meta(body, tier, node_type, fingerprint)
    name = body["metadata"]["name"]
    container, pod_spec = _serving_pod_spec(
        spec, name, tier, node_label, node_type, profile_configmap_name(name, node_type), kserve=True
    )
    container = {**container, "name": "kserve-container"}
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": workload_name(body["metadata"]["name"], tier.name),
            "namespace": body["metadata"]["namespace"],
            "labels": labels,
            "annotations": {
                **annotations,
                "serving.kserve.io/deploymentMode": "RawDeployment",
                "serving.kserve.io/autoscalerClass": "external",
            },
            "ownerReferences": [owner_reference(body)],
        },
        "spec": {
            "predictor": {
                "minReplicas": replicas,
                "maxReplicas": max(replicas, 1),
                "labels": labels,
                **pod_spec,
                "containers": [container],
            }
        },
    }
