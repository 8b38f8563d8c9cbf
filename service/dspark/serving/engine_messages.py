"""What the replica and its engine process send each other over their pipe (pickled dataclasses).

Replica -> engine: `EngineSpec` once, then `AddRequest`, `AbortRequest` and `Stop`.
Engine -> replica: `EngineInfo` once, then one `StepReport` per step (or per batch of commands
that changed something), and at the end `Shutdown` (a clean stop) or `EngineFailed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspark.engine.outputs import RequestOutput, StepStats
from dspark.engine.sampling_params import SamplingParams

EngineFactory = Callable[[Any], Any]
SHUTDOWN_REASON = "the server shut down before the request finished"


@dataclass
class EngineSpec:
    """How to build the engine: `factory(config)`; the factory must be importable by name."""

    factory: EngineFactory
    config: Any


@dataclass
class EngineInfo:
    """What the serving layer reads from its engine, captured once at start-up."""

    model_name: str
    max_model_len: int
    config: Any  # the engine's config (max_num_seqs, policy, ...)
    tokenizer: Any

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        return cls(engine.model_name, engine.max_model_len, engine.config, engine.tokenizer)


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Stop:
    """The first drains (no new requests, running ones finish), the second aborts what is left."""


@dataclass
class StepReport:
    """Everything one pass of the engine loop produced: request acknowledgements, every output of
    the step (aborts included), and the step's statistics when a step ran."""

    outputs: list[RequestOutput] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (request id, ValueError message)
    stats: StepStats | None = None
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class EngineFailed:
    message: str


@dataclass
class Shutdown:
    """The engine loop stopped as asked; nothing follows."""
