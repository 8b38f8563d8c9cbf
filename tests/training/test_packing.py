"""Anchor-bounded packing: anchors, targets, the token-level mask, and packed forwards that equal
the drafters' own single-block reference passes."""

from __future__ import annotations

import torch
from dspark.drafters.config import DraftConfig
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.eagle3_model import Eagle3Model
from dspark.training.build import drafter_raw_config
from dspark.training.config import DrafterSpec
from dspark.training.features import Sequence, add_log_normalizers
from dspark.training.forward import dspark_block_logits, eagle3_block_logits
from dspark.training.losses import block_loss, position_weights
from dspark.training.packing import block_attention_mask, pack, sample_anchors

TARGET = {
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "vocab_size": 40,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 128,
}


def _sequence(length: int, prompt: int, seed: int) -> Sequence:
    g = torch.Generator().manual_seed(seed)
    return Sequence(
        torch.randint(1, 40, (length,), generator=g),
        torch.randn(length, 32, generator=g),
        torch.randn(length, 16, generator=g),
        prompt,
        0,
    )


def test_anchors_lie_in_the_response_and_leave_a_target():
    seq = _sequence(20, 8, 0)
    anchors = sample_anchors(seq, 5, torch.Generator().manual_seed(1))
    assert len(anchors) == 5 and len(set(anchors.tolist())) == 5
    assert anchors.min() >= 8 and anchors.max() <= 18
    assert sample_anchors(_sequence(9, 8, 0), 5, torch.Generator()).numel() == 0
    assert sample_anchors(_sequence(12, 8, 0), 5, torch.Generator()).tolist() == [8, 9, 10]


def test_pack_targets_and_validity():
    seqs = [_sequence(20, 8, 0), _sequence(14, 10, 1)]
    batch = pack(seqs, 4, 3, torch.Generator().manual_seed(0))
    for s, seq in enumerate(seqs):
        for a in range(4):
            p = int(batch.anchor_pos[s, a])
            if not batch.valid[s, a].any():
                continue
            assert batch.anchor_tokens[s, a] == seq.tokens[p]
            for k in range(3):
                ok = p + 1 + k < len(seq.tokens)
                assert bool(batch.valid[s, a, k]) == ok
                if ok:
                    assert batch.labels[s, a, k] == seq.tokens[p + 1 + k]
                    assert torch.equal(batch.target_last[s, a, k], seq.last[p + k])
        assert int(batch.ctx_len[s]) == int(batch.anchor_pos[s].max())
    # the short sequence (anchors 10..12) has a block cut by the end of the sequence
    assert not batch.valid[1].all()


def test_log_normalizers_cover_the_response_and_are_packed_beside_their_targets():
    seqs = [_sequence(20, 8, 0), _sequence(14, 10, 1)]
    head = torch.randn(40, 16, generator=torch.Generator().manual_seed(2))
    add_log_normalizers(seqs, head, torch.device("cpu"), progress=False)
    for seq in seqs:
        want = torch.logsumexp(seq.last @ head.T, -1)
        torch.testing.assert_close(seq.log_norm[seq.prompt_len - 1 :], want[seq.prompt_len - 1 :])
    batch = pack(seqs, 4, 3, torch.Generator().manual_seed(0))
    for s, seq in enumerate(seqs):
        for a in range(4):
            p = int(batch.anchor_pos[s, a])
            for k in range(3):
                if batch.valid[s, a, k]:
                    assert batch.target_log_norm[s, a, k] == seq.log_norm[p + k]
    assert pack([_sequence(20, 8, 0)], 4, 3, torch.Generator()).target_log_norm is None


