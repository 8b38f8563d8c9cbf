"""Online target features (SpecForge's online mode): the frozen target's forward on each batch.

Nothing is stored: a training sequence holds only its token ids, and the sequences a step draws
get their feature layers and final normed hidden state from one no-grad target forward right
before packing. The results are rounded to bf16 as the cached shards store them, so an online
batch equals the cached batch of the same samples up to the rounding of the forward itself
(padding and batch composition differ). They stay on the target's device, where packing and
the drafter's step use them: a round trip through host memory made GPU training host-bound.
"""

from __future__ import annotations

import dataclasses

import torch
from dspark.training.features import DOMAIN_IDS, Sequence, length_batches, log_normalizer, target_hidden

STORED_DTYPE = torch.bfloat16  # what the cached shards hold (features.py)


class OnlineFeatures:
    """Fills sequences' `features` / `last` (and `log_norm`, given a head) from the target."""

    def __init__(self, model, layers: tuple[int, ...], max_tokens: int = 4096) -> None:
        self.model = model.eval().requires_grad_(False)
        self.layers = tuple(layers)
        self.max_tokens = max_tokens
        self.norm_head: torch.Tensor | None = None  # the target's whole head, when p^t is restricted

    @torch.inference_mode()
    def fill(self, sequences: list[Sequence]) -> list[Sequence]:
        """Copies of `sequences` with their target features (the inputs are left as they are)."""
        filled: list[Sequence | None] = [None] * len(sequences)
        for group in length_batches([len(s.tokens) for s in sequences], self.max_tokens):
            tokens = [sequences[i].tokens.tolist() for i in group]
            for i, (feats, last) in zip(group, target_hidden(self.model, tokens, self.layers), strict=True):
                seq = sequences[i]
                last = last.to(STORED_DTYPE)
                norm = (
                    log_normalizer(last, seq.prompt_len, self.norm_head)
                    if self.norm_head is not None
                    else None
                )
                filled[i] = dataclasses.replace(
                    seq, features=feats.to(STORED_DTYPE), last=last, log_norm=norm
                )
        return [_normal(s) for s in filled]


def _normal(seq: Sequence | None) -> Sequence:
    """A copy made outside inference mode: inference tensors may not enter autograd's graph."""
    assert seq is not None and seq.features is not None and seq.last is not None
    return dataclasses.replace(
        seq,
        features=seq.features.clone(),
        last=seq.last.clone(),
        log_norm=seq.log_norm.clone() if seq.log_norm is not None else None,
    )


def token_sequences(groups: list[list[dict]]) -> list[Sequence]:
    """Sequences without features, in the order the cached feature shards store them."""
    return [
        Sequence(
            torch.tensor(s["prompt_ids"] + s["response_ids"], dtype=torch.long),
            None,
            None,
            len(s["prompt_ids"]),
            DOMAIN_IDS[s["domain"]],
        )
        for samples in groups
        for s in samples
    ]
