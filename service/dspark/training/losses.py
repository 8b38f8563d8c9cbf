"""The DSpark training objective: L = a_ce L_ce + a_tv L_tv + a_conf L_conf, position-weighted.

Per block position k (1-based) with weight w_k = exp(-(k-1)/decay):
  L_ce   = -w_k log p^d_k(x*_k)
  L_tv   =  w_k ||p^d_k - p^t_k||_1
  L_conf = -w_k [c*_k log c_k + (1 - c*_k) log(1 - c_k)],  c*_k = 1 - 0.5 ||p^d_k - p^t_k||_1 (no gradient)
Each term is summed over the block's positions and averaged over blocks; positions past a
sequence's end are masked out. Everything is computed in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def position_weights(block_size: int, decay: float | None = None, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..block_size; decay defaults to block_size (the paper)."""
    decay = float(decay if decay is not None else block_size)
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


@dataclass
class LossTerms:
    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    kl: torch.Tensor
    accept: torch.Tensor  # [G] mean per-position acceptance 1 - TV/2 over valid positions (no grad)


def block_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    conf_logits: torch.Tensor | None = None,
    draft_to_target: torch.Tensor | None = None,
    coef: tuple[float, ...] = (0.1, 0.9, 1.0),
    target_log_norm: torch.Tensor | None = None,
) -> LossTerms:
    """draft_logits [N, G, V'] (V' < V with `draft_to_target` [V'] sorted target ids, a reduced
    drafting vocabulary), target_logits [N, G, V], labels [N, G] target ids, valid [N, G] bool, weights [G],
    conf_logits [N, G] (pre-sigmoid) or None; coef = (a_ce, a_tv, a_conf[, a_kl]). With a reduced
    vocabulary, target_logits may be its V' columns only, given their log normaliser
    `target_log_norm` [N, G] (log sum exp of all V target logits)."""
    valid_f = valid.float()
    blocks = valid.any(dim=1).sum().clamp(min=1)
    logp_d = F.log_softmax(draft_logits.float(), dim=-1)
    p_d = logp_d.exp()
    if draft_to_target is None:
        logp_t = F.log_softmax(target_logits.float(), dim=-1)
        p_t = logp_t.exp()
        tv = (p_d - p_t).abs().sum(-1)
        label_logp = logp_d.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
        label_ok = valid
    else:
        # Only the drafting vocabulary's columns of p^t are formed: elementwise work over all V in
        # float32 was most of a training step.
        if target_log_norm is None:
            target_log_norm = torch.logsumexp(target_logits.float(), dim=-1)
            target_logits = target_logits.index_select(-1, draft_to_target)
        logp_t = target_logits.float() - target_log_norm[..., None]
        p_t = logp_t.exp()
        # Outside the draft vocabulary p^d = 0: those tokens add their target mass to the L1 distance.
        tv = (p_d - p_t).abs().sum(-1) + (1.0 - p_t.sum(-1)).clamp(min=0)
        row = torch.searchsorted(draft_to_target, labels).clamp(max=len(draft_to_target) - 1)
        label_ok = valid & (draft_to_target[row] == labels)
        label_logp = logp_d.gather(-1, row[..., None]).squeeze(-1)
    w = weights[None, :] * valid_f
    ce = -(w * label_logp * label_ok.float()).sum() / blocks
    tv_loss = (w * tv).sum() / blocks
    a_ce, a_tv, a_conf = coef[:3]
    a_kl = coef[3] if len(coef) > 3 else 0.0
    if a_kl:
        kl_pos = (p_t * (logp_t - logp_d)).sum(-1)
        kl = (w * kl_pos).sum() / blocks
    else:
        kl = torch.zeros((), device=draft_logits.device)
    if conf_logits is not None:
        soft = (1.0 - 0.5 * tv).detach().clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft, reduction="none")
        conf = (w * bce).sum() / blocks
    else:
        conf = torch.zeros((), device=draft_logits.device)
    total = a_ce * ce + a_tv * tv_loss + a_conf * conf + a_kl * kl
    with torch.no_grad():
        accept = ((1.0 - 0.5 * tv) * valid_f).sum(0) / valid_f.sum(0).clamp(min=1)
    return LossTerms(total, ce, tv_loss, conf, kl, accept)


def expected_tau(accept: torch.Tensor) -> float:
    """Accepted length (incl. bonus) if positions were accepted independently with these rates."""
    tau, survive = 1.0, 1.0
    for a in accept.tolist():
        survive *= a
        tau += survive
    return tau if math.isfinite(tau) else float("nan")
