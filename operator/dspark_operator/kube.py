"""A small JSON-in, JSON-out layer over the official Kubernetes client's REST transport.

Objects stay plain dicts end to end (the builders produce dicts, the handlers read dicts), so
the typed models' (de)serialization is bypassed; authentication, TLS and the kubeconfig or
in-cluster configuration are the official client's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes

# kind -> (API path prefix, plural, namespaced)
RESOURCES: dict[str, tuple[str, str, bool]] = {
    "Node": ("/api/v1", "nodes", False),
    "Pod": ("/api/v1", "pods", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Service": ("/api/v1", "services", True),
    "Job": ("/apis/batch/v1", "jobs", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "InferenceService": ("/apis/serving.kserve.io/v1beta1", "inferenceservices", True),
    "RayService": ("/apis/ray.io/v1", "rayservices", True),
    "CustomResourceDefinition": ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def labels_match(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def load_client_configuration() -> None:
    """In-cluster service account when running in a pod, else the local kubeconfig."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        # Read KUBECONFIG now: the client's own default is frozen when it is imported.
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


def connection_settings() -> dict[str, Any]:
    """The loaded client configuration as kopf.ConnectionInfo keyword arguments."""
    conf = kubernetes.client.Configuration.get_default_copy()
    token = (conf.api_key or {}).get("authorization") or (conf.api_key or {}).get("BearerToken") or ""
    scheme, _, token = token.partition(" ") if " " in token else ("Bearer", "", token)
    return {
        "server": conf.host,
        "ca_path": conf.ssl_ca_cert,
        "insecure": not conf.verify_ssl,
        "scheme": scheme if token else None,
        "token": token or None,
        "certificate_path": conf.cert_file,
        "private_key_path": conf.key_file,
    }


@dataclass
class Kube:
    api: kubernetes.client.ApiClient

    @classmethod
    def from_default_configuration(cls) -> Kube:
        return cls(kubernetes.client.ApiClient())

    def _path(self, kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural, namespaced = RESOURCES[kind]
        path = prefix + (f"/namespaces/{namespace}" if namespaced and namespace else "") + f"/{plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        raw: bool = False,
    ) -> Any:
        params = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json, */*", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*params)
        data = response.read()
        if response.status >= 400:
            try:
                message = json.loads(data).get("message", "")
            except ValueError:
                message = data.decode(errors="replace")[:500]
            raise KubeError(response.status, message)
        if raw:
            return data.decode()
        return json.loads(data) if data else {}

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self._path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, kind: str, namespace: str | None, labels: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} if labels else None
        items = self._call("GET", self._path(kind, namespace), query=query).get("items", [])
        # Filter here as well: the selector is an optimization, the match is the contract.
        return [item for item in items if labels_match(item, labels or {})]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", self._path(obj["kind"], obj["metadata"].get("namespace")), body=obj)

    def patch(self, kind: str, namespace: str | None, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            "PATCH",
            self._path(kind, namespace, name),
            body=patch,
            content_type="application/merge-patch+json",
        )

    def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        """Delete with background propagation; False if it was already gone."""
        try:
            self._call("DELETE", self._path(kind, namespace, name), body={"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def pod_log(self, namespace: str, name: str, container: str) -> str:
        return self._call(
            "GET", self._path("Pod", namespace, name, "log"), query={"container": container}, raw=True
        )

    def crd_exists(self, name: str) -> bool:
        try:
            return self.get("CustomResourceDefinition", None, name) is not None
        except KubeError as exc:
            if exc.status == 403:
                return False  # not allowed to look: treat as absent, the caller reports it
            raise

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves the resource (its CRD is installed), from API discovery:
        a small answer that every authenticated client may read."""
        try:
            found = self._call("GET", f"/apis/{api_version}")
        except KubeError as exc:
            if exc.status in (403, 404):
                return False
            raise
        return any(r.get("name") == plural for r in found.get("resources") or [])

    def apply(self, obj: dict[str, Any], keep_replicas: bool = False) -> tuple[dict[str, Any], bool]:
        """Create the object or merge-patch it to the built form; returns (object, created).

        With keep_replicas, an existing object's replica fields are left alone: the autoscaler,
        not the reconciler, owns them.
        """
        meta = obj["metadata"]
        existing = self.get(obj["kind"], meta.get("namespace"), meta["name"])
        if existing is None:
            return self.create(obj), True
        patch = json.loads(json.dumps(obj))
        if keep_replicas:
            spec = patch.get("spec", {})
            spec.pop("replicas", None)
            spec.get("predictor", {}).pop("minReplicas", None)
            spec.get("predictor", {}).pop("maxReplicas", None)
        return self.patch(obj["kind"], meta.get("namespace"), meta["name"], patch), False
