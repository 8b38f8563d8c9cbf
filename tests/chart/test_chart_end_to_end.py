"""The chart's own example, run for real as far as a machine without a cluster or a GPU allows.

helm renders the chart as docs/deploy-kubernetes.md installs it with the example on; the objects
go into kmock's Kubernetes; the operator runs as its Deployment's command. The test then plays
the Job controller and the kubelet (tests/chart/local_pod.py): the profiling Job's container and
the interactive tier's serving container run as local processes with their manifests' argv and
env, the target coming by hub id from a loopback hub (tests/hub_emulator.py) and the drafter
from the package. The first requests of the docs and of the chart's NOTES then go to the serving
process, through the Service and port their `kubectl port-forward` names.

What this machine changes, and nothing else: the example's engine shape and a quick profile
(through the chart's values), `--device cpu` for the pod's GPU, the pod's address and
port on loopback, the volumes as local directories, HF_ENDPOINT for the hub, and neither an
inductor compile nor the CPU attention kernel's build in the pods (SUITE_ENV).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from dspark_operator.kube import Kube, load_client_configuration

from scripts.fetch_helm import fetch_helm
from tests.chart.local_pod import LocalPod, start_pod
from tests.hub_emulator import HubEmulator, repo_from_dir
from tests.operator.cluster_emulator import RESOURCES, EmulatedCluster
from tests.serving.live_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.real_server]
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dspark"
DOCS = ROOT / "docs" / "deploy-kubernetes.md"
NAMESPACE = "llm"  # the docs' namespace of the example service
JOB_TIMEOUT_S = 300
SERVE_TIMEOUT_S = 300
# What the CPU standing in for the GPU would add: inductor's compile (the suite's engines run eager
# unless DSPARK_COMPILE=1, tests/conftest.py) and the CPU attention kernel's build, which each
# pod's empty cache would redo (25-90 s). A GPU pod has neither.
SUITE_ENV = {"DSPARK_COMPILE": os.environ.get("DSPARK_COMPILE", "0"), "DSPARK_CPU_ATTENTION": "sdpa"}


def wait_for(what: str, probe: Callable[[], Any], timeout: float, pods: tuple[LocalPod, ...] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := probe():
            return value
        for pod in pods:
            assert pod.proc.poll() is None, f"{pod.name} exited {pod.proc.returncode}:\n{pod.log()[-6000:]}"
        time.sleep(0.2)
    logs = "".join(f"\n--- {pod.name}:\n{pod.log()[-6000:]}" for pod in pods)
    raise AssertionError(f"timed out waiting for {what}{logs}")


# The example's engine sized for a CPU, the replicas' and the profiling Jobs' alike (the docs'
# advice), and one timing per batch size over a short context: a profile of the default shape
# takes minutes here.
CPU_SHAPE = ["--max-num-seqs", "2", "--max-batch-tokens", "32"]
QUICK_PROFILE = [*CPU_SHAPE, "--repeats", "1", "--context-len", "32"]
INSTALL = [
    *("dspark", "--namespace", NAMESPACE, "--set", "example.enabled=true"),
    *("--set-json", f"example.extraArgs={json.dumps(CPU_SHAPE)}"),
    *("--set-json", f"example.profiling={json.dumps({'extraArgs': QUICK_PROFILE})}"),
]
# NOTES.txt as data of a template, so that `helm template` (which leaves NOTES out, where `helm
# install` prints them) renders it with the same values and helpers.
NOTES_TEMPLATE = """apiVersion: v1
kind: ConfigMap
metadata: {name: notes}
data:
  notes: |-
{{ tpl (.Files.Get "NOTES.txt") . | indent 4 }}
"""


def helm_template(helm: str, chart: Path, *args: str) -> list[dict]:
    result = subprocess.run(
        [helm, "template", INSTALL[0], str(chart), *INSTALL[1:], *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def helm_install(helm: str, tmp: Path) -> tuple[list[dict], str]:
    """(objects, NOTES) of the docs' install with the example on, as `helm install` would apply them."""
    objects = helm_template(helm, CHART, "--include-crds")
    chart = shutil.copytree(CHART, tmp / "dspark")
    (chart / "templates" / "NOTES.txt").rename(chart / "NOTES.txt")
    (chart / "templates" / "notes.yaml").write_text(NOTES_TEMPLATE)
    (notes,) = helm_template(helm, chart, "--show-only", "templates/notes.yaml")
    return objects, notes["data"]["notes"]


