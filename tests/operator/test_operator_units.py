"""Profile parsing, metric reading, object builders and the CRD: pure parts of the operator."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jsonschema
import pytest
from crd_schemas import crd_schema, to_json_schema
from dspark.sps_format import PROFILE_BEGIN, PROFILE_END, SpsProfile, extract_profile_from_log
from dspark_operator import builders
from dspark_operator.config import OperatorConfig
from dspark_operator.metrics import (
    PrometheusMetricsReader,
    histogram_quantile,
    parse_metrics_text,
    tier_metrics_from_samples,
)
from dspark_operator.profiling import (
    CreateJob,
    DeleteJob,
    ProfileJob,
    ProfileObservation,
    StoreProfile,
    job_state,
    next_profile_step,
)
from dspark_operator.spec import ProfilingSpec, ServiceSpec
from operator_fixtures import PROFILE, SERVICE, profile_json, service


def test_profile_interpolates_and_extrapolates():
    profile = SpsProfile.model_validate(PROFILE)
    assert profile.sps(1) == pytest.approx(1000 / 18.25, rel=1e-3)
    assert profile.sps(12) == pytest.approx((profile.sps(8) + profile.sps(16)) / 2)
    # Past the end the step time keeps growing by the curve's seconds per token (0.25 ms here),
    # as the engine reads the same profile.
    assert profile.sps(1024) == pytest.approx(1 / (1 / profile.sps(512) + 512 * 0.25e-3), rel=1e-3)
    assert profile.summary()["points"] == 8


def test_profile_rejects_bad_points():
    with pytest.raises(ValueError, match="duplicate"):
        SpsProfile.model_validate({**PROFILE, "points": [{"batch_tokens": 1, "steps_per_second": 5}] * 2})
    with pytest.raises(ValueError):
        SpsProfile.model_validate({**PROFILE, "points": []})


def test_profile_from_log_takes_last_marked_block():
    log = f"warmup\n{PROFILE_BEGIN}\n{{broken\n{PROFILE_END}\n{PROFILE_BEGIN}\n{profile_json()}\n{PROFILE_END}\n"
    assert extract_profile_from_log(log).device == "NVIDIA H200"
    with pytest.raises(ValueError, match="marker"):
        extract_profile_from_log("no profile here")


def test_histogram_quantile_matches_prometheus():
    buckets = {10.0: 10, 20.0: 30, 40.0: 40, float("inf"): 40}
    assert histogram_quantile(0.5, buckets) == pytest.approx(15.0)
    assert histogram_quantile(0.95, {1.0: 0, 2.0: 0, float("inf"): 5}) == 2.0
    assert histogram_quantile(0.5, {1.0: 0, float("inf"): 0}) is None


EXPOSITION = """
# TYPE dspark_request_tokens_per_second histogram
dspark_request_tokens_per_second_bucket{le="20.0"} %d
dspark_request_tokens_per_second_bucket{le="40.0"} %d
dspark_request_tokens_per_second_bucket{le="+Inf"} %d
dspark_request_tokens_per_second_count %d
dspark_request_tokens_per_second_sum 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="m"} %d
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} %d
"""


def test_pod_metrics_are_diffed_between_scrapes():
    first = parse_metrics_text(EXPOSITION % (100, 100, 100, 100, 10, 20))  # all slow so far
    second = parse_metrics_text(EXPOSITION % (100, 200, 200, 200, 30, 80))  # then 100 fast ones
    assert tier_metrics_from_samples(first, None).tokens_per_second_p50 == pytest.approx(10.0)
    m = tier_metrics_from_samples(second, first)
    assert m.tokens_per_second_p50 == pytest.approx(30.0)  # only the new requests count
    assert m.requests_running == 3
    assert m.accepted_per_step == pytest.approx(1 + 60 / 20)


def test_prometheus_reader_queries_tier_series():
    seen: list[str] = []
    answers = {"0.5": 33.0, "0.95": 0.8, "running": 12.0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            from urllib.parse import parse_qs, urlparse

            query = parse_qs(urlparse(self.path).query)["query"][0]
            seen.append(query)
            value = next((v for k, v in answers.items() if k in query), None)
            result = [] if value is None else [{"metric": {}, "value": [0, str(value)]}]
            body = json.dumps(
                {"status": "success", "data": {"resultType": "vector", "result": result}}
            ).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        m = PrometheusMetricsReader(f"http://127.0.0.1:{server.server_address[1]}").read("ns", "chat", "gold")
    finally:
        server.shutdown()
    assert m.tokens_per_second_p50 == 33.0 and m.ttft_p95_seconds == 0.8 and m.requests_running == 12.0
    assert m.requests_waiting == 0.0 and m.accepted_per_step is None
    assert all('dspark_service="chat",dspark_tier="gold"' in q for q in seen)


def test_job_state():
    job = {"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"}, "status": {}}
    start = 1767225600.0
    assert job_state(job, start + 10, timeout=60) == "Running"
    assert job_state(job, start + 61, timeout=60) == "Failed"  # past its deadline
    assert job_state({**job, "status": {"succeeded": 1}}, start, 60) == "Succeeded"
    assert (
        job_state({**job, "status": {"conditions": [{"type": "Failed", "status": "True"}]}}, start, 60)
        == "Failed"
    )


BODY = {**SERVICE, "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}

SETTINGS = ProfilingSpec.model_validate({"maxAttempts": 2, "backoffSeconds": 10})


def seen(jobs=(), stored=None, harvest=None, stale=()) -> ProfileObservation:
    return ProfileObservation("H200", "fp", "cm", "job", stored, tuple(jobs), tuple(stale), harvest)


def test_next_profile_step_starts_a_job_then_waits_for_it():
    step = next_profile_step(seen(stale=["old"]), None, SETTINGS, now=0.0)
    assert step.actions == (DeleteJob("old"), CreateJob("job-1", 1))
    assert step.status["state"] == "Running" and step.status["job"] == "job-1"
    running = next_profile_step(seen([ProfileJob("job-1", 1, "Running")]), step.status, SETTINGS, now=5.0)
    assert running.actions == () and running.status["state"] == "Running"


def test_next_profile_step_stores_a_harvested_profile():
    profile = SpsProfile.model_validate(PROFILE)
    step = next_profile_step(
        seen([ProfileJob("job-1", 1, "Succeeded")], harvest=profile), None, SETTINGS, 0.0
    )
    assert step.ready and step.actions == (StoreProfile(profile), DeleteJob("job-1"))
    assert [e.reason for e in step.events] == ["ProfileReady"]
    again = next_profile_step(
        seen([ProfileJob("job-1", 1, "Succeeded")], stored=profile), None, SETTINGS, 1.0
    )
    assert again.ready and again.actions == (DeleteJob("job-1"),)


def test_next_profile_step_retries_with_backoff_then_rounds_after_a_longer_one():
    unusable = seen([ProfileJob("job-1", 1, "Succeeded")], harvest="no profile block")
    step = next_profile_step(unusable, None, SETTINGS, now=100.0)
    assert step.status["state"] == "Retrying" and "unusable: no profile block" in step.status["message"]
    assert step.actions == (DeleteJob("job-1"),)
    assert next_profile_step(seen(), step.status, SETTINGS, now=105.0).actions == ()  # backing off
    retry = next_profile_step(seen(), step.status, SETTINGS, now=111.0)
    assert retry.actions == (CreateJob("job-2", 2),)
    failed = next_profile_step(seen([ProfileJob("job-2", 2, "Failed")]), retry.status, SETTINGS, now=120.0)
    assert failed.status["state"] == "Failed" and [e.reason for e in failed.events] == ["ProfilingFailed"]
    # Failed holds for failedRetrySeconds (default 3600), then a new round of maxAttempts starts.
    held = next_profile_step(seen(), failed.status, SETTINGS, now=3000.0)
    assert held.actions == () and held.status["state"] == "Failed"
    again = next_profile_step(seen(), held.status, SETTINGS, now=3721.0)
    assert again.actions == (CreateJob("job-3", 3),) and again.status["roundStart"] == 2
    assert "after 2 failed" in again.events[0].message
    # The new round backs off from its own first failure, and fails after its own maxAttempts.
    retry = next_profile_step(seen([ProfileJob("job-3", 3, "Failed")]), again.status, SETTINGS, now=3730.0)
    assert retry.status["state"] == "Retrying" and "retry 2/2 in 10s" in retry.status["message"]
    retry = next_profile_step(seen(), retry.status, SETTINGS, now=3741.0)
    failed = next_profile_step(seen([ProfileJob("job-4", 4, "Failed")]), retry.status, SETTINGS, now=3750.0)
    assert failed.status["state"] == "Failed" and failed.status["attempts"] == 4


def test_a_failed_profile_recorded_without_a_retry_time_backs_off_from_now():
    old = {"fingerprint": "fp", "configMap": "cm", "attempts": 2, "state": "Failed", "nextRetryAt": None}
    step = next_profile_step(seen(), old, SETTINGS, now=100.0)
    assert step.actions == () and step.status["nextRetryAt"] is not None
    assert next_profile_step(seen(), step.status, SETTINGS, now=3701.0).actions == (CreateJob("job-3", 3),)


def test_builders_names_fit_kubernetes_limits():
    long = "a-very-long-service-name-that-keeps-going-and-going"
    name = builders.profile_job_name(long, "NVIDIA H100 80GB HBM3 (SXM)", "0123456789")
    assert len(name) + 3 <= 63 and builders.slug("NVIDIA H100 80GB HBM3 (SXM)") != builders.slug(
        "NVIDIA H100"
    )
    assert len(builders.workload_name(long, "interactive-premium")) <= 63


def test_fingerprint_changes_with_image_and_model_only():
    spec = ServiceSpec.model_validate(SERVICE["spec"])
    fp = builders.profile_fingerprint(spec, "NVIDIA-H200")
    assert fp == builders.profile_fingerprint(
        ServiceSpec.model_validate(service(policy="static")["spec"]), "NVIDIA-H200"
    )
    assert fp != builders.profile_fingerprint(
        ServiceSpec.model_validate(service(image="x:2")["spec"]), "NVIDIA-H200"
    )
    for field, value in (("target", "other/model"), ("drafter", "dspark")):
        model = {**SERVICE["spec"]["model"], field: value}
        assert fp != builders.profile_fingerprint(
            ServiceSpec.model_validate(service(model=model)["spec"]), "NVIDIA-H200"
        )


def test_the_profiling_job_loads_the_drafter_the_replicas_serve_with():
    """The timed forward captures the drafter's target layers, so the profile must see the same drafter."""
    spec = ServiceSpec.model_validate(SERVICE["spec"])
    job = builders.build_profile_job(BODY, spec, "gpu", "NVIDIA-H200", "fp")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--drafter") + 1] == SERVICE["spec"]["model"]["drafter"]
    serving = builders.build_serving_deployment(BODY, spec, spec.tiers[0], "gpu", "NVIDIA-H200", "fp", 1)
    serve = serving["spec"]["template"]["spec"]["containers"][0]["command"]
    assert serve[serve.index("--drafter") + 1] == SERVICE["spec"]["model"]["drafter"]


