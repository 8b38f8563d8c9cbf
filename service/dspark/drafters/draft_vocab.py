"""Reduced drafting vocabularies: drafts sampled over a subset of the target's ids.

The probabilities handed to verification are the exact restricted distribution, zero elsewhere,
so rejection sampling stays lossless while the drafter's vocabulary-sized work (head matmul,
softmax, sampling) shrinks by V / len(ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dspark.drafters.dspark_model import DSparkModel


def token_ids(d2t: torch.Tensor | None) -> torch.Tensor | None:
    """Target ids of a reduced vocabulary stored as offsets (id = index + d2t[index]); None = all."""
    if d2t is None:
        return None
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def widen(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """probs [..., Vd] over `ids` -> [..., vocab_size], zero outside `ids`."""
    full = probs.new_zeros(*probs.shape[:-1], vocab_size)
    return full.index_copy_(-1, ids, probs)


@dataclass
class DraftVocab:
    """A DSpark drafter's restricted rows of the LM head and of the Markov projection W2."""

    ids: torch.Tensor  # [Vd] target token ids, sorted
    head: torch.Tensor  # [Vd, d]
    markov: torch.Tensor | None  # [Vd, r]
    vocab_size: int

    @classmethod
    def of(cls, model: DSparkModel) -> DraftVocab | None:
        ids = model.draft_token_ids()
        if ids is None:
            return None
        markov = model.markov_head.markov_w2.weight[ids] if model.markov_head is not None else None
        return cls(ids, model.lm_head.weight[ids], markov, model.config.vocab_size)

    def widen(self, probs: torch.Tensor) -> torch.Tensor:
        return widen(probs, self.ids, self.vocab_size)