def api_path(doc: dict[str, Any]) -> str:
    group_version = doc["apiVersion"]
    plural, info = next(
        (key.rsplit("/", 1)[1], info)
        for key, info in RESOURCES.items()
        if key.rsplit("/", 1)[0] == group_version and info.kind == doc["kind"]
    )
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    namespace = f"/namespaces/{doc['metadata']['namespace']}" if info.namespaced else ""
    return f"{prefix}{namespace}/{plural}"


def docs_first_request_section() -> str:
    text = DOCS.read_text()
    start = text.index("## 5. First request")
    return text[start : text.index("\n## ", start + 1)]


def first_request(text: str) -> dict[str, Any]:
    """The `kubectl port-forward` and `curl` of a documented first request, as data."""
    forward = re.search(r"kubectl -n (\S+) port-forward svc/(\S+) (\d+):(\d+)", text)
    assert forward, f"no port-forward in {text!r}"
    joined = re.sub(r"\\\n\s*", " ", text)
    curl = shlex.split(joined[joined.index("curl ") :].splitlines()[0])
    url, headers, body = None, {}, None
    args = iter(curl[1:])
    for arg in args:
        if arg == "-H":
            key, _, value = next(args).partition(":")
            headers[key.strip()] = value.strip()
        elif arg == "-d":
            body = json.loads(next(args))
        elif not arg.startswith("-"):
            url = arg
    host, _, path = url.partition("/")
    assert host == f"localhost:{forward.group(3)}", (url, forward.group(0))
    return {
        "namespace": forward.group(1),
        "service": forward.group(2),
        "port": int(forward.group(4)),
        "path": "/" + path,
        "headers": headers,
        "body": body,
    }


def apply(kube: Kube, objects: list[dict]) -> None:
    for doc in objects:
        kube._call("POST", api_path(doc), body=doc)


@contextlib.contextmanager
def operator_pod(deployment: dict, kubeconfig: Path, root: Path) -> Iterator[LocalPod]:
    """The operator's pod, its liveness endpoint on loopback and its metrics port off."""
    pod_spec = deployment["spec"]["template"]["spec"]
    probe = pod_spec["containers"][0]["readinessProbe"]["httpGet"]["path"]
    port = free_port()
    pod = start_pod(
        "operator",
        pod_spec,
        root,
        extra_args=["--liveness", f"http://127.0.0.1:{port}{probe}"],
        extra_env={"KUBECONFIG": str(kubeconfig), "DSPARK_OPERATOR_METRICS_PORT": "0"},
    )
    try:
        wait_for("the operator's readiness", lambda: http_ok(f"http://127.0.0.1:{port}{probe}"), 60, (pod,))
        yield pod
    finally:
        pod.stop()


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_profiling_job(cluster: EmulatedCluster, kube: Kube, job: dict, root: Path, hub: str) -> LocalPod:
    """The Job controller and the kubelet: the Job's pod runs to its end; its log and status land."""
    name = job["metadata"]["name"]
    pod_spec = job["spec"]["template"]["spec"]
    pod = start_pod(name, pod_spec, root, extra_env={"HF_ENDPOINT": hub, **SUITE_ENV})
    try:
        pod.proc.wait(JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the profiling Job ran past {JOB_TIMEOUT_S} s:\n{pod.log()[-6000:]}") from None
    finally:
        pod.stop()
    assert pod.proc.returncode == 0, pod.log()[-6000:]
    pod_name = f"{name}-local"
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": NAMESPACE, "labels": {"job-name": name}},
            "spec": pod_spec,
            "status": {"phase": "Succeeded"},
        }
    )
    cluster.pod_logs[pod_name] = pod.log()
    kube.patch(
        "Job",
        NAMESPACE,
        name,
        {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}},
    )
    return pod


def serving_deployment(kube: Kube, service_name: str) -> tuple[dict, dict]:
    """(Service, Deployment) behind a Service name, as the Service's selector picks the pods."""
    service = kube.get("Service", NAMESPACE, service_name)
    assert service is not None, f"no Service {service_name}"
    selector = service["spec"]["selector"]
    (deployment,) = [
        d
        for d in kube.list("Deployment", NAMESPACE)
        if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
    ]
    return service, deployment


@pytest.fixture(scope="module")
def helm() -> str:
    return str(fetch_helm())