@pytest.mark.parametrize("kind", ["Deployment", "InferenceService"])
def test_serving_pods_listen_where_probes_and_services_connect(kind):
    spec = ServiceSpec.model_validate(service(serving={"kind": kind})["spec"])
    if kind == "Deployment":
        pod = builders.build_serving_deployment(BODY, spec, spec.tiers[0], "gpu", "H200", "fp", 1)["spec"][
            "template"
        ]
        container = pod["spec"]["containers"][0]
    else:
        isvc = builders.build_inference_service(BODY, spec, spec.tiers[0], "gpu", "H200", "fp", 1)
        container = isvc["spec"]["predictor"]["containers"][0]
    command = container["command"]
    # The kubelet's probes and the Service connect to the pod's IP, not its loopback.
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert int(command[command.index("--port") + 1]) == container["ports"][0]["containerPort"]


def built_pods(spec: ServiceSpec) -> dict[str, dict]:
    """The pod spec of every kind of pod the operator creates."""
    tier = spec.tiers[0]
    deployment = builders.build_serving_deployment(BODY, spec, tier, "gpu", "H200", "fp", 1)
    isvc = builders.build_inference_service(BODY, spec, tier, "gpu", "H200", "fp", 1)
    job = builders.build_profile_job(BODY, spec, "gpu", "H200", "fp")
    return {
        "serving": deployment["spec"]["template"]["spec"],
        "kserve": isvc["spec"]["predictor"],
        "profile": job["spec"]["template"]["spec"],
    }


