"""The DSpark objective against a per-position loop written straight from the paper's equations."""

from __future__ import annotations

import math

import torch
from dspark.training.losses import block_loss, expected_tau, position_weights


def _reference(draft, target, labels, valid, conf, weights, coef, d2t=None):
    """Loop over blocks and positions; p^d lives on the full vocabulary (zeros outside d2t)."""
    n, g, _ = draft.shape
    vocab = target.shape[-1]
    ce = tv = bce = kl = 0.0
    blocks = 0
    for b in range(n):
        if not valid[b].any():
            continue
        blocks += 1
        for k in range(g):
            if not valid[b, k]:
                continue
            w = math.exp(-k / g)
            p_draft = torch.softmax(draft[b, k].double(), -1)
            if d2t is not None:
                full = torch.zeros(vocab, dtype=torch.float64)
                full[d2t] = p_draft
                p_draft = full
            p_target = torch.softmax(target[b, k].double(), -1)
            inside = p_draft > 0  # KL over the drafting vocabulary
            kl += w * (p_target[inside] * (p_target[inside].log() - p_draft[inside].log())).sum().item()
            dist = (p_draft - p_target).abs().sum().item()
            if p_draft[labels[b, k]] > 0:
                ce += -w * math.log(p_draft[labels[b, k]].item())
            tv += w * dist
            if conf is not None:
                c = torch.sigmoid(conf[b, k].double()).item()
                soft = 1 - 0.5 * dist
                bce += -w * (soft * math.log(c) + (1 - soft) * math.log(1 - c))
    total = coef[0] * ce + coef[1] * tv + coef[2] * bce
    return total / blocks, ce / blocks, tv / blocks, bce / blocks, kl / blocks


