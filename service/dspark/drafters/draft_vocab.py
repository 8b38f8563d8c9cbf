"""Reduced drafting vocabularies: drafts sampled over a subset of the target's ids.

The probabilities handed to verification are the exact restricted distribution, zero elsewhere,
so rejection sampling stays lossless while the drafter's vocabulary-sized work (head matmul,
softmax, sampling) shrinks by V / len(ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dspark.models.packed_linear import PackedLinear, linear_over

if TYPE_CHECKING:
    from dspark.drafters.dspark_model import DSparkModel


def token_ids(d2t: torch.Tensor | None) -> torch.Tensor | None:
    """Target ids of a reduced vocabulary stored as offsets (id = index + d2t[index]); None = all."""
    if d2t is None:
        return None
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def d2t_offsets(ids: torch.Tensor) -> torch.Tensor:
    """The `d2t` buffer of sorted target ids `ids` (the inverse of `token_ids`)."""
    return ids - torch.arange(ids.numel(), device=ids.device)


@dataclass
class DraftVocab:
    """What a drafter samples over: its head's rows and their target ids (None = the whole
    vocabulary, where row i is token i and both mappings are the identity)."""

    ids: torch.Tensor | None  # [Vd] target token ids, sorted
    head: nn.Module  # hidden [N, d] -> logits [N, Vd]: the LM head's rows
    markov: nn.Module | None  # z [N, r] -> bias [N, Vd]: rows of DSpark's Markov projection W2
    vocab_size: int

    @classmethod
    def of(cls, model: DSparkModel) -> DraftVocab:
        """The rows of the target-shared head (and W2) that a DSpark / DFlash model drafts over,
        packed like the model's own linears (`pack_linears`) when those are: a row subset taken
        per call would be reordered for oneDNN on every call."""
        ids = model.draft_token_ids()
        w2 = model.markov_head.markov_w2 if model.markov_head is not None else None
        if ids is None:
            return cls(None, model.lm_head, w2, model.config.vocab_size)
        packed = isinstance(model.lm_head, PackedLinear)
        if w2 is not None and not model.config.markov_draft_vocab:
            w2 = linear_over(w2.weight[ids], packed)
        return cls(ids, linear_over(model.lm_head.weight[ids], packed), w2, model.config.vocab_size)

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Row indices -> target token ids."""
        return index if self.ids is None else self.ids[index]

    def widen(self, probs: torch.Tensor | None) -> torch.Tensor | None:
        """probs [..., Vd] over the rows -> [..., V], zero outside the drafting vocabulary (None,
        an all-greedy block's one-hot distributions, stays None)."""
        if self.ids is None or probs is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        return full.index_copy_(-1, self.ids, probs)