def test_mask_sees_context_before_the_anchor_and_the_own_block_only():
    batch = pack([_sequence(20, 8, 0)], 3, 2, torch.Generator().manual_seed(0))
    mask = block_attention_mask(batch)[0]
    width = batch.ctx_features.shape[1]
    for q in range(6):
        a = q // 2
        p = int(batch.anchor_pos[0, a])
        assert mask[q, :width].tolist() == [c < p for c in range(width)]
        assert mask[q, width:].tolist() == [k // 2 == a for k in range(6)]


def _dspark(kind: str) -> DSparkModel:
    spec = DrafterSpec(kind=kind, num_layers=2, block_size=3, markov_rank=4)
    torch.manual_seed(0)
    model = DSparkModel(DraftConfig.from_dict(drafter_raw_config(spec, TARGET, (0, 2), 0)))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def test_packed_dspark_forward_equals_the_single_block_reference():
    model = _dspark("dspark")
    seqs = [_sequence(20, 6, 0), _sequence(15, 5, 1)]
    batch = pack(seqs, 3, 3, torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, conf = dspark_block_logits(model, batch)
        for s, seq in enumerate(seqs):
            for a in range(3):
                p = int(batch.anchor_pos[s, a])
                hidden = model(seq.features[None, :p], seq.tokens[p : p + 1])
                want, want_conf = model.teacher_forced(
                    hidden, seq.tokens[p : p + 1], batch.labels[s, a][None]
                )
                torch.testing.assert_close(logits[s * 3 + a], want[0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(conf[s * 3 + a], want_conf[0], atol=1e-4, rtol=1e-4)


def test_packed_eagle3_steps_equal_a_sequential_reference():
    spec = DrafterSpec(kind="eagle3", block_size=3)
    torch.manual_seed(0)
    model = Eagle3Model(DraftConfig.from_dict(drafter_raw_config(spec, TARGET, (0, 2), 0)))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.eval()
    seqs = [_sequence(20, 6, 0), _sequence(16, 5, 1)]
    batch = pack(seqs, 3, 3, torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = eagle3_block_logits(model, batch)
        for s, seq in enumerate(seqs):
            for a in range(3):
                p = int(batch.anchor_pos[s, a])
                # context entries 0..p-1 (token i+1 with feature i), causal - as the adapter caches them
                out = model(seq.features[None, :p], seq.tokens[None, 1 : p + 1])
                hidden = out[:, -1]
                fused = model.fuse(seq.features[None, :p])
                _, ks, vs = model.entry_qkv(seq.tokens[None, 1 : p + 1], fused, torch.arange(p)[None])
                want = [model.lm_head(model.norm(hidden))]
                for step in range(1, 3):
                    tok = batch.labels[s, a, step - 1].view(1, 1)
                    q, k, v = model.entry_qkv(tok, hidden[:, None], torch.tensor([[p - 1 + step]]))
                    ks, vs = torch.cat([ks, k], 1), torch.cat([vs, v], 1)
                    mask = torch.ones(1, 1, ks.shape[1], dtype=torch.bool)
                    hidden = model.entry_output(hidden[:, None], q, ks, vs, mask)[:, 0]
                    want.append(model.lm_head(model.norm(hidden)))
                torch.testing.assert_close(logits[s * 3 + a], torch.cat(want), atol=1e-4, rtol=1e-4)


def test_packed_forwards_and_the_loss_stay_on_the_batch_device():
    """Every tensor the training forwards make lives on the batch's device: on "meta" (standing in
    for CUDA) a tensor made on the CPU would raise."""
    meta = torch.device("meta")
    batch = pack([_sequence(20, 6, 0), _sequence(15, 5, 1)], 3, 3, torch.Generator().manual_seed(2)).to(meta)
    assert batch.anchor_pos.device == meta and batch.target_last.device == meta
    logits, conf = dspark_block_logits(_dspark("dspark").to(meta), batch, draft_rows=True)
    assert logits.device == meta and logits.shape == (6, 3, 40) and conf.shape == (6, 3)
    eagle = Eagle3Model(
        DraftConfig.from_dict(drafter_raw_config(DrafterSpec(kind="eagle3", block_size=3), TARGET, (0, 2), 0))
    )
    assert eagle3_block_logits(eagle.to(meta), batch).device == meta
    d2t = torch.arange(0, 40, 2, device=meta)
    terms = block_loss(
        logits[..., :20],
        logits,
        batch.labels.reshape(6, 3),
        batch.valid.reshape(6, 3),
        position_weights(3, device=meta),
        conf.reshape(6, 3),
        d2t,
    )
    assert terms.total.device == meta
