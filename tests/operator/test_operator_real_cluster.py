"""End-to-end on a real cluster (kind, k3d or a GPU cluster) where one is configured.

Opt in with DSPARK_E2E_KUBECONFIG=<path>; the chart's CRD must be installed and the operator
running (docs/deploy-kubernetes.md). It creates a service, checks that profiling Jobs appear for
the node types present, and deletes it again.
"""

from __future__ import annotations

import os
import time

import pytest

KUBECONFIG = os.environ.get("DSPARK_E2E_KUBECONFIG")

pytestmark = pytest.mark.skipif(
    not KUBECONFIG, reason="no Kubernetes cluster here: set DSPARK_E2E_KUBECONFIG to run against a real one"
)


def test_service_gets_profiling_jobs_on_a_real_cluster(monkeypatch):
    from dspark_operator.kube import Kube, load_client_configuration
    from operator_fixtures import service

    monkeypatch.setenv("KUBECONFIG", KUBECONFIG)
    load_client_configuration()
    kube = Kube.from_default_configuration()
    nodes = kube.list("Node", None)
    labels = {(n["metadata"].get("labels") or {}).get("nvidia.com/gpu.product") for n in nodes} - {None}
    if not labels:
        pytest.skip("the cluster has no node labelled nvidia.com/gpu.product")
    namespace = os.environ.get("DSPARK_E2E_NAMESPACE", "default")
    body = service(nodeTypes=sorted(labels))
    body["metadata"] = {"name": "dspark-e2e", "namespace": namespace}
    path = f"/apis/dspark.ai/v1alpha1/namespaces/{namespace}/dsparkservices"
    kube._call("POST", path, body=body)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            jobs = kube.list("Job", namespace, {"dspark.ai/service": "dspark-e2e"})
            if len(jobs) == len(labels):
                break
            time.sleep(2)
        assert len(jobs) == len(labels)
    finally:
        kube._call("DELETE", f"{path}/dspark-e2e")
