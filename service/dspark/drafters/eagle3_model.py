"""EAGLE-3 style autoregressive drafter: one decoder layer over [embedding ; fused target features].

Checkpoint layout (the EAGLE authors' / SpecForge one; `speculators` configs and `layers.0.*` keys
are translated by `published.py`): config.json with `architectures` `LlamaForCausalLMEagle3` (Llama
layer, no q/k norm), `Qwen3ForCausalLMEagle3` or this project's `Eagle3DraftModel` (both Qwen3
layers with q_norm / k_norm), `target_layer_ids` (or `eagle_aux_hidden_state_layer_ids`), optional
`draft_vocab_size`, `norm_before_residual`; weights `fc` (m*hidden -> hidden),
`midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}`, `midlayer.self_attn.{q,k,v}_proj`
(2*hidden -> ...), `o_proj`, `midlayer.mlp.*`, `norm`, `lm_head` (draft vocabulary), optional `d2t`
(draft id -> target id offset) / `t2d`, optional `embed_tokens`.

Position i of the draft sequence pairs the embedding of token i+1 with the target's fused feature
of token i and predicts token i+2; later draft steps feed the layer's own output back in place of
the target feature.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.drafters.config import DraftConfig
from dspark.drafters.draft_attention import DraftAttention
from dspark.drafters.draft_vocab import token_ids
from dspark.drafters.layers import make_mlp
from dspark.models.norm import RMSNorm
from dspark.models.rotary import RotaryEmbedding


class Eagle3Layer(nn.Module):
    def __init__(self, config, qk_norm: bool, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        d = config.hidden_size
        self.self_attn = DraftAttention(config, input_size=2 * d, qk_norm=qk_norm)
        self.mlp = make_mlp(config)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual over the incoming hidden state (normed first with `norm_before_residual`), then
        the MLP block (pre-norm output)."""
        x = (self.hidden_norm(hidden) if self.norm_before_residual else hidden) + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Model(nn.Module):
    shared_keys = ("embed_tokens.weight",)  # the LM head is EAGLE-3's own (trained, maybe reduced vocab)

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        if config.kind != "eagle3":
            raise ValueError(f"Eagle3Model cannot build a {config.kind} drafter")
        self.config = config
        lc = config.layers
        d, vocab = config.hidden_size, config.vocab_size
        draft_vocab = config.draft_vocab_size or vocab
        self.embed_tokens = nn.Embedding(vocab, d)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, d, bias=False)
        self.midlayer = Eagle3Layer(
            lc, qk_norm=config.qk_norm, norm_before_residual=config.norm_before_residual
        )
        self.norm = RMSNorm(d, lc.rms_norm_eps)
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        if draft_vocab != vocab:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        else:
            self.d2t = None
        self.rotary = RotaryEmbedding(lc)
        attn = self.midlayer.self_attn
        self.kv_shape = (1, 2, attn.num_kv_heads, attn.head_dim)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., m*hidden] -> fused hidden [..., d]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def entry_qkv(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and K/V [B, S, heads, hd] of new sequence entries (token i+1, hidden of i) at positions."""
        x = self.midlayer.attention_input(self.embed_tokens(token_ids), hidden)
        cos, sin = self.rotary(positions, x.dtype)
        q = self.midlayer.self_attn.query(x, cos, sin)
        k, v = self.midlayer.self_attn.key_value(x, cos, sin)
        return q, k, v

    def entry_output(
        self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Layer output (pre-norm, fed back as the next step's hidden) given all keys/values and the mask."""
        return self.midlayer.finish(hidden, self.midlayer.self_attn.attend(q, k, v, mask))

    def draft_token_ids(self) -> torch.Tensor | None:
        """Target ids of the head's rows (reduced vocabulary); None when the head is the whole one."""
        return token_ids(self.d2t)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits [..., Vd] over the head's own vocabulary (`draft_token_ids`)."""
        return self.lm_head(self.norm(out))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits [..., V]; tokens outside a reduced draft vocabulary get -inf."""
        draft = self.draft_logits(out)
        ids = self.draft_token_ids()
        if ids is None:
            return draft
        full = draft.new_full((*draft.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, ids, draft)

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Reference causal pass over a whole sequence: features [B, P, m*h] of tokens 0..P-1 and
        next_ids [B, P] = tokens 1..P; returns the layer outputs [B, P, d] (position i predicts i+2)."""
        batch, length = next_ids.shape
        pos = torch.arange(length, device=next_ids.device).expand(batch, length)
        hidden = self.fuse(features)
        q, k, v = self.entry_qkv(next_ids, hidden, pos)
        causal = torch.ones(length, length, dtype=torch.bool, device=next_ids.device).tril()
        return self.entry_output(hidden, q, k, v, causal.expand(batch, length, length))