def test_every_pod_is_restricted_with_writable_caches_on_empty_dirs():
    """Pod Security "restricted", no service-account token, and every directory the server writes
    (pointed to by its environment) on an emptyDir under the read-only root filesystem."""
    for name, pod in built_pods(ServiceSpec.model_validate(service(runAsUser=12345)["spec"])).items():
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 12345,
            "runAsGroup": 12345,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        (container,) = pod["containers"]
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False and context["privileged"] is False
        assert context["readOnlyRootFilesystem"] is True and context["capabilities"] == {"drop": ["ALL"]}
        empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        writable = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in empty_dirs]
        env = {e["name"]: e.get("value") for e in container["env"]}
        for var in (
            "HOME",
            "DSPARK_HOME",
            "HF_HOME",
            "TORCHINDUCTOR_CACHE_DIR",
            "TORCH_EXTENSIONS_DIR",
            "TMPDIR",
        ):
            assert any(env[var] == d or env[var].startswith(d + "/") for d in writable), (name, var)
    command = built_pods(ServiceSpec.model_validate(SERVICE["spec"]))["profile"]["containers"][0]["command"]
    assert '--output "$TMPDIR/profile.json"' in command[2]  # TMPDIR: checked writable above


def test_tolerations_affinity_and_pull_secrets_reach_every_pod():
    tolerations = [
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
        builders.GPU_TOLERATION,  # given again: kept once
    ]
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    }
    secrets = [{"name": "registry"}]
    body = service(tolerations=tolerations, affinity=affinity, imagePullSecrets=secrets)
    jsonschema.validate(body, to_json_schema(crd_schema()))
    for name, pod in built_pods(ServiceSpec.model_validate(body["spec"])).items():
        assert pod["tolerations"] == [builders.GPU_TOLERATION, tolerations[0]], name
        assert pod["affinity"] == affinity and pod["imagePullSecrets"] == secrets, name
        assert pod["nodeSelector"] == {"gpu": "H200"}, name
    for name, pod in built_pods(ServiceSpec.model_validate(SERVICE["spec"])).items():
        assert pod["tolerations"] == [builders.GPU_TOLERATION], name
        assert "affinity" not in pod and "imagePullSecrets" not in pod, name
    bad = service(imagePullSecrets=[{"secret": "registry"}])
    with pytest.raises(jsonschema.ValidationError, match="'name' is a required property"):
        jsonschema.validate(bad, to_json_schema(crd_schema()))


