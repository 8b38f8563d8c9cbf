"""The serving pods' command is a `dspark serve` command line that means what the chart documents:
the model names clients send, KServe's protocols for an InferenceService, a reachable address."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner
from crd_schemas import crd_schema, to_json_schema
from dspark.commands.serve import serve
from dspark_operator import builders
from dspark_operator.scaling import ScalingMemory, ScalingPolicy, TierTarget, decide
from dspark_operator.spec import ServiceSpec
from operator_fixtures import SERVICE, service

ROOT = Path(__file__).resolve().parents[2]
BODY = {**SERVICE, "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}


def serving_command(kind: str, **spec_fields) -> list[str]:
    spec = ServiceSpec.model_validate(service(serving={"kind": kind}, **spec_fields)["spec"])
    if kind == "Deployment":
        pod = builders.build_serving_deployment(BODY, spec, spec.tiers[0], "gpu", "H200", "fp", 1)
        return pod["spec"]["template"]["spec"]["containers"][0]["command"]
    isvc = builders.build_inference_service(BODY, spec, spec.tiers[0], "gpu", "H200", "fp", 1)
    return isvc["spec"]["predictor"]["containers"][0]["command"]


def as_served(command: list[str]) -> dict:
    """What `dspark serve` makes of the pod's command line."""
    assert command[:2] == ["dspark", "serve"]
    result = CliRunner().invoke(serve, [*command[2:], "--print-config"], env={"DSPARK_CONFIG": ""})
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)


@pytest.mark.parametrize("kind", ["Deployment", "InferenceService"])
def test_pods_answer_to_the_service_name_and_the_target(kind):
    config = as_served(serving_command(kind))
    target = SERVICE["spec"]["model"]["target"]
    assert config["server"]["served_model_name"] == ["chat", target]
    assert config["engine"]["target"] == target
    assert config["server"]["host"] == "0.0.0.0"
    assert config["server"]["kserve"] is (kind == "InferenceService")


def test_served_model_names_from_the_spec_win():
    model = {**SERVICE["spec"]["model"], "servedModelNames": ["qwen", "default"]}
    config = as_served(serving_command("Deployment", model=model))
    assert config["server"]["served_model_name"] == ["qwen", "default"]
    jsonschema.validate(service(model=model), to_json_schema(crd_schema()))


def test_a_target_path_is_not_a_model_name():
    model = {**SERVICE["spec"]["model"], "target": "/models/qwen3-8b"}
    assert as_served(serving_command("Deployment", model=model))["server"]["served_model_name"] == ["chat"]


def test_min_replicas_zero_is_refused_by_the_spec_and_the_crd():
    zero = service()
    zero["spec"]["tiers"][0]["minReplicas"] = 0
    with pytest.raises(ValueError, match="minReplicas"):
        ServiceSpec.model_validate(zero["spec"])
    with pytest.raises(jsonschema.ValidationError, match="minimum of 1"):
        jsonschema.validate(zero, to_json_schema(crd_schema()))
    # A tier found at zero (created before the rule) is brought back to its minimum at once.
    target = TierTarget(tokens_per_second=40, ttft_p95_seconds=1.0, min_replicas=1, max_replicas=4)
    assert decide(0, None, target, None, ScalingPolicy(), ScalingMemory(), now=0.0).desired == 1


def test_chart_notes_first_request_names_a_served_model():
    """NOTES.txt's curl, with the example's values filled in as helm renders it, sends a model the
    example service's pods answer to."""
    values = yaml.safe_load((ROOT / "charts/dspark/values.yaml").read_text())["example"]
    notes = (ROOT / "charts/dspark/templates/NOTES.txt").read_text()
    curl = next(line for line in notes.splitlines() if "curl" in line)
    body = json.loads(
        re.search(r"-d '(.*)'", curl).group(1).replace("{{ .Values.example.name }}", values["name"])
    )
    spec = ServiceSpec.model_validate(service(model=values["model"])["spec"])
    assert body["model"] in builders.served_model_names(spec, values["name"])
    assert body["messages"]
