"""Request schemas of the OpenAI-compatible API. Unknown fields are rejected (400), as are bad values."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

MAX_STOP = 16
MAX_LOGPROBS = 20
_TOKEN_ID = Annotated[int, Field(ge=0, lt=2**31)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints, with OpenAI's defaults and bounds."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, description="Upper bound on generated tokens.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM extension; 0 or -1 disables top-k.")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    stop_token_ids: list[_TOKEN_ID] | None = Field(None, max_length=MAX_STOP)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = Field(None, max_length=256)
    ignore_eos: StrictBool = False
    return_tokens_as_token_ids: StrictBool = Field(
        False, description="vLLM extension: logprob tokens are spelled 'token_id:<id>'."
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[_TOKEN_ID] | list[str] = Field(description="Text, token ids, or a one-element list.")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if all(not m.text().strip() for m in self.messages):
            raise ValueError("messages must contain some text")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
