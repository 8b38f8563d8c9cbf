"""The Ray Serve application builder that a KubeRay RayService's `serveConfigV2` names.

    applications:
      - name: dspark
        route_prefix: /
        import_path: dspark.serving.app:build_app
        args: {target: smollm2-135m, num_replicas: 2, sps_profiles: {cpu-avx2: /etc/dspark/cpu-avx2.json}}

`args` holds `ServeConfig` fields (`dspark serve`'s options, with underscores), validated by the same
model as the command line's; an unknown or invalid one fails the deployment with a message naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve import Application

from dspark.serving.config import ServeConfig, load_config
from dspark.serving.deployment import openai_app


def config_from_args(args: Mapping[str, Any]) -> ServeConfig:
    """The server's settings from an application's `args` alone: no file, no environment variables
    (a head pod's environment, RAY_ADDRESS included, is not the application's)."""
    config = load_config(overrides=dict(args), environ={})
    if config.kserve:
        raise ValueError(
            "invalid serve configuration: config.kserve: a Serve application serves the OpenAI API"
        )
    return config


def build_app(args: dict[str, Any]) -> Application:
    """The OpenAI server as a Ray Serve application, from `args` (see the module's docstring)."""
    return openai_app(config_from_args(args or {}))
