"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Bounds that keep every value representable where the step puts it (int64 tensors, a torch
# generator's seed); how many stop strings or logit_bias entries a request may carry is the
# server's limit (`dspark.serving.request_limits`).
MAX_TOP_K = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class StructuredOutput(BaseModel):
    """What the output must match (`engine.structured`): `value` is a JSON schema as JSON text, a
    regex, a Lark grammar, or the JSON list of allowed strings (`choice`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_schema", "regex", "grammar", "choice"]
    value: str = Field(max_length=1_000_000)


class SamplingParams(BaseModel):
    """How one request is sampled and when it stops. `temperature == 0` means greedy.

    Penalties and `logit_bias` change the target distribution itself (greedy takes the argmax of
    the processed logits); `min_p`, top-k and top-p truncate it after temperature.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="Maximum number of generated tokens.")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0 disables top-k; the vocabulary or more, too.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="Over prompt and output tokens.")
    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: int | None = Field(
        None, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="Per-request seed for reproducible sampling."
    )
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(
        0,
        ge=0,
        description="EOS and stop tokens are masked, and stop strings unchecked, until this many exist.",
    )
    include_stop_str_in_output: bool = Field(
        False, description="Keep the matched stop string, or the stop token's text, in the output."
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the output text.")
    spaces_between_special_tokens: bool = Field(
        True, description="Separate special tokens from the text around them by a space (when not skipped)."
    )
    logprobs: int | None = Field(None, ge=0, le=20, description="Return this many top logprobs per token.")
    max_draft_tokens: int | None = Field(
        None, ge=0, description="Cap on draft tokens verified per step (0 = no speculation; None = policy's)."
    )
    structured: StructuredOutput | None = Field(None, description="Grammar the output must match.")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        for token, bias in v.items():
            if token < 0:
                raise ValueError(f"logit_bias token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias of token {token} is {bias}; it must lie in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _stopping_consistent(self):
        if self.structured is not None and self.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with structured outputs (the grammar ends with EOS)"
            )
        if self.structured is not None and self.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured outputs (a complete match allows only EOS)"
            )
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits need `logits_processors` before sampling or argmax."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def for_samples(self, n: int) -> list[SamplingParams]:
        """Parameters of n parallel samples: with a seed, sample i gets seed + i (as vLLM), so a
        seeded request with n > 1 is reproducible and its samples differ."""
        if n == 1 or self.seed is None:
            return [self] * n
        return [self.model_copy(update={"seed": (self.seed + i) % 2**63}) for i in range(n)]
