"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request is sampled and when it stops. `temperature == 0` means greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="Maximum number of generated tokens.")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    seed: int | None = Field(None, description="Per-request seed for reproducible sampling.")
    stop: list[str] = Field(default_factory=list, max_length=16)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="Return this many top logprobs per token.")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
