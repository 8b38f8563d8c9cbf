"""Request schemas of the OpenAI-compatible API. Unknown fields are rejected (400), as are bad values,
and so are known fields that ask for something this server does not do (the reason named)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from dspark.engine.sampling_params import MAX_TOP_K, StructuredOutput

MAX_STOP = 16  # stop_token_ids (stop strings: the server's limits)
MAX_LOGPROBS = 20
MAX_N = 128
MAX_PROMPTS = 256
MAX_TEMPLATE_KWARGS = 32
_TOKEN_ID = Annotated[int, Field(ge=0, lt=2**31)]
# Arguments of `apply_chat_template` and variables it sets itself: not for chat_template_kwargs.
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    clash = sorted(set(v or {}) & _TEMPLATE_ARGUMENTS)
    if clash:
        raise ValueError(
            f"{clash[0]!r} cannot be set through chat_template_kwargs (the server or a request field sets it)"
        )
    return v


ChatTemplateKwargs = Annotated[
    dict[str, Any] | None,
    Field(
        None,
        max_length=MAX_TEMPLATE_KWARGS,
        description="vLLM extension: extra variables of the chat template, e.g. Qwen3's enable_thinking.",
    ),
]


MAX_JSON_DEPTH = 256  # nesting levels of a request body: a deeper one cannot be pickled to a replica


def _json_problem(data: Any) -> str | None:
    """What is wrong with decoded JSON, naming where: a string (key or value) that holds a lone
    surrogate (JSON may escape one, `"\\ud800"`, but no tokenizer or grammar takes it), or nesting
    deeper than MAX_JSON_DEPTH. Iterative, so that any depth the JSON parser took is walked."""
    pending: list[tuple[str, Any, int]] = [("", data, 0)]
    while pending:
        where, value, depth = pending.pop()
        if isinstance(value, str):
            if not value.isascii() and not _is_utf8(value):
                return f"{where or 'body'}: a lone surrogate (\\ud800-\\udfff) is not Unicode text"
        elif depth > MAX_JSON_DEPTH:
            return f"{where}: nested deeper than {MAX_JSON_DEPTH} levels"
        elif isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not key.isascii() and not _is_utf8(key):
                    return f"{f'{where}.{key}' if where else key}: a lone surrogate is not Unicode text"
                if isinstance(item, str | dict | list):  # numbers (token ids) need no path
                    pending.append((f"{where}.{key}" if where else str(key), item, depth + 1))
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = Field(
        False, description="vLLM extension: with include_usage, every chunk carries the usage so far."
    )


class SpeculativeOptions(_Strict):
    """Extension: per-request speculation. `enabled: false` decodes this request without drafts
    while its batch neighbours speculate; `max_draft_tokens` caps its verify length per step."""

    enabled: StrictBool = True
    max_draft_tokens: int | None = Field(None, ge=0, le=64)

    @model_validator(mode="after")
    def _consistent(self):
        if not self.enabled and self.max_draft_tokens:
            raise ValueError("max_draft_tokens > 0 contradicts enabled: false")
        return self

    @property
    def cap(self) -> int | None:
        return 0 if not self.enabled else self.max_draft_tokens


# Known fields that ask for something this server does not do: refused with the reason (a field
# accepted while what it asks for is ignored would be worse). `None` counts as absent.
_UNSUPPORTED: dict[str, str] = {
    "tools": "tool calling is not supported (this server has no tool-call parser)",
    "functions": "function calling is not supported (this server has no tool-call parser)",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this model has no reasoning-effort control",
    "prompt_logprobs": "prompt logprobs are not supported",
    "suffix": "suffix (insertion) is not supported",
    "guided_json": "the guided_* fields are not supported; use structured_outputs",
    "guided_regex": "the guided_* fields are not supported; use structured_outputs",
    "guided_choice": "the guided_* fields are not supported; use structured_outputs",
    "guided_grammar": "the guided_* fields are not supported; use structured_outputs",
}
_UNSUPPORTED_COMMON = ("prompt_logprobs", *(k for k in _UNSUPPORTED if k.startswith("guided_")))
JSON_OBJECT = '{"type": "object"}'


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one constraint on the output."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1, description="A Lark grammar (llguidance's dialect).")
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [n for n in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, n)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self

    def constraint(self) -> StructuredOutput:
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput(kind="json_schema", value=schema)
        if self.regex is not None:
            return StructuredOutput(kind="regex", value=self.regex)
        if self.choice is not None:
            return StructuredOutput(kind="choice", value=json.dumps(self.choice))
        if self.grammar is not None:
            return StructuredOutput(kind="grammar", value=self.grammar)
        return StructuredOutput(kind="json_schema", value=JSON_OBJECT)


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class _SamplingFields(_Strict):
    """Fields shared by both endpoints, with OpenAI's defaults and bounds."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, description="Upper bound on generated tokens.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(
        0, ge=-1, le=MAX_TOP_K, description="vLLM extension; 0, -1 or the vocabulary size or more: off."
    )
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    stop_token_ids: list[_TOKEN_ID] | None = Field(None, max_length=MAX_STOP)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="Parallel samples per prompt.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM extension; 1 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extension; 0 = off.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension: constrain the output."
    )
    speculative: SpeculativeOptions | None = Field(
        None, description="DSpark extension: per-request speculation."
    )
    return_spec_stats: StrictBool = Field(
        False, description="DSpark extension: add `spec_decode_stats` to the response (or final chunk)."
    )
    # Metadata: stored nowhere, changes nothing about the output.
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    store: StrictBool | None = None
    service_tier: str | None = Field(None, max_length=32)
    ignore_eos: StrictBool = Field(False, description="vLLM extension: EOS neither stops nor is masked.")
    min_tokens: int = Field(
        0, ge=0, description="vLLM extension: EOS and stop tokens are held back until this many exist."
    )
    include_stop_str_in_output: StrictBool = Field(
        False, description="vLLM extension: keep the stop string (or stop token's text) in the output."
    )
    skip_special_tokens: StrictBool = Field(True, description="vLLM extension: leave special tokens out.")
    spaces_between_special_tokens: StrictBool = Field(
        True, description="vLLM extension: a space between special tokens and text (when kept)."
    )
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
        return stops  # how many and how long: the server's limits (`request_limits`)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        for key, bias in v.items():
            if not key.isdigit() or int(key) >= 2**31:
                raise ValueError(f"logit_bias keys are token ids; {key!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias of token {key} is {bias}; it must lie in [-100, 100]")
        return v

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if (problem := _json_problem(data)) is not None:
                raise ValueError(problem.encode("utf-8", "backslashreplace").decode())  # a key may hold one
            for name in cls.unsupported_fields():
                if data.get(name) not in (None, []):
                    raise ValueError(f"{name}: {_UNSUPPORTED[name]}")
            cls._refuse_values(data)
        return data

    @classmethod
    def _refuse_values(cls, data: dict[str, Any]) -> None:
        """Values of accepted fields that ask for something unsupported (endpoint-specific)."""

    @classmethod
    def unsupported_fields(cls) -> tuple[str, ...]:
        return _UNSUPPORTED_COMMON

    def constraint(self) -> StructuredOutput | None:
        """What the output must match, for the engine (None: free text)."""
        return self.structured_outputs.constraint() if self.structured_outputs is not None else None

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @model_validator(mode="after")
    def _min_tokens_free_text(self):
        if self.min_tokens and self.constraint() is not None:
            raise ValueError(
                "min_tokens cannot be combined with structured outputs (a complete match allows only EOS)"
            )
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[_TOKEN_ID] | list[str] | list[list[_TOKEN_ID]] = Field(
        description="Text, token ids, or a list of either (one choice per prompt and sample)."
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = Field(False, description="Prefix each choice's text with its prompt.")
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, v: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str | list):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(len(p) == 0 for p in v):
                raise ValueError("prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _completion_options(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported (every sample is returned)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (it needs prompt logprobs)")
        return self

    @classmethod
    def unsupported_fields(cls) -> tuple[str, ...]:
        return (*_UNSUPPORTED_COMMON, "suffix")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one per element (a single prompt is a list of one)."""
        v = self.prompt
        if isinstance(v, list) and isinstance(v[0], str | list):
            return list(v)
        return [v]


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
    # Accepted while they ask for nothing: no tools, no tool call, plain text.
    tool_choice: Literal["none"] | None = Field(None, description="Only `none`: tools are not supported.")
    parallel_tool_calls: StrictBool | None = Field(None, description="Metadata without tools.")
    function_call: Literal["none"] | None = None
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = Field(
        None, discriminator="type"
    )
    modalities: list[Literal["text"]] | None = None
    chat_template_kwargs: ChatTemplateKwargs

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    @classmethod
    def _refuse_values(cls, data: dict[str, Any]) -> None:
        choice = data.get("tool_choice")
        if choice not in (None, "none"):
            raise ValueError(
                f"tool_choice: only 'none' is supported, not {choice!r} ({_UNSUPPORTED['tools']})"
            )

    @classmethod
    def unsupported_fields(cls) -> tuple[str, ...]:
        return (
            *_UNSUPPORTED_COMMON,
            "tools",
            "functions",
            "audio",
            "prediction",
            "web_search_options",
            "reasoning_effort",
        )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if all(not m.text().strip() for m in self.messages):
            raise ValueError("messages must contain some text")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and not isinstance(self.response_format, TextFormat | None):
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def constraint(self) -> StructuredOutput | None:
        fmt = self.response_format
        if isinstance(fmt, JsonSchemaFormat):
            return StructuredOutput(kind="json_schema", value=json.dumps(fmt.json_schema.schema_ or {}))
        if isinstance(fmt, JsonObjectFormat):
            return StructuredOutput(kind="json_schema", value=JSON_OBJECT)
        return super().constraint()

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = Field(None, max_length=256)
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize with messages: the prompt a chat completion would see (vLLM's shape)."""

    model: str | None = Field(None, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    chat_template_kwargs: ChatTemplateKwargs

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    @model_validator(mode="after")
    def _one_ending(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def tokenize_request(data: Any) -> TokenizeRequest:
    """The /tokenize body as the shape it has: messages (chat) or a prompt (raises ValidationError)."""
    if isinstance(data, dict) and "messages" in data:
        return TokenizeChatRequest.model_validate(data)
    return TokenizeCompletionRequest.model_validate(data)


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape): token ids back to text, special tokens included."""

    model: str | None = Field(None, max_length=256)
    tokens: list[_TOKEN_ID]
