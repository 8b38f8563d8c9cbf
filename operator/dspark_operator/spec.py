"""Typed view of a DSparkService spec, validated once when a handler receives it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from dspark.tier_format import SlaTier
from pydantic import BaseModel, ConfigDict, Field, model_validator

GROUP = "dspark.ai"
VERSION = "v1alpha1"
PLURAL = "dsparkservices"
KIND = "DSparkService"


def flag_args(argv: Iterable[str]) -> dict[str, Any]:
    """`dspark serve` flags as ServeConfig fields: `--max-num-seqs 32` -> {"max_num_seqs": "32"}.

    A flag without a value is True, `--no-x` is x False, several values make a list; the values
    stay strings, which ServeConfig converts as the command line does.
    """
    args: dict[str, Any] = {}
    name: str | None = None
    for token in argv:
        if token.startswith("--"):
            flag, has_value, value = token[2:].partition("=")
            name = flag.replace("-", "_")
            if not name:
                raise ValueError(f"extraArgs: {token!r} names no flag")
            if has_value:
                args[name], name = value, None
            elif name.startswith("no_"):
                args[name.removeprefix("no_")], name = False, None
            else:
                args[name] = True
        elif name is None:
            raise ValueError(f"extraArgs: {token!r} follows no --flag")
        elif args[name] is True:
            args[name] = token
        else:
            previous = args[name]
            args[name] = [*(previous if isinstance(previous, list) else [previous]), token]
    return args


class _Spec(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class PvcSource(_Spec):
    claim_name: str = Field(alias="claimName", min_length=1)
    mount_path: str = Field("/models", alias="mountPath")
    sub_path: str | None = Field(None, alias="subPath")


class ModelSource(_Spec):
    target: str = Field(min_length=1)
    drafter: str | None = None
    calibration: str | None = None
    pvc: PvcSource | None = None
    served_model_names: tuple[Annotated[str, Field(min_length=1)], ...] = Field((), alias="servedModelNames")


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1)
    key: str = Field("api-key", min_length=1)


class PullSecret(_Spec):
    name: str = Field(min_length=1)


class ServingSpec(_Spec):
    kind: Literal["Deployment", "InferenceService"] = "Deployment"
    port: int = Field(8000, ge=1, le=65535)
    # The server's graceful_shutdown_timeout_s: how long a stopping replica lets requests finish.
    drain_seconds: int = Field(30, alias="drainSeconds", ge=0)
    # The preStop hook's wait, while kube-proxy stops routing new connections to the pod.
    pre_stop_seconds: int = Field(5, alias="preStopSeconds", ge=0)


class RayServiceSpec(_Spec):
    """The Ray cluster of `runtime: rayservice`: its head pod (worker pods take `resources`)."""

    ray_version: str | None = Field(None, alias="rayVersion")
    # The head runs the GCS, the Serve controller and the HTTP proxy, no engine: CPU and memory only.
    head_resources: dict[str, Any] = Field(
        default_factory=lambda: {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
        alias="headResources",
    )


class ProfilingSpec(_Spec):
    timeout_seconds: int = Field(1800, alias="timeoutSeconds", ge=1)
    max_attempts: int = Field(5, alias="maxAttempts", ge=1)
    backoff_seconds: float = Field(60, alias="backoffSeconds", gt=0)
    # After max_attempts failures in a row the node type is Failed; this long after, a new round.
    failed_retry_seconds: float = Field(3600, alias="failedRetrySeconds", gt=0)
    extra_args: tuple[str, ...] = Field((), alias="extraArgs")


class AutoscalingSpec(_Spec):
    interval_seconds: float = Field(15, alias="intervalSeconds", gt=0)
    scale_up_cooldown_seconds: float = Field(60, alias="scaleUpCooldownSeconds", ge=0)
    scale_down_cooldown_seconds: float = Field(300, alias="scaleDownCooldownSeconds", ge=0)
    tolerance: float = Field(0.1, ge=0, le=0.5)
    max_scale_up_factor: float = Field(2.0, alias="maxScaleUpFactor", ge=1)
    max_total_replicas: int | None = Field(None, alias="maxTotalReplicas", ge=1)


class TierSpec(SlaTier):
    """A tier of a DSparkService: the shared tier format, and the node types it may run on."""

    model_config = ConfigDict(extra="ignore")

    node_types: tuple[str, ...] = Field((), alias="nodeTypes")

    @model_validator(mode="after")
    def _has_a_replica(self) -> TierSpec:
        # A tier without replicas has no server to accept a request or report demand, and nothing
        # in front of it (no activator) could ask the operator to scale it back up.
        if self.min_replicas < 1:
            raise ValueError(f"tier {self.name!r}: minReplicas must be at least 1, got {self.min_replicas}")
        return self


class ServiceSpec(_Spec):
    model: ModelSource
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", alias="imagePullPolicy"
    )
    policy: str = "dspark"
    dtype: str = "bfloat16"
    extra_args: tuple[str, ...] = Field((), alias="extraArgs")
    env: tuple[dict[str, Any], ...] = ()
    api_key_secret_ref: SecretKeyRef | None = Field(None, alias="apiKeySecretRef")
    run_as_user: int = Field(10001, alias="runAsUser", ge=1)
    resources: dict[str, Any] = Field(default_factory=dict)
    # Scheduling and image pulls of serving and profiling pods, as core/v1 PodSpec fields.
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] = Field(default_factory=dict)
    image_pull_secrets: tuple[PullSecret, ...] = Field((), alias="imagePullSecrets")
    node_type_label: str | None = Field(None, alias="nodeTypeLabel")
    node_types: tuple[str, ...] = Field(alias="nodeTypes", min_length=1)
    serving: ServingSpec = ServingSpec()
    # `deployment`: a Deployment (or InferenceService) per tier; `rayservice`: one KubeRay RayService.
    runtime: Literal["deployment", "rayservice"] = "deployment"
    ray_service: RayServiceSpec = Field(RayServiceSpec(), alias="rayService")
    profiling: ProfilingSpec = ProfilingSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    tiers: tuple[TierSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_tier_names(self) -> ServiceSpec:
        names = [tier.name for tier in self.tiers]
        if len(names) != len(set(names)):
            raise ValueError(f"tier names must be unique, got {names}")
        for tier in self.tiers:
            if unknown := set(tier.node_types) - set(self.node_types):
                raise ValueError(
                    f"tier {tier.name!r}: nodeTypes {sorted(unknown)} are not in the service's nodeTypes"
                )
        if self.runtime == "rayservice" and self.serving.kind != "Deployment":
            raise ValueError(f"serving.kind {self.serving.kind} runs only with runtime deployment")
        if self.runtime == "rayservice":
            flag_args(self.extra_args)  # the applications' args take flags and their values only
            if self.api_key_secret_ref is not None:
                # A Serve application's settings are its args, in the RayService in plain text;
                # the pods' environment does not reach them.
                raise ValueError("apiKeySecretRef runs only with runtime deployment")
        return self

    def tier_node_types(self, tier: TierSpec) -> tuple[str, ...]:
        """The node types a tier may run on, most preferred first."""
        return tier.node_types or self.node_types
