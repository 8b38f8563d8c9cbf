"""The Helm chart: lint, render with several value sets, validate every manifest against the
Kubernetes schemas, the example service against the CRD's own schema, and reject bad values."""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dspark_operator import builders, ray_builders
from dspark_operator.autoscaler import DESIRED_REPLICAS
from dspark_operator.spec import ServiceSpec

from scripts.fetch_helm import fetch_helm
from tests.operator.crd_schemas import crd_schema, kuberay_validator, to_json_schema

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dspark"
CRD = ROOT / "operator" / "dspark_operator" / "crds" / "dsparkservices.dspark.ai.yaml"
K8S_VERSION = "1.30"

EVERYTHING_ON = [
    "--set",
    "example.enabled=true",
    "--set",
    "metrics.serviceMonitor.enabled=true",
    "--set",
    "metrics.grafanaDashboard.enabled=true",
]
VALUE_SETS = {
    "defaults": [],
    "everything": EVERYTHING_ON,
    "namespaced": [
        *EVERYTHING_ON,
        "--set",
        "operator.watchNamespaces={team-a,team-b}",
        "--set",
        "operator.prometheusUrl=http://prometheus.monitoring:9090",
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=ops",
        "--set",
        "operator.metricsPort=0",
        "--set",
        "operator.image.tag=dev",
    ],
    "clusterwide": [
        *EVERYTHING_ON,
        "--set",
        "operator.clusterWide=true",
        "--set-json",
        'networkPolicy.servingFrom=[{"namespaceSelector": {"matchLabels": {"team": "gateway"}}}]',
    ],
}


@pytest.fixture(scope="session")
def helm() -> str:
    return str(fetch_helm())


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def render(helm: str, values: list[str]) -> list[dict]:
    result = run_helm(
        helm, "template", "rel", str(CHART), "--namespace", "serving", "--include-crds", *values
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def crd_json_schema() -> dict:
    return to_json_schema(crd_schema())


def test_chart_crd_is_the_operators_crd():
    assert filecmp.cmp(CRD, CHART / "crds" / CRD.name, shallow=False)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict(helm, name):
    result = run_helm(helm, "lint", "--strict", str(CHART), *VALUE_SETS[name])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_manifests_are_valid(helm, name):
    docs = render(helm, VALUE_SETS[name])
    kinds = {doc["kind"] for doc in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "ClusterRoleBinding"} <= kinds
    for doc in docs:
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            # Not in the Kubernetes schemas (prometheus-operator's CRD): check what it must have.
            assert doc["spec"]["endpoints"] and doc["spec"]["selector"]["matchLabels"]
        elif doc["kind"] == "DSparkService":
            jsonschema.validate(doc, crd_json_schema())
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_everything_renders_example_monitoring_and_dashboard(helm):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render(helm, EVERYTHING_ON)}
    example = docs[("DSparkService", "chat")]
    assert [t["name"] for t in example["spec"]["tiers"]] == ["interactive", "batch"]
    assert example["spec"]["image"] == "ghcr.io/dspark/dspark-serve:0.1.0"
    monitor = docs[("ServiceMonitor", "rel-dspark-serving")]
    assert {r["targetLabel"] for r in monitor["spec"]["endpoints"][0]["relabelings"]} >= {
        "dspark_service",
        "dspark_tier",
    }
    dashboard = json.loads(docs[("ConfigMap", "rel-dspark-dashboard")]["data"]["dspark.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "dspark_request_tokens_per_second",
        "vllm:time_to_first_token_seconds",
        "dspark_desired_replicas",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "dspark_sps_estimate",
    ):
        assert metric in exprs


# Labels Prometheus puts on every series it scrapes, from its target (the pod, its Service): a
# scraped series' own label of one of these names is renamed exported_<name>.
TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}


def test_dashboard_selects_the_operators_series_by_the_labels_it_keeps(helm):
    own = set(DESIRED_REPLICAS._labelnames)
    assert not own & TARGET_LABELS
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render(helm, EVERYTHING_ON)}
    dashboard = json.loads(docs[("ConfigMap", "rel-dspark-dashboard")]["data"]["dspark.json"])
    targets = [t for p in dashboard["panels"] for t in p["targets"] if "dspark_desired_replicas" in t["expr"]]
    assert targets
    for target in targets:
        for matchers in re.findall(r"dspark_desired_replicas\{([^}]*)\}", target["expr"]):
            assert {m.split("=")[0].strip() for m in matchers.split(",")} <= own, target["expr"]
        assert set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"])) <= own, target["legendFormat"]