@pytest.fixture()
def pod_root() -> Iterator[Path]:
    # Short: the pods' Ray puts sockets under their /tmp, and a socket path has at most 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="dspark-"))
    yield root
    for path in root.rglob("rootfs"):
        path.chmod(0o755)
    shutil.rmtree(root, ignore_errors=True)


def test_the_charts_example_answers_its_documented_first_requests(
    helm, smollm_dir, pod_root, tmp_path, monkeypatch
):
    objects, notes = helm_install(helm, tmp_path)
    requests = {"docs": first_request(docs_first_request_section()), "NOTES.txt": first_request(notes)}
    example = next(d for d in objects if d["kind"] == "DSparkService")
    target = example["spec"]["model"]["target"]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", target), f"the example's target is not a hub id: {target}"
    operator_deployment = next(d for d in objects if d["kind"] == "Deployment")

    with (
        EmulatedCluster() as cluster,
        HubEmulator({target: repo_from_dir(smollm_dir, skip=("dspark-model.json",))}) as hub,
        contextlib.ExitStack() as pods,
    ):
        kubeconfig = pod_root / "kubeconfig.yaml"
        kubeconfig.write_text(cluster.kubeconfig())
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        load_client_configuration()
        kube = Kube.from_default_configuration()
        apply(kube, objects)
        node_label = next(
            e["value"]
            for e in operator_deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            if e["name"] == "DSPARK_OPERATOR_NODE_LABEL"
        )
        node_type = example["spec"]["nodeTypes"][0]
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "gpu-0", "labels": {node_label: node_type}},
            }
        )
        operator = pods.enter_context(operator_pod(operator_deployment, kubeconfig, pod_root / "op"))

        (job,) = wait_for("the profiling Job", lambda: kube.list("Job", NAMESPACE), 60, (operator,))
        profiling = run_profiling_job(cluster, kube, job, pod_root / "job", hub.endpoint)

        tiers = [t["name"] for t in example["spec"]["tiers"]]
        wait_for(
            "a Deployment per tier",
            lambda: (
                {d["metadata"]["name"] for d in kube.list("Deployment", NAMESPACE)}
                >= {f"{example['metadata']['name']}-{t}" for t in tiers}
            ),
            60,
            (operator,),
        )
        (served,) = {(r["namespace"], r["service"], r["port"]) for r in requests.values()}
        assert served[0] == NAMESPACE
        service, deployment = serving_deployment(kube, served[1])
        (port_spec,) = [p for p in service["spec"]["ports"] if p["port"] == served[2]]
        pod_spec = deployment["spec"]["template"]["spec"]
        configmaps = {
            v["configMap"]["name"]: kube.get("ConfigMap", NAMESPACE, v["configMap"]["name"])
            for v in pod_spec["volumes"]
            if "configMap" in v
        }
        container = pod_spec["containers"][0]
        (container_port,) = [p for p in container["ports"] if p["name"] == port_spec["targetPort"]]
        port = free_port()
        flags = {"--device": "cpu", "--host": "127.0.0.1", "--port": str(port)}
        assert (
            str(container_port["containerPort"])
            == container["command"][container["command"].index("--port") + 1]
        )
        serving = start_pod(
            deployment["metadata"]["name"],
            pod_spec,
            pod_root / "srv",
            configmaps=configmaps,
            flags=flags,
            extra_env={"HF_ENDPOINT": hub.endpoint, **SUITE_ENV},
        )
        pods.callback(serving.stop)
        ready = container["readinessProbe"]["httpGet"]["path"]
        base = f"http://127.0.0.1:{port}"
        wait_for("the serving pod's readiness", lambda: http_ok(base + ready), SERVE_TIMEOUT_S, (serving,))

        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [example["metadata"]["name"], target]
        for source, request in requests.items():
            reply = httpx.post(
                base + request["path"], headers=request["headers"], json=request["body"], timeout=300
            )
            assert reply.status_code == 200, f"{source}: {reply.status_code} {reply.text}"
            data = reply.json()
            assert data["object"] == "chat.completion" and data["model"] == request["body"]["model"], data
            (choice,) = data["choices"]
            assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip(), data
            assert choice["finish_reason"] in ("stop", "length"), data
            assert 1 <= data["usage"]["completion_tokens"] <= request["body"]["max_tokens"], data
    for pod in (operator, profiling, serving):
        assert not pod.written_to_rootfs(), f"{pod.name} wrote outside its volumes: {pod.written_to_rootfs()}"
