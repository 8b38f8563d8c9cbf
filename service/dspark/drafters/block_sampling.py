"""Sampling a DSpark block left to right through the sequential head, optionally over a reduced
drafting vocabulary."""

from __future__ import annotations

import torch

from dspark.drafters.draft_vocab import DraftVocab
from dspark.drafters.dspark_model import DSparkModel
from dspark.engine.sampler import SamplingTensors, draw


def sample_block(
    model: DSparkModel,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    sampling: SamplingTensors,
    vocab: DraftVocab,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """hidden [R, G, d], anchor [R] -> tokens [R, G], probs [R, G, V] (each token's exact draft
    distribution, after the request's temperature / top-k / top-p; None when every row is greedy,
    i.e. one-hot), confidence logits [R, G] or None."""
    # A 3-D input whose leading strides do not merge (a horizon cut, even a width-1 one that
    # .contiguous() leaves alone) sends F.linear to a bmm over a broadcast copy of the whole
    # head; a 2-D [R * G, d] input (reshape copies only what it must) is one plain matmul.
    base = vocab.head(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)
    head, conf_head = model.markov_head, model.confidence_head
    if head is None:  # DFlash: positions are independent, sample them all at once
        index, probs = draw(base, sampling)
        conf = conf_head(hidden, None) if conf_head is not None else None
        return vocab.to_target(index), vocab.widen(probs), conf
    prev, state = anchor, head.initial_state(hidden[:, 0])
    tokens, probs, confs = [], [], []
    for k in range(hidden.shape[1]):
        z, emb, state = head.step(hidden[:, k], prev, state)
        index, p = draw(base[:, k] + vocab.markov(z), sampling)
        prev = vocab.to_target(index)
        tokens.append(prev)
        probs.append(p)
        if conf_head is not None:
            confs.append(conf_head(hidden[:, k], emb))
    conf = torch.stack(confs, 1) if confs else None
    stacked = torch.stack(probs, 1) if probs[0] is not None else None  # None: every row greedy
    return torch.stack(tokens, 1), vocab.widen(stacked), conf
