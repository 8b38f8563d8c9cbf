"""Training forwards over packed blocks, built from the inference modules' own pieces.

`dspark_block_logits` runs the DSpark / DFlash backbone for every packed block at once (the
context K/V of each sequence computed once, queries masked by `block_attention_mask`), then the
teacher-forced heads. `eagle3_block_logits` runs EAGLE-3 with training-time test: one causal pass
over each sequence's context entries (step 1 of every anchor), then gamma-1 steps that feed the
layer's own output back, each step's queries seeing the context entries before their anchor and
their own earlier steps - the same computation `Eagle3Drafter.propose` does at inference.
"""

from __future__ import annotations

import torch
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.eagle3_model import Eagle3Model
from dspark.training.packing import PackedBatch, block_attention_mask


def dspark_block_logits(
    model: DSparkModel, batch: PackedBatch, draft_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft logits [S*A, G, V] ([S*A, G, Vd] over the drafting vocabulary with `draft_rows`) and
    confidence logits [S*A, G] (or None)."""
    n_seq, n_anchor, gamma = batch.valid.shape
    width, device = batch.ctx_features.shape[1], batch.valid.device
    ctx_pos = torch.arange(width, device=device).expand(n_seq, width)
    ctx_kv = model.context_kv(batch.ctx_features, ctx_pos)  # [S, C, L, 2, KVH, hd]
    ids = torch.full((n_seq, n_anchor, gamma), model.config.mask_token_id, dtype=torch.long, device=device)
    ids[:, :, 0] = batch.anchor_tokens
    x = model.embed_tokens(ids.flatten(1))
    pos = (batch.anchor_pos[:, :, None] + torch.arange(gamma, device=device)).flatten(1)
    cos, sin = model.rotary(pos, x.dtype)
    mask = block_attention_mask(batch)
    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        q = layer.self_attn.query(h, cos, sin)
        k, v = layer.self_attn.key_value(h, cos, sin)
        keys = torch.cat([ctx_kv[:, :, i, 0].to(k.dtype), k], dim=1)
        values = torch.cat([ctx_kv[:, :, i, 1].to(v.dtype), v], dim=1)
        x = x + layer.self_attn.attend(q, keys, values, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = model.norm(x).reshape(n_seq * n_anchor, gamma, -1)
    anchors = batch.anchor_tokens.reshape(-1)
    return model.teacher_forced(
        hidden, anchors, batch.labels.reshape(n_seq * n_anchor, gamma), draft_rows=draft_rows
    )


def eagle3_block_logits(model: Eagle3Model, batch: PackedBatch) -> torch.Tensor:
    """Draft logits [S*A, G, V'] over the drafter's own (possibly reduced) vocabulary."""
    n_seq, n_anchor, gamma = batch.valid.shape
    width, device = batch.ctx_features.shape[1], batch.valid.device
    rows = torch.arange(n_seq, device=device)[:, None]
    pos = torch.arange(width, device=device).expand(n_seq, width)
    fused = model.fuse(batch.ctx_features)
    q, ctx_k, ctx_v = model.entry_qkv(batch.ctx_tokens[:, 1:], fused, pos)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(n_seq, width, width)
    entries = model.entry_output(fused, q, ctx_k, ctx_v, causal)  # [S, C, d]
    last_entry = (batch.anchor_pos - 1).clamp(min=0)
    hidden = entries[rows, last_entry]  # [S, A, d]: step 1 (entry P-1 pairs feature P-1 with the anchor)
    ctx_mask = torch.arange(width, device=device)[None, None, :] < batch.anchor_pos[:, :, None]  # [S, A, C]
    own = torch.eye(n_anchor, dtype=torch.bool, device=device).expand(n_seq, n_anchor, n_anchor)
    logits = [_draft_logits(model, hidden)]
    step_k, step_v = [], []
    for step in range(1, gamma):
        step_pos = last_entry + step
        tokens = batch.labels[:, :, step - 1]  # teacher forcing: the true previous token
        q, k, v = model.entry_qkv(tokens, hidden, step_pos)
        step_k.append(k)
        step_v.append(v)
        keys = torch.cat([ctx_k, *step_k], dim=1)
        values = torch.cat([ctx_v, *step_v], dim=1)
        mask = torch.cat([ctx_mask, *([own] * step)], dim=-1)
        hidden = model.entry_output(hidden, q, keys, values, mask)
        logits.append(_draft_logits(model, hidden))
    return torch.stack(logits, dim=2).reshape(n_seq * n_anchor, gamma, -1)


def _draft_logits(model: Eagle3Model, out: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.norm(out))
