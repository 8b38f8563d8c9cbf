"""The target distribution verification samples from, for batches where some requests ask for
penalties, `logit_bias`, `min_tokens` (not yet reached) or a grammar.

Only those requests' rows are gathered and processed (the rest keep the forward's logits): an
all-default batch costs one pass over its requests, and a processed request costs its own rows,
not a copy of the whole batch's [R, width + 1, V] logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.engine.logits_processors import LogitsProcessors
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors, logits_to_probs, row_argmax
from dspark.engine.structured import apply_masks, grammar_masks


@dataclass
class ProcessedRows:
    rows: list[int]  # batch rows whose requests ask for processing
    index: torch.Tensor  # the same on the logits' device
    logits: torch.Tensor  # [P, ..., V] float32, processed


def process_rows(
    requests: Sequence[Request],
    logits: torch.Tensor,
    drafts: torch.Tensor | None = None,
    lengths: Sequence[int] | None = None,
) -> ProcessedRows | None:
    """Process the rows that need it; logits [R, W, V] (position k after drafts [R, >= W - 1]
    0..k-1, row r read up to position lengths[r]) or [R, V] (a prompt's first token). None: no row."""
    rows = [
        i
        for i, r in enumerate(requests)
        if r.params.processes_logits or r.holds_stops or r.grammar is not None
    ]
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    chosen = [requests[i] for i in rows]
    sub = logits[index].float()
    sub_drafts = drafts[index] if drafts is not None else None
    vocab = logits.shape[-1]
    if (processors := LogitsProcessors.build(chosen, vocab, logits.device)) is not None:
        sub = processors.apply(sub, sub_drafts)
    width = logits.shape[1] if logits.dim() == 3 else 1
    sub_lengths = [lengths[i] for i in rows] if lengths is not None else [0] * len(rows)
    masks = grammar_masks([r.grammar for r in chosen], sub_drafts, sub_lengths, width, vocab)
    if masks is not None:  # position k masked after drafts 0..k-1, so forbidden drafts are rejected
        sub = apply_masks(sub, masks)
    return ProcessedRows(rows, index, sub)


def target_argmax(logits: torch.Tensor, processed: ProcessedRows | None) -> torch.Tensor:
    """Greedy targets: the argmax of each row's (processed) logits."""
    out = row_argmax(logits)
    if processed is not None:
        out[processed.index] = row_argmax(processed.logits)
    return out


def target_probs(
    logits: torch.Tensor, sampling: SamplingTensors, processed: ProcessedRows | None
) -> torch.Tensor:
    """`logits_to_probs` of each row's (processed) logits."""
    probs = logits_to_probs(logits, sampling)
    if processed is not None:
        probs[processed.index] = logits_to_probs(processed.logits, sampling.select(processed.rows))
    return probs
