"""The CRDs the operator's objects must fit, as JSON Schemas: its own DSparkService CRD and
KubeRay's published RayService CRD (tests/fixtures/kuberay)."""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
DSPARK_CRD = ROOT / "operator/dspark_operator/crds/dsparkservices.dspark.ai.yaml"
KUBERAY_CRD = ROOT / "tests/fixtures/kuberay/ray.io_rayservices.yaml.gz"


def to_json_schema(node):
    """OpenAPI v3 (structural) to JSON Schema: drop x-kubernetes-*, map boolean exclusiveMinimum."""
    if isinstance(node, dict):
        out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
        if out.get("exclusiveMinimum") is True:
            out["exclusiveMinimum"] = out.pop("minimum")
        return out
    if isinstance(node, list):
        return [to_json_schema(v) for v in node]
    return node


def crd_schema() -> dict:
    """The DSparkService CRD's openAPIV3Schema, as written."""
    crd = yaml.safe_load(DSPARK_CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@functools.cache
def kuberay_validator() -> jsonschema.Draft7Validator:
    """A validator of RayService objects against KubeRay's v1 openAPIV3Schema (1 MB of YAML:
    parsed once, with libyaml where there is one)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(gzip.decompress(KUBERAY_CRD.read_bytes()), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = to_json_schema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)
