"""Shared test data: a DSparkService manifest and an SPS profile like `dspark profile` writes."""

from __future__ import annotations

import copy
import json
from typing import Any

PROFILE = {
    "version": 1,
    "device": "NVIDIA H200",
    "node_type": "NVIDIA-H200",
    "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "dtype": "bfloat16",
    "engine": {"max_batch_tokens": 512},
    "created": "2026-01-01T00:00:00Z",
    # SPS falls as the verify batch grows: ~ 1 / (a + b * batch_tokens)
    "points": [
        {"batch_tokens": b, "steps_per_second": round(1000 / (18 + 0.25 * b), 3)}
        for b in (1, 8, 16, 32, 64, 128, 256, 512)
    ],
}

SERVICE: dict[str, Any] = {
    "apiVersion": "dspark.ai/v1alpha1",
    "kind": "DSparkService",
    "metadata": {"name": "chat", "namespace": "default"},
    "spec": {
        "model": {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "drafter": "ngram"},
        "image": "ghcr.io/dspark/serve:0.1.0",
        "nodeTypes": ["NVIDIA-H200", "NVIDIA-L40S"],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "profiling": {"timeoutSeconds": 600, "maxAttempts": 2, "backoffSeconds": 1},
        "autoscaling": {
            "intervalSeconds": 0.3,
            "scaleUpCooldownSeconds": 1,
            "scaleDownCooldownSeconds": 3,
            "tolerance": 0.1,
            "maxScaleUpFactor": 2,
        },
        "tiers": [
            {
                "name": "interactive",
                "tokensPerSecondPerUser": 40,
                "ttftP95Seconds": 1.0,
                "minReplicas": 1,
                "maxReplicas": 4,
                "priority": 10,
            },
            {
                "name": "batch",
                "tokensPerSecondPerUser": 10,
                "ttftP95Seconds": 5.0,
                "minReplicas": 1,
                "maxReplicas": 2,
                "priority": 0,
            },
        ],
    },
}


def service(**spec_overrides: Any) -> dict[str, Any]:
    body = copy.deepcopy(SERVICE)
    body["spec"].update(spec_overrides)
    return body


def profile_json() -> str:
    return json.dumps(PROFILE)
