"""A request's state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dspark.engine.detokenizer import Detokenizer
from dspark.engine.outputs import RequestOutput, RequestStats
from dspark.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dspark.engine.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token ids and progress of one generation.

    Invariant while decoding: the target's KV cache holds `num_cached` tokens, and exactly one
    token (`last_token_id`, the anchor of the next draft) is generated but not yet cached.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int = -1  # KV cache slot (target and drafter share the index)
    num_cached: int = 0
    # (holder, length): the prompt's first `length` tokens were reused at admission from that
    # slot's cache, or ("stored", n) of the prefix store (the drafter copies its own context of
    # them from the same holder).
    prefix_source: tuple[int | tuple[str, int], int] | None = None
    generator: torch.Generator | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    text: str = ""  # detokenized output emitted so far
    detokenizer: Detokenizer | None = None  # None: no text (engines built without a tokenizer)
    finish_reason: str | None = None
    grammar: GrammarState | None = None  # structured outputs: the matcher of the tokens so far
    # EOS and stop token ids masked while fewer than params.min_tokens tokens exist (set at admission)
    min_tokens_stops: frozenset[int] = frozenset()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token, without concatenating the token lists."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt_token_ids)

    @property
    def holds_stops(self) -> bool:
        """Whether the target's next logits mask EOS and the stop tokens (min_tokens not reached)."""
        return bool(self.min_tokens_stops) and len(self.output_token_ids) < self.params.min_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)