def test_serving_scheduling_values_reach_the_pods_the_operator_builds(helm):
    toleration = {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    }
    values = [
        *EVERYTHING_ON,
        "--set-json",
        f"serving.tolerations={json.dumps([toleration])}",
        "--set-json",
        f"serving.affinity={json.dumps(affinity)}",
        "--set-json",
        'serving.imagePullSecrets=[{"name": "registry"}]',
    ]
    example = next(d for d in render(helm, values) if d["kind"] == "DSparkService")
    jsonschema.validate(example, crd_json_schema())
    body = {**example, "metadata": {**example["metadata"], "uid": "u-1"}}
    spec = ServiceSpec.model_validate(example["spec"])
    tier, node_type = spec.tiers[0], spec.node_types[0]
    pods = [
        builders.build_profile_job(body, spec, "gpu", node_type, "fp")["spec"]["template"]["spec"],
        builders.build_serving_deployment(body, spec, tier, "gpu", node_type, "fp", 1)["spec"]["template"][
            "spec"
        ],
        builders.build_inference_service(body, spec, tier, "gpu", node_type, "fp", 1)["spec"]["predictor"],
    ]
    for pod in pods:
        assert pod["tolerations"] == [builders.GPU_TOLERATION, toleration]
        assert pod["affinity"] == affinity and pod["imagePullSecrets"] == [{"name": "registry"}]
    assert not {"tolerations", "affinity", "imagePullSecrets"} & set(
        next(d for d in render(helm, EVERYTHING_ON) if d["kind"] == "DSparkService")["spec"]
    )
    result = run_helm(
        helm, "template", "rel", str(CHART), "--set-json", 'serving.imagePullSecrets=[{"secret": "x"}]'
    )
    assert result.returncode != 0 and "name" in result.stderr


def test_the_examples_rayservice_runtime_builds_a_rayservice_kuberay_accepts(helm):
    values = [
        *EVERYTHING_ON,
        "--set",
        "example.runtime=rayservice",
        "--set",
        "example.rayService.rayVersion=2.60.0",
        "--set-json",
        'example.extraArgs=["--max-num-seqs", "32"]',
    ]
    example = next(d for d in render(helm, values) if d["kind"] == "DSparkService")
    jsonschema.validate(example, crd_json_schema())
    assert example["spec"]["runtime"] == "rayservice"
    body = {**example, "metadata": {**example["metadata"], "uid": "u-1"}}
    spec = ServiceSpec.model_validate(example["spec"])
    ready = {t: "fp" for t in spec.node_types}
    placed = {t.name: spec.node_types[0] for t in spec.tiers}
    replicas = {t.name: t.min_replicas for t in spec.tiers}
    rayservice = ray_builders.build_rayservice(body, spec, "gpu", ready, placed, replicas)
    kuberay_validator().validate(rayservice)
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"


def test_the_operator_may_manage_rayservices_and_nothing_else_of_kuberay(helm):
    for docs in (render(helm, []), render(helm, VALUE_SETS["clusterwide"])):
        rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
        kuberay = [r for r in rules if "ray.io" in r["apiGroups"]]
        assert kuberay == [
            {
                "apiGroups": ["ray.io"],
                "resources": ["rayservices"],
                "verbs": ["get", "create", "patch", "delete"],
            }
        ]


def operator_env(docs: list[dict]) -> dict[str, str]:
    operator = next(d for d in docs if d["kind"] == "Deployment")
    return {e["name"]: e["value"] for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}


def namespaced_grants(docs: list[dict]) -> list[tuple[str, str]]:
    """(namespace, role) of every RoleBinding, each checked to bind a Role of its own namespace."""
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs if d["kind"] == "Role"}
    grants = []
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        key = (binding["metadata"]["namespace"], binding["roleRef"]["name"])
        assert binding["roleRef"]["kind"] == "Role" and key in roles
        grants.append(key)
    return sorted(grants)