def _inputs(n=5, g=4, vocab=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randn(n, g, vocab, generator=gen) * 2
    target = torch.randn(n, g, vocab, generator=gen) * 2
    labels = torch.randint(vocab, (n, g), generator=gen)
    valid = torch.ones(n, g, dtype=torch.bool)
    valid[1, 2:] = False  # a block cut by the end of its sequence
    valid[3] = False  # a padding block
    conf = torch.randn(n, g, generator=gen)
    return draft, target, labels, valid, conf


def test_block_loss_matches_the_reference_loop():
    draft, target, labels, valid, conf = _inputs()
    weights = position_weights(4)
    terms = block_loss(draft, target, labels, valid, weights, conf, coef=(0.1, 0.9, 1.0))
    total, ce, tv, bce, _ = _reference(draft, target, labels, valid, conf, weights, (0.1, 0.9, 1.0))
    for got, want in ((terms.total, total), (terms.ce, ce), (terms.tv, tv), (terms.conf, bce)):
        assert abs(got.item() - want) < 1e-4 * max(1.0, abs(want))


def test_reduced_vocabulary_counts_target_mass_outside_it():
    draft, target, labels, valid, _conf = _inputs(vocab=11)
    d2t = torch.tensor([0, 2, 3, 5, 7, 8])
    draft = draft[..., : len(d2t)]
    labels[0, 0] = 1  # outside the draft vocabulary: no CE term for it
    terms = block_loss(draft, target, labels, valid, position_weights(4), None, d2t, coef=(1.0, 1.0, 0.0))
    _total, ce, tv, _, _ = _reference(draft, target, labels, valid, None, None, (1.0, 1.0, 0.0), d2t)
    assert abs(terms.ce.item() - ce) < 1e-4 and abs(terms.tv.item() - tv) < 1e-4
    assert terms.conf.item() == 0.0


def test_vocabulary_columns_with_their_normaliser_equal_the_full_target_logits():
    """Training passes p^t as the drafting vocabulary's target logits + the log normaliser of all V."""
    draft, target, labels, valid, conf = _inputs(vocab=11)
    d2t = torch.tensor([0, 2, 3, 5, 7, 8])
    draft = draft[..., : len(d2t)]
    full = block_loss(draft, target, labels, valid, position_weights(4), conf, d2t)
    columns = block_loss(
        draft, target[..., d2t], labels, valid, position_weights(4), conf, d2t,
        target_log_norm=torch.logsumexp(target, -1),
    )  # fmt: skip
    for name in ("total", "ce", "tv", "conf", "accept"):
        torch.testing.assert_close(getattr(columns, name), getattr(full, name))


def test_gradients_flow_to_draft_and_confidence_but_not_through_the_soft_label():
    draft, target, labels, valid, conf = _inputs()
    draft.requires_grad_(True)
    conf.requires_grad_(True)
    terms = block_loss(draft, target, labels, valid, position_weights(4), conf, coef=(0.0, 0.0, 1.0))
    terms.total.backward()
    assert draft.grad.abs().sum() == 0  # the confidence label c* is detached from p^d
    assert conf.grad.abs().sum() > 0
    assert conf.grad[3].abs().sum() == 0  # padding block


def test_identical_distributions_have_zero_tv_and_full_acceptance():
    draft, _, labels, valid, _ = _inputs()
    terms = block_loss(draft, draft.clone(), labels, valid, position_weights(4), coef=(0.0, 1.0, 0.0))
    assert terms.tv.item() < 1e-5
    assert torch.allclose(terms.accept, torch.ones(4))


def test_position_weights_and_expected_tau():
    w = position_weights(7)
    assert w[0] == 1.0 and abs(w[6].item() - math.exp(-6 / 7)) < 1e-6
    assert abs(position_weights(7, decay=4.0)[4].item() - math.exp(-1.0)) < 1e-6
    assert expected_tau(torch.tensor([1.0, 1.0, 1.0])) == 4.0
    assert abs(expected_tau(torch.tensor([0.5, 0.5])) - 1.75) < 1e-9


def test_forward_kl_matches_the_reference_on_full_and_reduced_vocabularies():
    draft, target, labels, valid, _ = _inputs(vocab=11)
    terms = block_loss(draft, target, labels, valid, position_weights(4), coef=(0.0, 0.0, 0.0, 1.0))
    assert abs(terms.kl.item() - _reference(draft, target, labels, valid, None, None, (0, 0, 0))[4]) < 1e-4
    assert abs(terms.total.item() - terms.kl.item()) < 1e-6
    d2t = torch.tensor([0, 2, 3, 5, 7, 8])
    reduced = block_loss(
        draft[..., : len(d2t)],
        target,
        labels,
        valid,
        position_weights(4),
        None,
        d2t,
        coef=(0.0, 0.0, 0.0, 1.0),
    )
    want = _reference(draft[..., : len(d2t)], target, labels, valid, None, None, (0, 0, 0), d2t)[4]
    assert abs(reduced.kl.item() - want) < 1e-4
    off = block_loss(draft, target, labels, valid, position_weights(4), coef=(0.1, 0.9, 1.0))
    assert off.kl.item() == 0.0


def test_forward_kl_pushes_up_a_token_the_drafter_rates_low_where_tv_barely_does():
    """The reason for the KL term: TV's gradient on a logit scales with p^d of that token."""
    target = torch.tensor([[[0.0, 0.0, 0.0, 0.0]]])  # uniform p^t
    draft = torch.tensor([[[8.0, 0.0, 0.0, -8.0]]])  # token 3 at p^d ~ 1e-7
    labels, valid, weights = (
        torch.zeros(1, 1, dtype=torch.long),
        torch.ones(1, 1, dtype=torch.bool),
        torch.ones(1),
    )

    def pull(coef):
        logits = draft.clone().requires_grad_(True)
        block_loss(logits, target, labels, valid, weights, coef=coef).total.backward()
        return -logits.grad[0, 0, 3].item()  # descent raises token 3's logit by this much per unit lr

    kl_pull, tv_pull = pull((0.0, 0.0, 0.0, 1.0)), pull((0.0, 1.0, 0.0))
    assert kl_pull > 0.24  # p^t - p^d = 0.25
    assert 0 <= tv_pull < 1e-5
