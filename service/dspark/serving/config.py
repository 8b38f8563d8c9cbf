"""The server's configuration: one pydantic model, from defaults < YAML file < environment < flags."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from dspark.engine.config import SELECTION_FIELDS
from dspark.node_resources import node_type_resource
from dspark.serving.request_limits import RequestLimits
from dspark.serving.threads import ThreadPlan
from dspark.validation import describe

ENV_PREFIX = "DSPARK_"
CONFIG_FILE_ENV = "DSPARK_CONFIG"
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own variable: the cluster a driver joins
# Settings given as JSON in their environment variable.
JSON_FIELDS = ("autoscaling", "sps_profiles")
# Engine settings live in the engine's own EngineConfig; None here means "the engine's default".
ENGINE_FIELDS = (
    *SELECTION_FIELDS,
    "compile",
    "cuda_graphs",
    "sps_profile",
    "strict_profile",
    "tokenizer",
    "chat_template",
    "seed",
    "build_in_background",
)
_EDGE = RequestLimits()  # the defaults of the request size limits


class AutoscalingSettings(BaseModel):
    """Ray Serve autoscaling of engine replicas (each replica owns one engine)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)


class ServeConfig(BaseModel):
    """Everything `dspark serve` needs. Environment variables are `DSPARK_<FIELD>` (upper case)."""

    model_config = ConfigDict(extra="forbid")

    # Engine selection (passed to EngineConfig; None keeps the engine's default).
    target: str | None = None
    drafter: str | None = None
    policy: str | None = None
    gamma: int | None = Field(None, ge=1)
    dtype: str | None = None
    device: str | None = None
    max_num_seqs: int | None = Field(None, ge=1, description="Max concurrently running requests per replica.")
    max_model_len: int | None = Field(None, ge=16)
    max_batch_tokens: int | None = Field(None, ge=1)
    prefix_caching: bool | None = Field(None, description="Reuse the KV of cached prompt prefixes.")
    prefix_cache_gib: float | None = Field(
        None, ge=0, description="GiB keeping finished requests' cached prefixes beyond the KV slots."
    )
    strict_profile: bool | None = Field(None, description="Refuse to start without a matching profile.")
    compile: bool | None = Field(None, description="Run the target's forward as inductor graphs (CPU).")
    cuda_graphs: bool | None = Field(None, description="Replay steps as CUDA graphs (default: on CUDA).")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the target.")
    tokenizer: str | None = Field(None, description="Tokenizer directory or hub id; default: the target's.")
    chat_template: str | None = Field(None, description="Chat template file or Jinja text.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seeds the engine's global RNGs.")
    generation_config: str = Field(
        "auto",
        description="Sampling defaults for fields a request leaves out: `auto` the target's "
        "generation_config.json, `vllm` none (OpenAI's defaults), or a directory holding one.",
    )
    build_in_background: bool = Field(
        True,
        description="Serve with the eager forward as soon as the weights are loaded (and a quick SPS "
        "profile, where none is stored) while the compiled forward and the CPU attention kernel build "
        "in the background; False builds them before the first request.",
    )

    engine_in_thread: bool = Field(
        False,
        description="Step the engine on a thread of the replica instead of in its own process.",
    )
    engine_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads of the engine's steps; default: the replica's CPUs, less one for "
        "the HTTP side when the engine has its own process (on 2 CPUs: 1 for one request, 2 for a batch).",
    )
    pin_engine_threads: bool = Field(
        True,
        description="Pin the engine process's intra-op threads one per core (a CPU engine of the only "
        "replica), as vLLM's CPU engine does; the HTTP side then never stops the stepping thread.",
    )

    # HTTP front end.
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    served_model_name: list[str] | None = Field(
        None,
        min_length=1,
        description="Model ids in the API; the first names responses. Default: the target's name (a hub "
        "id without its revision).",
    )
    api_key: SecretStr | None = Field(None, description="Bearer token required on inference routes.")
    kserve: bool = Field(
        False, description="Serve through kserve.ModelServer (OpenAI routes under /openai, v2)."
    )
    ingress: Literal["auto", "direct", "proxy"] = Field(
        "auto",
        description="What accepts HTTP on the port: `direct` the one replica itself, `proxy` Ray Serve's "
        "HTTP proxy, which routes between replicas; auto: direct for one fixed replica, else proxy.",
    )
    address: str | None = Field(
        None,
        description="Ray cluster to deploy onto (`auto`, `host:port` of its GCS, `ray://host:10001`) "
        "instead of a Ray instance started in-process; default: $RAY_ADDRESS where set.",
    )
    router: Literal["prefix", "round-robin", "pow2"] | None = Field(
        None,
        description="How requests are spread over the engine replicas, behind an ingress deployment "
        "that parses them: `prefix` to the replica most likely to hold the prompt's prefix in its cache "
        "(the least loaded when that one is too busy), `round-robin` in turn, `pow2` Ray's default "
        "power of two choices. Default: `prefix` with more than one replica; one fixed replica serves "
        "HTTP itself, without an ingress deployment.",
    )

    # Load protection.
    max_queue: int = Field(64, ge=0, description="Requests allowed to wait beyond max_num_seqs before 429.")
    retry_after_s: int = Field(1, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1, description="Default: the model's context length.")
    max_output_tokens: int = Field(4096, ge=1)
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    request_timeout_s: float | None = Field(
        None, gt=0, description="Deadline of a request from its arrival: 504 past it; default none."
    )

    # Faults.
    engine_stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="An engine that has made no progress for this long with requests open is hung: "
        "/health answers 503 and the engine is replaced.",
    )
    max_engine_restarts: int = Field(
        3,
        ge=0,
        description="Times a replica restarts its dead or hung engine process itself; after that (or "
        "with the engine on a thread) its health check fails and Ray replaces the whole replica.",
    )

    # Request size limits at the edge (a 400 naming the field; the body size a 413).
    max_body_bytes: int = Field(_EDGE.max_body_bytes, ge=1024, description="Largest request body.")
    max_messages: int = Field(_EDGE.max_messages, ge=1, description="Most chat messages in one request.")
    max_stop_strings: int = Field(
        _EDGE.max_stop_strings, ge=1, description="Most stop strings in one request."
    )
    max_stop_chars: int = Field(_EDGE.max_stop_chars, ge=1, description="Longest stop string, in characters.")
    max_logit_bias: int = Field(
        _EDGE.max_logit_bias, ge=1, description="Most logit_bias entries in one request."
    )
    max_choices: int = Field(
        _EDGE.max_choices, ge=1, description="Most choices (n x prompts) in one request."
    )
    max_v2_inputs: int = Field(
        _EDGE.max_v2_inputs, ge=1, description="Most strings in one KServe v2 `text_input`."
    )

    # Replicas.
    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingSettings | None = None
    num_cpus_per_replica: float | None = Field(
        None, gt=0, description="Default: the machine's CPUs / max replicas."
    )
    num_gpus_per_replica: float = Field(0.0, ge=0)

    # Scheduler inputs.
    sps_profile: Path | None = Field(
        None, description="SPS profile file; default: $DSPARK_SPS_PROFILE, else the cache path."
    )
    sps_profiles: dict[str, Path] | None = Field(
        None,
        description="SPS profile file per node type. Given, each replica takes one `dspark/replica-slots` "
        "of a Ray node of a profiled type (`dspark.node_resources`) and loads its node type's profile.",
    )

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names_list(cls, v: Any) -> Any:
        """One name, or several separated by commas (as `DSPARK_SERVED_MODEL_NAME` gives them)."""
        if isinstance(v, str):
            return [name.strip() for name in v.split(",") if name.strip()]
        return v

    @field_validator("served_model_name")
    @classmethod
    def _names_not_blank(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not name.strip() for name in v):
            raise ValueError("served model names must not be blank")
        return v

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, v: str) -> str:
        if v not in ("auto", "vllm") and not (Path(v).expanduser() / "generation_config.json").is_file():
            raise ValueError(f"{v!r} is not auto, vllm or a directory holding generation_config.json")
        return v

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("host must not be empty")
        return v

    @field_validator("address")
    @classmethod
    def _address_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("address must not be empty")
        return v

    @field_validator("sps_profiles")
    @classmethod
    def _profiles_by_node_type(cls, v: dict[str, Path] | None) -> dict[str, Path] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("sps_profiles must name at least one node type")
        for node_type in v:
            node_type_resource(node_type)
        return v

    @model_validator(mode="after")
    def _direct_ingress_fits(self) -> ServeConfig:
        if self.ingress == "direct" and (why := self._why_not_direct()):
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _one_kind_of_profile(self) -> ServeConfig:
        if self.sps_profile is not None and self.sps_profiles is not None:
            raise ValueError("give sps_profile (every replica) or sps_profiles (per node type), not both")
        return self

    @property
    def placed_by_node_type(self) -> bool:
        """Whether replicas go to Ray nodes of profiled types, each with its node type's SPS profile."""
        return self.sps_profiles is not None

    def _why_not_direct(self) -> str | None:
        """Why the replica cannot serve HTTP itself, or None when it can."""
        if self.kserve:
            return "ingress `direct` serves the OpenAI front end; --kserve has its own server"
        if self.router is not None:
            return "--router puts an ingress deployment in front of the engine replicas; it needs ingress `proxy`"
        if self.autoscaling is not None or self.num_replicas != 1:
            return (
                "ingress `direct` binds the port in the one replica; "
                "several or autoscaled replicas need ingress `proxy`"
            )
        if self.address is not None:
            return (
                "ingress `direct` needs the Ray instance that dspark serve starts; --address joins a cluster"
            )
        return None

    @property
    def direct_ingress(self) -> bool:
        """Whether the replica serves HTTP itself (Ray Serve direct ingress), without the proxy hop."""
        return self.ingress == "direct" or (self.ingress == "auto" and self._why_not_direct() is None)

    @property
    def engine_router(self) -> str | None:
        """The engine deployment's request router (`router`, or `prefix` for several replicas);
        None: one fixed replica, nothing to choose between."""
        return self.router or ("prefix" if self.max_replicas > 1 else None)

    @property
    def routed(self) -> bool:
        """Whether the OpenAI front end is an ingress deployment calling the engine deployment through
        a handle (so its request router sees each prompt) rather than the engine replica itself."""
        return not self.kserve and self.engine_router is not None

    @property
    def max_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    def replica_cpus(self) -> float:
        if self.num_cpus_per_replica is not None:
            return self.num_cpus_per_replica
        from dspark.models.host_limits import usable_cpus

        return float(max(1, usable_cpus() // self.max_replicas))

    def thread_plan(self) -> ThreadPlan:
        """Intra-op threads of the engine's steps; an explicit `engine_threads` is used for every step.

        On a thread of the replica the engine takes the replica's CPUs. In its own process it leaves
        one to the event loop and the HTTP proxy, as vLLM's CPU engine leaves one to its API server:
        an OpenMP team sharing its cores with them waits at every barrier for a preempted member.
        On two CPUs leaving one halves the compute, so batches take both (1.20x served tokens/s at
        16 users on a 2-core EPYC, docs/serving.md); a lone request takes one only where that runs its
        forward clearly faster, timed at start-up (it depends on the CPU, `ThreadPlan.timed`).
        """
        if self.engine_threads is not None:
            return ThreadPlan(self.engine_threads, self.engine_threads)
        cpus = max(1, int(self.replica_cpus()))
        if self.engine_in_thread:
            return ThreadPlan(cpus, cpus)
        if cpus == 2:
            return ThreadPlan(single=1, batch=2, time_single=True)
        threads = max(1, cpus - 1)
        return ThreadPlan(threads, threads)

    def engine_cpus(self, available: Collection[int]) -> list[int] | None:
        """The cores the engine process's intra-op threads are pinned to, one each (the first is the
        stepping thread's), or None to leave them to the OS scheduler.

        Only where the cores are this replica's alone: one replica (pinned replicas would all take
        the same cores) of a CPU engine in its own process, given no more cores than it was sized
        for (on a share of a bigger machine, other processes' engines may pin the same first
        cores) and one for each of its threads.
        """
        if not self.pin_engine_threads or self.engine_in_thread or self.max_replicas > 1:
            return None
        if self.num_gpus_per_replica > 0 or (self.device or "").startswith("cuda"):
            return None
        threads = self.thread_plan().batch
        if not threads <= len(available) <= self.replica_cpus():
            return None
        return sorted(available)[:threads]

    def engine_overrides(self) -> dict[str, Any]:
        """The engine settings given explicitly (the rest keep EngineConfig's defaults)."""
        values = {name: getattr(self, name) for name in ENGINE_FIELDS if getattr(self, name) is not None}
        if self.revision is not None:
            from dspark.engine.config import EngineConfig
            from dspark.models.hub import with_revision

            values["target"] = with_revision(values.get("target", EngineConfig().target), self.revision)
        return values

    def engine_config(self):
        """The validated EngineConfig for this server."""
        from dspark.engine.config import EngineConfig

        return EngineConfig(**self.engine_overrides())

    def effective(self) -> dict[str, Any]:
        """The configuration as the server will use it (engine defaults filled in, secrets masked)."""
        data = self.model_dump(mode="json", exclude={*ENGINE_FIELDS, "revision"})
        data["api_key"] = "***" if self.api_key else None
        return {"engine": self.engine_config().model_dump(mode="json"), "server": data}


def _env_values(environ: dict[str, str]) -> dict[str, Any]:
    """Fields set through `DSPARK_<FIELD>`; nested settings (`JSON_FIELDS`) are given as JSON."""
    values: dict[str, Any] = {}
    for name in ServeConfig.model_fields:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        if name in JSON_FIELDS:
            try:
                values[name] = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{ENV_PREFIX}{name.upper()} must be JSON: {e}") from None
        else:
            values[name] = raw
    return values


def _file_values(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of settings")
    return data


def load_config(
    path: Path | str | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> ServeConfig:
    """Merge the layers and validate once; raises ValueError with every problem listed."""
    environ = dict(os.environ) if environ is None else environ
    path = path or environ.get(CONFIG_FILE_ENV)
    values: dict[str, Any] = {}
    if path:
        values.update(_file_values(Path(path)))
    if environ.get(RAY_ADDRESS_ENV):
        values["address"] = environ[RAY_ADDRESS_ENV]
    values.update(_env_values(environ))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        config = ServeConfig.model_validate(values)
        config.engine_config()  # the engine's own checks (e.g. the policy spelling), before Ray starts
        return config
    except ValidationError as e:
        raise ValueError(f"invalid serve configuration: {describe(e, top='config')}") from None
