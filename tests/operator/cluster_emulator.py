"""kmock's in-memory Kubernetes, grown the few API-server duties the operator relies on.

Adds what a real API server does and kmock leaves out: uid, resourceVersion, generation,
creationTimestamp and a name from generateName on objects, the garbage collector's cascade along ownerReferences, and 422 for a failed JSON-patch test.
Runs in its own thread and event loop so tests and the operator talk to it over HTTP.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import uuid
from typing import Any

import jsonpatch
import kmock
import yaml

RESOURCES = {
    "dspark.ai/v1alpha1/dsparkservices": kmock.ResourceInfo(
        kind="DSparkService",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
    ),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs={"get", "list", "watch"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch", "create"}
    ),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"create", "list"}),
    "v1/nodes": kmock.ResourceInfo(kind="Node", namespaced=False, verbs={"get", "list", "watch", "create"}),
    "v1/pods": kmock.ResourceInfo(
        kind="Pod",
        namespaced=True,
        subresources={"log"},
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    "v1/configmaps": kmock.ResourceInfo(
        kind="ConfigMap", namespaced=True, verbs={"get", "list", "create", "patch", "delete"}
    ),
    "v1/services": kmock.ResourceInfo(
        kind="Service", namespaced=True, verbs={"get", "list", "create", "patch", "delete"}
    ),
    "batch/v1/jobs": kmock.ResourceInfo(
        kind="Job", namespaced=True, verbs={"get", "list", "create", "patch", "delete"}
    ),
    "apps/v1/deployments": kmock.ResourceInfo(
        kind="Deployment", namespaced=True, verbs={"get", "list", "create", "patch", "delete"}
    ),
    # KubeRay's, for `runtime: rayservice` (its CRD is what tests/fixtures/kuberay holds).
    "ray.io/v1/rayservices": kmock.ResourceInfo(
        kind="RayService",
        namespaced=True,
        subresources={"status"},
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    ),
    # What the chart installs beside the operator's own objects (tests/chart applies it).
    **{
        f"{group_version}/{kind.lower()}s": kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs={"get", "list", "create", "patch", "delete"}
        )
        for group_version, kind, namespaced in [
            ("v1", "ServiceAccount", True),
            ("rbac.authorization.k8s.io/v1", "Role", True),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", True),
            ("rbac.authorization.k8s.io/v1", "ClusterRole", False),
            ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", False),
            ("networking.k8s.io/v1", "NetworkPolicy", True),
        ]
    },
}


# kmock logs every request and matches each new one through the log of its handlers' views, which
# makes a long run quadratic; no test looks back at old requests, so only the recent ones are kept.
REQUEST_LOG = 64


class ClusterEmulator(kmock.KubernetesEmulator):
    _versions = itertools.count(1)

    async def _handle(self, request: kmock.Request):  # type: ignore[override]
        del self._requests[:-REQUEST_LOG]
        if request.resource is not None and isinstance(request.data, dict):
            version = str(next(self._versions))
            if request.action == kmock.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                if not meta.get("name") and meta.get("generateName"):  # kopf's events use it
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).isoformat())
                meta["resourceVersion"] = version
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
            elif request.action == kmock.action.UPDATE:
                request.data.setdefault("metadata", {})["resourceVersion"] = version
        # An owner is gone when its DELETE (no finalizers) or its last finalizer's removal lands;
        # only then does the (background) garbage collector remove its dependents.
        key, owner_uid = None, None
        if request.action in (kmock.action.DELETE, kmock.action.UPDATE) and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                owner_uid = self.objects[key].raw.get("metadata", {}).get("uid")
        try:
            response = await super()._handle(request)
        except jsonpatch.JsonPatchException as exc:
            # The API server answers a failed JSON-patch `test` (kopf's resourceVersion precondition)
            # with 422, which kopf takes as "newer changes pending, retry on the next cycle".
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        if owner_uid is not None and self.objects[key].deleted:
            await self._collect_garbage({owner_uid})
        elif request.action == kmock.action.CREATE and isinstance(request.data, dict):
            # An object created for an owner that is already gone is collected too (as the real GC does).
            refs = {ref.get("uid") for ref in request.data.get("metadata", {}).get("ownerReferences") or []}
            live = {
                obj.raw.get("metadata", {}).get("uid") for obj in self.objects.values() if not obj.deleted
            }
            if refs and not refs & live:
                await self._collect_garbage(refs)
        return response

    async def _collect_garbage(self, uids: set[str]) -> None:
        while uids:
            next_uids: set[str] = set()
            async with self._lock:
                for (resource, _ns, _name), obj in list(self.objects.items()):
                    if obj.deleted:
                        continue
                    raw = obj.raw
                    refs = raw.get("metadata", {}).get("ownerReferences") or []
                    if any(ref.get("uid") in uids for ref in refs):
                        obj.delete()
                        await self._buses[resource].put({"type": "DELETED", "object": raw})
                        next_uids.add(raw["metadata"].get("uid"))
            uids = {u for u in next_uids if u}


class EmulatedCluster:
    """The emulator plus its HTTP server on 127.0.0.1, in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self.pod_logs: dict[str, str] = {}

    def __enter__(self) -> EmulatedCluster:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    async def _start(self) -> None:
        self.emulator = ClusterEmulator()
        for name, info in RESOURCES.items():
            self.emulator.resources[name] = info
        self.emulator["get", kmock.resource("v1/pods"), kmock.subresource("log")] << (
            lambda request: self.pod_logs.get(request.name, "").encode()
        )
        await self.emulator.__aenter__()
        self.server = kmock.Server(self.emulator)
        await self.server.__aenter__()

    async def _stop(self) -> None:
        await self.server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    def kubeconfig(self) -> str:
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                "users": [{"name": "test", "user": {"token": "test-token"}}],
                "contexts": [
                    {"name": "kmock", "context": {"cluster": "kmock", "user": "test", "namespace": "default"}}
                ],
                "current-context": "kmock",
            }
        )