def test_the_api_key_comes_from_its_secret_and_never_reaches_profiling_jobs():
    env = [{"name": "DSPARK_API_KEY", "value": "plain"}, {"name": "HTTP_PROXY", "value": "p"}]
    ref = {"name": "chat-key", "key": "token"}
    pods = built_pods(ServiceSpec.model_validate(service(env=env, apiKeySecretRef=ref)["spec"]))
    for name in ("serving", "kserve"):
        keys = [e for e in pods[name]["containers"][0]["env"] if e["name"] == "DSPARK_API_KEY"]
        assert keys == [{"name": "DSPARK_API_KEY", "valueFrom": {"secretKeyRef": ref}}], name
    job_env = {e["name"] for e in pods["profile"]["containers"][0]["env"]}
    assert "HTTP_PROXY" in job_env and "DSPARK_API_KEY" not in job_env
    # Without a Secret the free-form env still reaches the serving pods, and still not the Jobs.
    pods = built_pods(ServiceSpec.model_validate(service(env=env)["spec"]))
    assert {"name": "DSPARK_API_KEY", "value": "plain"} in pods["serving"]["containers"][0]["env"]
    assert "DSPARK_API_KEY" not in {e["name"] for e in pods["profile"]["containers"][0]["env"]}


@pytest.mark.parametrize(
    ("serving", "env", "grace"),
    [
        ({}, [], 5 + 30 + 30 + 30),
        ({"drainSeconds": 60, "preStopSeconds": 10}, [], 10 + 60 + 60 + 30),
        # Ray stretches a direct-ingress replica's drain to its draining period plus 5 s.
        ({}, [{"name": "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "value": "40"}], 5 + 30 + 45 + 30),
    ],
)
def test_the_grace_period_outlasts_prestop_and_drain(serving, env, grace):
    spec = ServiceSpec.model_validate(service(serving=serving, env=env)["spec"])
    pod = built_pods(spec)["serving"]
    assert pod["terminationGracePeriodSeconds"] == grace
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "sleep",
        str(spec.serving.pre_stop_seconds),
    ]
    drain = {e["name"]: e.get("value") for e in container["env"]}["DSPARK_GRACEFUL_SHUTDOWN_TIMEOUT_S"]
    assert drain == str(spec.serving.drain_seconds)


def test_inference_service_is_raw_mode_with_pinned_replicas():
    spec = ServiceSpec.model_validate(service(serving={"kind": "InferenceService"})["spec"])
    isvc = builders.build_inference_service(BODY, spec, spec.tiers[0], "gpu", "H200", "fp", 3)
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert isvc["spec"]["predictor"]["minReplicas"] == isvc["spec"]["predictor"]["maxReplicas"] == 3
    assert isvc["spec"]["predictor"]["containers"][0]["command"][:2] == ["dspark", "serve"]


def test_spec_validation_errors_are_clear():
    bad = service()
    del bad["spec"]["tiers"][0]["tokensPerSecondPerUser"]
    with pytest.raises(ValueError, match="tokensPerSecondPerUser"):
        ServiceSpec.model_validate(bad["spec"])
    dup = service(tiers=[SERVICE["spec"]["tiers"][0]] * 2)
    with pytest.raises(ValueError, match="unique"):
        ServiceSpec.model_validate(dup["spec"])
    stray = service(tiers=[{**SERVICE["spec"]["tiers"][0], "nodeTypes": ["Tesla-T4"]}])
    with pytest.raises(ValueError, match="Tesla-T4"):
        ServiceSpec.model_validate(stray["spec"])


def test_crd_schema_accepts_example_and_rejects_missing_target():
    schema = to_json_schema(crd_schema())
    jsonschema.validate(SERVICE, schema)
    bad = service()
    del bad["spec"]["tiers"][1]["tokensPerSecondPerUser"]
    with pytest.raises(jsonschema.ValidationError, match="tokensPerSecondPerUser"):
        jsonschema.validate(bad, schema)


def test_config_from_env():
    config = OperatorConfig.from_env(
        {"DSPARK_OPERATOR_NODE_LABEL": "cloud/gpu", "DSPARK_OPERATOR_METRICS_PORT": "0"}
    )
    assert config.node_label == "cloud/gpu" and config.metrics_port == 0
    with pytest.raises(ValueError):
        OperatorConfig.from_env({"DSPARK_OPERATOR_RECONCILE_SECONDS": "-1"})
