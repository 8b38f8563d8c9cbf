"""Batched lossless verification of draft blocks (rejection sampling with residual and bonus)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark.engine.sampler import random_rows, sample


def verify_draft_tokens(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    lengths: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    host_lengths: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each request's draft and sample the token that follows it.

    draft_tokens [R, G]; draft_probs [R, G, V] (the distributions the tokens were drawn from;
    None means deterministic one-hot drafts, e.g. n-gram lookup); target_probs [R, G + 1, V]
    (target distribution after each verified input, already temperature/top-k/top-p
    processed; [R, G, V] is enough when no row can accept all G drafts, e.g. each row verifying G
    ends at a draft of probability 0, whose row is the last one read); lengths [R] the verify length l_r <= G of each request (0 = plain decode);
    host_lengths, the same on the host when known: a seeded row with l_r = 0 then draws exactly
    what plain decoding draws from its generator (one token), so speculation turned off for one
    request reproduces its plain output while its neighbours speculate.

    Returns (num_accepted [R], next_token [R]): the next token is drawn from the residual
    norm(max(0, p_t - p_d)) at the first rejection, or from p_t after the last verified
    draft (the bonus token), so outputs are distributed exactly as the target's.
    """
    num_rows, gamma = draft_tokens.shape
    rows = torch.arange(num_rows, device=target_probs.device)
    if gamma == 0:
        return torch.zeros_like(lengths), sample(target_probs[:, 0], generators)

    p_x = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        ratio = p_x
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        ratio = (p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)
    used = [n > 0 for n in host_lengths] if host_lengths is not None else None
    u = random_rows((num_rows, gamma), generators, target_probs.device, "uniform", used)
    in_budget = torch.arange(gamma, device=lengths.device)[None, :] < lengths[:, None]
    accepted = (u < ratio) & in_budget
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < lengths
    at = num_accepted.clamp(max=gamma - 1)
    if draft_probs is None:
        q_next = torch.zeros_like(p_next).scatter_(-1, draft_tokens[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, at].float()
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only through rounding (a rejection needs p < q somewhere); fall back to p_t.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    final = torch.where(rejected[:, None], residual, p_next)
    return num_accepted, sample(final, generators)


def verify_greedy(
    draft_tokens: torch.Tensor, target_argmax: torch.Tensor, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_draft_tokens` for greedy rows, without probabilities: accept while the draft equals
    the target argmax; the next token is the argmax after the accepted prefix.

    draft_tokens [R, G]; target_argmax [R, G + 1] (or [R, G], as in `verify_draft_tokens`); lengths [R],
    or None when every row verifies all G drafts (no budget mask to build).
    """
    gamma = draft_tokens.shape[1]
    matched = draft_tokens == target_argmax[:, :gamma]
    if lengths is not None:
        matched &= torch.arange(gamma, device=lengths.device)[None, :] < lengths[:, None]
    num_accepted = matched.long().cumprod(dim=1).sum(dim=1)
    return num_accepted, target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
