"""Sampling a DSpark block left to right through the sequential head."""

from __future__ import annotations

import torch

from dspark.drafters.dspark_model import DSparkModel
from dspark.engine.sampler import SamplingTensors, logits_to_probs, sample


def sample_block(
    model: DSparkModel, hidden: torch.Tensor, anchor: torch.Tensor, sampling: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """hidden [R, G, d], anchor [R] -> tokens [R, G], probs [R, G, V] (each token's exact draft
    distribution, after the request's temperature / top-k / top-p), confidence logits [R, G] or None."""
    base = model.lm_head(hidden)
    head, conf_head = model.markov_head, model.confidence_head
    if head is None:  # DFlash: positions are independent, sample them all at once
        probs = logits_to_probs(base, sampling)
        conf = conf_head(hidden, None) if conf_head is not None else None
        return sample(probs, sampling.generators), probs, conf
    prev, state = anchor, head.initial_state(hidden[:, 0])
    tokens, probs, confs = [], [], []
    for k in range(hidden.shape[1]):
        bias, emb, state = head.step(hidden[:, k], prev, state)
        p = logits_to_probs(base[:, k] + bias, sampling)
        prev = sample(p, sampling.generators)
        tokens.append(prev)
        probs.append(p)
        if conf_head is not None:
            confs.append(conf_head(hidden[:, k], emb))
    conf = torch.stack(confs, 1) if confs else None
    return torch.stack(tokens, 1), torch.stack(probs, 1), conf
