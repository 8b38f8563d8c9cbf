"""The DSpark / DFlash drafter network: a parallel backbone with KV injection plus DSpark's heads.

Context: the target's features of the chosen layers are fused, H_ctx = hidden_norm(fc(concat)),
and every draft layer projects them with its own k_proj / v_proj (+ k_norm, rotary at the
token's position). The block (anchor then mask tokens, positions P..) attends bidirectionally to
itself and to the context of all earlier positions. Module names follow DeepSpec's
`Qwen3DSparkModel` checkpoint keys, so its state dicts load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.drafters.config import DraftConfig
from dspark.drafters.draft_attention import DraftAttention
from dspark.drafters.draft_vocab import d2t_offsets, token_ids
from dspark.drafters.heads import ConfidenceHead, SequentialHead, make_sequential_head
from dspark.drafters.layers import make_mlp
from dspark.models.norm import RMSNorm
from dspark.models.rotary import RotaryEmbedding


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = make_mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_mask: torch.Tensor,
        num_outputs: int | None = None,
    ) -> torch.Tensor:
        """x [B, Q, d]; ctx_k/ctx_v [B, C, KVH, hd] (already rotated); ctx_mask [B, C] True = real.

        With `num_outputs`, only the first that many block positions are computed past the keys and
        values (which every position still contributes): [B, num_outputs, d]."""
        h = self.input_layernorm(x)
        k, v = self.self_attn.key_value(h, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)
        block_mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        mask = torch.cat([ctx_mask, block_mask], dim=1)[:, None, :]
        if num_outputs is not None:
            # Dense copies: F.linear on a row cut whose leading strides do not merge runs a bmm over
            # a broadcast copy of the weight (see `sample_block`).
            x, h = (t[:, :num_outputs].clone(memory_format=torch.contiguous_format) for t in (x, h))
            cos, sin = cos[:, :num_outputs], sin[:, :num_outputs]
        q = self.self_attn.query(h, cos, sin)
        x = x + self.self_attn.attend(q, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkModel(nn.Module):
    """Backbone + optional sequential head + optional confidence head (DFlash = no sequential head)."""

    shared_keys = ("embed_tokens.weight", "lm_head.weight")  # frozen copies of the target's

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        if config.kind not in ("dspark", "dflash"):
            raise ValueError(f"DSparkModel cannot build a {config.kind} drafter")
        self.config = config
        lc = config.layers
        d, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(vocab, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, d, bias=False)
        self.hidden_norm = RMSNorm(d, lc.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(lc) for _ in range(lc.num_hidden_layers))
        self.norm = RMSNorm(d, lc.rms_norm_eps)
        self.markov_head: SequentialHead | None = None
        if config.markov_head_type is not None:
            rows = config.draft_vocab_size if config.markov_draft_vocab else None
            self.markov_head = make_sequential_head(
                config.markov_head_type, d, vocab, config.markov_rank, rows
            )
        self.confidence_head: ConfidenceHead | None = None
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(
                d, config.markov_rank if config.confidence_with_markov else 0
            )
        if config.draft_vocab_size and config.draft_vocab_size < vocab:
            # Drafting samples from these rows of the head only (target id = index + d2t[index]).
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.rotary = RotaryEmbedding(lc)
        attn = self.layers[0].self_attn
        self.kv_shape = (len(self.layers), 2, attn.num_kv_heads, attn.head_dim)

    @property
    def block_len(self) -> int:
        """Input tokens per block: DSpark's anchor predicts too; DFlash's anchor only conditions."""
        return self.config.gamma if self.config.anchor_predicts else self.config.gamma + 1

    def draft_token_ids(self) -> torch.Tensor | None:
        """Sorted target ids of the reduced drafting vocabulary; None drafts over the whole one."""
        return token_ids(self.d2t)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target features [..., N, m*hidden] at positions [..., N] -> per-layer K/V [..., N, L, 2, KVH, hd]."""
        h = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(positions, h.dtype)
        per_layer = [torch.stack(layer.self_attn.key_value(h, cos, sin), dim=-3) for layer in self.layers]
        return torch.stack(per_layer, dim=-4)

    def block_input_ids(self, anchor: torch.Tensor) -> torch.Tensor:
        """anchor [B] -> [B, block_len]: the anchor followed by mask tokens."""
        ids = torch.full(
            (anchor.shape[0], self.block_len),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor.device,
        )
        ids[:, 0] = anchor
        return ids

    def block_hidden(
        self,
        anchor: torch.Tensor,
        anchor_pos: torch.Tensor,
        ctx_kv: torch.Tensor,
        ctx_mask: torch.Tensor,
        horizon: int | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, horizon or gamma, d] (after the final norm) of the first predicting
        block positions.

        anchor, anchor_pos [B]; ctx_kv [B, C, L, 2, KVH, hd] from `context_kv`; ctx_mask [B, C].
        The block attends bidirectionally, so every position runs through every layer but the
        last, whose outputs past the horizon nothing reads.
        """
        x = self.embed_tokens(self.block_input_ids(anchor))
        pos = anchor_pos[:, None] + torch.arange(self.block_len, device=anchor.device)
        cos, sin = self.rotary(pos, x.dtype)
        skip = 0 if self.config.anchor_predicts else 1
        outputs = None if horizon is None or skip + horizon >= self.block_len else skip + horizon
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            n = outputs if i == last else None
            x = layer(x, cos, sin, ctx_kv[:, :, i, 0], ctx_kv[:, :, i, 1], ctx_mask, num_outputs=n)
        return self.norm(x)[:, skip:]

    def forward(self, features: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Reference single-shot pass: features [B, P, m*hidden] of positions 0..P-1, anchor [B] at P."""
        batch, ctx_len = features.shape[:2]
        pos = torch.arange(ctx_len, device=features.device).expand(batch, ctx_len)
        ctx_kv = self.context_kv(features, pos)
        mask = torch.ones(batch, ctx_len, dtype=torch.bool, device=features.device)
        return self.block_hidden(anchor, torch.full_like(anchor, ctx_len), ctx_kv, mask)

    def teacher_forced(
        self, hidden: torch.Tensor, anchor: torch.Tensor, tokens: torch.Tensor, draft_rows: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [B, G, V] (base + sequential bias) and confidence logits [B, G] for a known block
        `tokens` [B, G]; position k conditions on tokens[k-1] (the anchor for k = 1). With
        `draft_rows`, logits [B, G, Vd] over the drafting vocabulary only, what drafting samples from."""
        ids = self.draft_token_ids() if draft_rows else None
        logits = self.lm_head(hidden) if ids is None else F.linear(hidden, self.lm_head.weight[ids])
        prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
        emb = None
        if self.markov_head is not None:
            bias, emb = self.markov_head.teacher_forced(hidden, prev)
            bias = bias.to(logits.dtype)
            if ids is not None:
                logits = logits + (bias if self.config.markov_draft_vocab else bias[..., ids])
            elif self.config.markov_draft_vocab:
                logits = logits.index_add(-1, self.draft_token_ids(), bias)
            else:
                logits = logits + bias
        conf = self.confidence_head(hidden, emb) if self.confidence_head is not None else None
        return logits, conf


def restrict_draft_vocabulary(model: DSparkModel, token_ids: torch.Tensor) -> DSparkModel:
    """Make `model` draft over `token_ids` only (e.g. the most frequent response tokens), in place;
    saved as `draft_vocab_size` + `d2t` like EAGLE-3's reduced vocabulary. `dspark train` restricts
    before training, so that it fits the distribution drafting samples from (a Markov head over the
    drafting vocabulary must be given the one it has)."""
    ids = torch.unique(token_ids.long().cpu())  # sorted, distinct
    if not 0 < ids.numel() <= model.config.vocab_size or int(ids[-1]) >= model.config.vocab_size:
        raise ValueError(f"a drafting vocabulary needs 1..{model.config.vocab_size} ids below the vocab size")
    if model.config.markov_draft_vocab:
        if not torch.equal(ids, model.draft_token_ids().cpu()):
            raise ValueError("this drafter's Markov head was trained over its own drafting vocabulary")
        return model
    device = model.fc.weight.device
    del model.d2t  # the None attribute or an earlier vocabulary's buffer
    model.register_buffer("d2t", d2t_offsets(ids).to(device))
    raw = {**model.config.raw, "draft_vocab_size": ids.numel()}
    model.config = model.config.model_copy(update={"draft_vocab_size": ids.numel(), "raw": raw})
    return model
