"""`vllm serve` spellings for `dspark serve`: --speculative-config, flags this server refuses or
ignores (each with its reason), and vLLM's `--served-model-name a b` list form."""

from __future__ import annotations

from typing import Any, Literal

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dspark.validation import describe

# vLLM flags this server cannot honour, and why; values in `allowed` are accepted (they ask for
# what this server does anyway).
REFUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    "--trust-remote-code": (
        "this server runs its own Llama/Qwen2/Qwen3 implementation and never executes code from a "
        "model repository",
        (),
    ),
    "--tensor-parallel-size": ("one replica runs on one device; scale out with --num-replicas", ("1",)),
    "--pipeline-parallel-size": ("one replica runs on one device; scale out with --num-replicas", ("1",)),
    "--quantization": (
        "weights load as float32 or bfloat16 (--dtype); quantized checkpoints are not supported",
        (),
    ),
    "--load-format": ("only safetensors checkpoints load", ("auto", "safetensors")),
    "--kv-cache-dtype": ("the KV cache has the model's dtype", ("auto",)),
    "--enable-lora": ("LoRA adapters are not supported", ()),
    "--speculative-model": ("give the drafter in --speculative-config '{\"model\": ...}'", ()),
}
# Short spellings vLLM accepts for the refused flags.
REFUSED_SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-q": "--quantization"}
# vLLM flags accepted and ignored: flag -> (takes a value, why it changes nothing here).
IGNORED: dict[str, tuple[bool, str]] = {
    "--gpu-memory-utilization": (
        True,
        "the KV cache is sized by --max-num-seqs x --max-model-len, not by a share of device memory",
    ),
    "--swap-space": (True, "preempted requests are recomputed, never swapped to host memory"),
    "--disable-log-requests": (False, "request contents are never logged"),
    "--disable-log-stats": (False, "statistics are exported on /metrics, not logged"),
    "--enable-chunked-prefill": (False, "prefill is always chunked by --max-num-batched-tokens"),
    "--uvicorn-log-level": (True, "the HTTP server logs through Ray Serve's logger"),
}
_VALUE_FLAGS_TAKING_LISTS = ("--served-model-name",)
_TAKES_VALUE = {flag for flag, (_, allowed) in REFUSED.items() if allowed}


def rewrite_vllm_args(args: list[str]) -> tuple[list[str], list[str]]:
    """The argument list with ignored flags removed and `--served-model-name a b` spelled as repeated
    options, plus one warning per ignored flag; a refused flag raises click.UsageError."""
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        flag = REFUSED_SHORT.get(flag, flag)
        if flag in REFUSED:
            reason, allowed = REFUSED[flag]
            value = inline if eq else (args[i + 1] if flag in _TAKES_VALUE and i + 1 < len(args) else None)
            if value not in allowed or not allowed:
                shown = f"{flag} {value}" if value is not None else flag
                raise click.UsageError(f"{shown} is not supported: {reason}")
            i += 1 if eq else 2
            continue
        if flag in IGNORED:
            takes_value, reason = IGNORED[flag]
            notes.append(f"{flag} is accepted and has no effect: {reason}")
            i += 1 if (eq or not takes_value) else 2
            continue
        if flag in _VALUE_FLAGS_TAKING_LISTS and not eq:
            i += 1
            names = []
            while i < len(args) and not args[i].startswith("-"):
                names.append(args[i])
                i += 1
            out += [part for name in names for part in (flag, name)] or [flag]
            continue
        out.append(arg)
        i += 1
    return out, notes


class VllmServeCommand(click.Command):
    """A click command that reads vLLM's spellings before parsing (see `rewrite_vllm_args`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args, notes = rewrite_vllm_args(list(args))
        for note in notes:
            click.echo(f"warning: {note}", err=True)
        return super().parse_args(ctx, args)


class SpeculativeConfig(BaseModel):
    """vLLM's --speculative-config, for the methods this server runs."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["dspark", "dflash", "eagle3", "ngram"]
    model: str | None = Field(
        None,
        min_length=1,
        description="Drafter checkpoint: a directory or hub id; default: the target's shipped drafter "
        "of this method.",
    )
    num_speculative_tokens: int | None = Field(None, ge=1, le=32, description="Draft block size (gamma).")

    @model_validator(mode="after")
    def _ngram_has_no_model(self) -> SpeculativeConfig:
        if self.method == "ngram" and self.model is not None:
            raise ValueError("method ngram looks tokens up in the prompt and output; it takes no model")
        return self

    def engine_flags(self) -> dict[str, Any]:
        # `method:model` makes the drafter loader refuse a checkpoint of another kind.
        drafter = f"{self.method}:{self.model}" if self.model else self.method
        flags: dict[str, Any] = {"drafter": drafter}
        if self.num_speculative_tokens is not None:
            flags["gamma"] = self.num_speculative_tokens
        return flags


def speculative_flags(raw: str | None, drafter: str | None, gamma: int | None) -> dict[str, Any]:
    """The --drafter/--gamma that --speculative-config stands for; conflicts are usage errors."""
    if raw is None:
        return {}
    try:
        spec = SpeculativeConfig.model_validate_json(raw)
    except ValidationError as e:
        raise click.BadParameter(describe(e), param_hint="'--speculative-config'") from None
    if drafter is not None:
        raise click.UsageError("--speculative-config names the drafter; leave out --drafter")
    flags = spec.engine_flags()
    if gamma is not None and flags.get("gamma", gamma) != gamma:
        raise click.UsageError(
            f"--gamma {gamma} and num_speculative_tokens {flags['gamma']} disagree; give one of them"
        )
    return flags
