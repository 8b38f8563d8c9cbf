"""checkov's Kubernetes checks over the rendered chart and the objects the operator builds: every
failed check has a written reason in the chart's README, and every reason there still applies."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from dspark_operator import builders
from dspark_operator.spec import ServiceSpec
from test_chart import CHART, EVERYTHING_ON, helm, render  # noqa: F401  (helm: the fixture)

from scripts.fetch_checkov import fetch_checkov

pytestmark = pytest.mark.long

README = CHART / "README.md"
NAMESPACE = "serving"  # the release's namespace, which the operator watches by default
PROFILE = '{"version": 1, "points": []}'


def operator_manifests(example: dict) -> list[dict]:
    """Everything the operator creates for the chart's example service, as it would build it."""
    body = {**example, "metadata": {**example["metadata"], "uid": "0000-example"}}
    spec = ServiceSpec.model_validate(body["spec"])
    node_type, fingerprint = spec.node_types[0], "0123456789"
    objects = [
        builders.build_profile_job(body, spec, "nvidia.com/gpu.product", node_type, fingerprint),
        builders.build_profile_configmap(body, node_type, fingerprint, PROFILE),
    ]
    for tier in spec.tiers:
        objects.append(
            builders.build_serving_deployment(
                body, spec, tier, "nvidia.com/gpu.product", node_type, fingerprint, tier.min_replicas
            )
        )
        objects.append(builders.build_serving_service(body, spec, tier))
    return objects


def justified_checks() -> dict[str, str]:
    """check id -> reason, from the README's table rows `| CKV_K8S_n | what | reason |`."""
    rows = re.findall(r"^\|\s*(CKV2?_K8S_\d+)\s*\|[^|\n]*\|\s*([^|\n]*?)\s*\|\s*$", README.read_text(), re.M)
    return dict(rows)


def test_every_failed_checkov_check_has_a_written_reason(helm, tmp_path):  # noqa: F811
    checkov = fetch_checkov()
    chart = render(helm, EVERYTHING_ON)
    example = next(d for d in chart if d["kind"] == "DSparkService")
    (tmp_path / "chart.yaml").write_text(yaml.safe_dump_all(chart))
    (tmp_path / "operator.yaml").write_text(yaml.safe_dump_all(operator_manifests(example)))
    result = subprocess.run(
        [
            str(checkov),
            "-d",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "--skip-download",
            "--quiet",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(result.stdout)
    failed = {}
    for check in report["results"]["failed_checks"]:
        failed.setdefault(check["check_id"], set()).add(
            f"{check['resource']} ({Path(check['file_path']).name})"
        )
    assert report["summary"]["passed"] > 0, result.stdout[-2000:]

    reasons = justified_checks()
    unexplained = {c: sorted(r) for c, r in failed.items() if not reasons.get(c)}
    assert not unexplained, f"failed checkov checks without a reason in {README}: {unexplained}"
    stale = sorted(set(reasons) - set(failed))
    assert not stale, f"{README} gives reasons for checks that no longer fail: {stale}"