def test_rbac_is_namespaced_by_default_and_cluster_wide_on_request(helm):
    docs = render(helm, [])
    assert namespaced_grants(docs) == [("serving", "rel-dspark")]
    assert operator_env(docs)["DSPARK_OPERATOR_NAMESPACES"] == "serving"
    # Cluster-wide only what has no namespace: list nodes, get KServe's CRD.
    cluster_rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert {res for r in cluster_rules for res in r["resources"]} == {"nodes", "customresourcedefinitions"}
    assert {v for r in cluster_rules for v in r["verbs"]} == {"list", "get"}

    docs = render(helm, VALUE_SETS["clusterwide"])
    assert namespaced_grants(docs) == []
    assert operator_env(docs)["DSPARK_OPERATOR_NAMESPACES"] == ""
    bound = {d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding"}
    assert bound == {"rel-dspark", "rel-dspark-cluster"}


def test_network_policies_open_only_the_ports_that_serve(helm):
    docs = render(helm, VALUE_SETS["clusterwide"])
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert [r["ports"] for r in policies["rel-dspark-operator"]["ingress"]] == [
        [{"port": "metrics", "protocol": "TCP"}]
    ]
    serving = policies["rel-dspark-serving"]
    assert serving["podSelector"]["matchLabels"]["dspark.ai/component"] == "serving"
    (rule,) = serving["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # The listed peers, and the operator (it scrapes /metrics when no Prometheus is set).
    assert rule["from"][0] == {"namespaceSelector": {"matchLabels": {"team": "gateway"}}}
    assert rule["from"][1]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert policies["rel-dspark-profiling"]["ingress"] == []
    # Ray pods: all of Ray's traffic among themselves, the Serve port as serving pods' HTTP port,
    # and the head's dashboard and Serve port for KubeRay's operator (any peer unless narrowed).
    ray = policies["rel-dspark-ray"]
    assert ray["podSelector"]["matchLabels"]["dspark.ai/component"] == "ray"
    among, serve, kuberay = ray["ingress"]
    assert (
        "ports" not in among
        and among["from"][0]["podSelector"]["matchLabels"]["dspark.ai/component"] == "ray"
    )
    assert serve["ports"] == [{"port": "serve", "protocol": "TCP"}] and serve["from"] == rule["from"]
    assert kuberay["ports"] == [
        {"port": "dashboard", "protocol": "TCP"},
        {"port": "serve", "protocol": "TCP"},
    ]
    assert "from" not in kuberay
    assert not [
        d for d in render(helm, ["--set", "networkPolicy.enabled=false"]) if d["kind"] == "NetworkPolicy"
    ]


def test_namespaced_install_uses_role_bindings(helm):
    docs = render(helm, VALUE_SETS["namespaced"])
    assert namespaced_grants(docs) == [("team-a", "rel-dspark"), ("team-b", "rel-dspark")]
    serving_policies = [
        d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "rel-dspark-serving"
    ]
    assert sorted(d["metadata"]["namespace"] for d in serving_policies) == ["team-a", "team-b"]
    assert not [d for d in docs if d["kind"] == "ServiceAccount"]
    operator = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e["value"] for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DSPARK_OPERATOR_NAMESPACES"] == "team-a,team-b"
    assert env["DSPARK_OPERATOR_PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"
    assert operator["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":dev")


@pytest.mark.parametrize("name", ["defaults", "clusterwide"])
def test_rbac_is_least_privilege(helm, name):
    docs = render(helm, VALUE_SETS[name])
    rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
    verbs = {v for r in rules for v in r["verbs"]}
    assert "*" not in verbs and not any("*" in r["resources"] for r in rules)
    assert not any("secrets" in r["resources"] for r in rules)
    nodes = next(r for r in rules if "nodes" in r["resources"])
    assert nodes["verbs"] == ["list"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            [
                "--set",
                "example.enabled=true",
                "--set-json",
                'example.tiers=[{"name":"gold","ttftP95Seconds":1}]',
            ],
            "tokensPerSecondPerUser",
        ),
        (
            ["--set-json", 'example.tiers=[{"name":"gold","tokensPerSecondPerUser":-5,"ttftP95Seconds":1}]'],
            "tokensPerSecondPerUser: Must be greater than 0",
        ),
        (["--set", "operator.metricsPort=70000"], "metricsPort"),
        (["--set", "operator.prometheusUrl=prometheus:9090"], "prometheusUrl"),
        (["--set", "operator.unknownKnob=1"], "unknownKnob"),
        (["--set", "serviceAccount.create=false"], "serviceAccount.name is required"),
    ],
)
def test_bad_values_are_rejected(helm, values, message):
    result = run_helm(helm, "template", "rel", str(CHART), *values)
    assert result.returncode != 0
    assert message in result.stderr
