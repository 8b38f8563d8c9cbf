"""Turns a step plan into one ragged forward of the target model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.scheduler import StepPlan
from dspark.models.compiled_forward import CompiledForward
from dspark.models.forward_batch import ForwardBatch
from dspark.models.kv_cache import KVCache
from dspark.models.transformer import DecoderModel, ForwardOutput


@dataclass
class StepForward:
    """A forward's output and where each planned request's tokens and logits sit in it."""

    output: ForwardOutput
    offsets: list[int]  # start of each request's tokens in output.layer_hidden (len = R + 1)
    logit_starts: list[int]  # first row in output.logits per request (decodes, then prefills)


class ModelRunner:
    def __init__(self, forward: DecoderModel | CompiledForward, cache: KVCache, device: torch.device) -> None:
        self.forward = forward
        self.cache = cache
        self.device = device

    def run(
        self, plan: StepPlan, draft_tokens: list[list[int]], hidden_layers: tuple[int, ...]
    ) -> StepForward:
        """Decodes feed [anchor] + their verified draft tokens; prefills feed their prompt chunk.

        Decode rows get logits at every input (verification); a prefill chunk only at its last
        token, and only when it completes the prompt (the first output token is sampled there).
        """
        tokens: list[int] = []
        slots, starts, lengths, logit_rows, logit_starts = [], [], [], [], []
        for request, draft in zip(plan.decodes, draft_tokens, strict=True):
            logit_starts.append(len(logit_rows))
            logit_rows.extend(range(len(tokens), len(tokens) + 1 + len(draft)))
            tokens.append(request.last_token_id)
            tokens.extend(draft)
            slots.append(request.slot)
            starts.append(request.num_cached)
            lengths.append(1 + len(draft))
        for request, chunk in plan.prefills:
            begin = request.num_cached
            tokens.extend(request.prompt_token_ids[begin : begin + chunk])
            logit_starts.append(len(logit_rows))
            if begin + chunk == len(request.prompt_token_ids):
                logit_rows.append(len(tokens) - 1)
            slots.append(request.slot)
            starts.append(begin)
            lengths.append(chunk)
        batch = ForwardBatch.build(slots, starts, lengths, logit_rows, self.device)
        input_ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        output = self.forward(input_ids, batch, self.cache, hidden_layers=hidden_layers)
        return StepForward(output, batch.offsets, logit_starts)
