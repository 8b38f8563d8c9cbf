"""Engine configuration and the choice of device and dtype."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dspark.engine.policy_spec import PolicySettings, parse_policy
from dspark.models.cpu_kind import cpu_has_native_bf16
from dspark.models.registry import DEFAULT_MODEL
from dspark.models.static_batch import DEFAULT_BATCH_BUCKETS

# The default drafter and policy: resolved when the engine loads, once the target and drafter are known.
AUTO = "auto"


class EngineConfig(BaseModel):
    """Everything that selects and sizes an engine; the same fields back every CLI command."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(
        DEFAULT_MODEL, description="Model name, HF-format directory or hub id org/name[@revision]."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory or hub id, when not the target's own (vLLM's --tokenizer)."
    )
    chat_template: str | None = Field(
        None, description="Chat template replacing the tokenizer's: a file path or the Jinja text itself."
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="Seeds the global RNGs at start-up (requests' own seeds still win)."
    )
    drafter: str = Field(
        AUTO,
        description="auto (the target's shipped DSpark drafter, else ngram) | none | ngram | dspark | "
        "dflash | eagle3 | a drafter checkpoint directory | ngram+<a model drafter>.",
    )
    policy: str = Field(
        AUTO,
        description="Verify-length policy: auto (dspark for a drafter with a confidence head, else "
        "static:4) | none | static:K | full | threshold:X | dspark | dspark-async.",
    )
    gamma: int = Field(7, ge=1, le=32, description="Draft block size.")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    max_num_seqs: int = Field(16, ge=1, le=4096, description="Requests decoded concurrently (KV slots).")
    max_model_len: int = Field(2048, ge=16, description="Prompt + output tokens per request.")
    max_batch_tokens: int = Field(512, ge=16, description="Token budget of one forward (chunked prefill).")
    prefix_caching: bool = Field(
        True, description="Reuse the KV (and drafter context) of cached prompt prefixes."
    )
    prefix_cache_gib: float = Field(
        2.0,
        ge=0,
        description="GiB beside the KV slots (on their device) that keep finished requests' cached "
        "prefixes once their slots are reused, least recently used evicted first; at most half of the "
        "memory the slots leave available (0: the slots only).",
    )
    cuda_graphs: bool | None = Field(
        None,
        description="Replay decode and verification steps as CUDA graphs per batch bucket (None: on for "
        "CUDA, off elsewhere; True off CUDA runs the same padded static-shape steps eagerly).",
    )
    compile: bool | None = Field(
        None,
        description="Run the target's forward as inductor graphs on the CPU (None: $DSPARK_COMPILE when "
        "set, else on for the CPU, falling back to eager where inductor cannot build). Start-up compiles "
        "them: about a minute the first time, seconds from inductor's on-disk cache.",
    )
    build_in_background: bool = Field(
        False,
        description="Serve with the eager forward at once and build the compiled forward and the CPU "
        "attention kernel on a background thread, switching to each between steps when it is ready "
        "(an explicit `compile: true` still compiles before the first step).",
    )
    cuda_graph_batch_sizes: tuple[int, ...] = Field(
        DEFAULT_BATCH_BUCKETS, min_length=1, description="Request-count buckets, capped by max_num_seqs."
    )
    sps_profile: Path | None = Field(
        None, description="SPS profile JSON (default: $DSPARK_SPS_PROFILE or the cache)."
    )
    strict_profile: bool = Field(
        False, description="Refuse to start without a matching profile instead of profiling."
    )
    policy_settings: PolicySettings = Field(
        default_factory=PolicySettings, description="Tuning constants of the DSpark policies."
    )

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _positive_buckets(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if min(sizes) < 1:
            raise ValueError("CUDA-graph batch sizes must be positive")
        return tuple(sorted(set(sizes)))

    def static_steps(self, device: torch.device) -> bool:
        """Whether decode steps run padded to buckets (graphs captured on CUDA)."""
        return device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs

    def compiles(self, device: torch.device) -> bool:
        """Whether the target's forward runs compiled; on CUDA, steps replay CUDA graphs instead."""
        wanted = self.compile
        if wanted is None:
            wanted = os.environ.get("DSPARK_COMPILE", "1") != "0"
        elif wanted and device.type != "cpu":
            raise ValueError("compile applies to the CPU; on CUDA, steps replay CUDA graphs (--cuda-graphs)")
        return wanted and device.type == "cpu"

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, spec: str) -> str:
        """A malformed policy is refused with the configuration, before any model loads."""
        if spec.strip() != AUTO:
            parse_policy(spec)
        return spec.strip()


# The engine fields every engine-running command and the server take as flags.
SELECTION_FIELDS = (
    "target",
    "drafter",
    "policy",
    "gamma",
    "dtype",
    "device",
    "max_num_seqs",
    "max_model_len",
    "max_batch_tokens",
    "prefix_caching",
    "prefix_cache_gib",
)


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} requested but CUDA is not available")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "float32":
        return torch.float32
    if spec == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
