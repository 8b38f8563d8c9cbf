"""Decoder-only transformer (Llama/SmolLM2, Qwen2, Qwen3) over a flattened ragged batch.

Linear layers run on all T new tokens of the batch at once; attention runs per request on
views of its KV slot, so cost grows with the tokens in the batch, not with padding.
Module and parameter names follow transformers, so HF checkpoints load without renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from dspark.models.config import head_dim
from dspark.models.cpu_attention import write_kv
from dspark.models.forward_batch import ForwardBatch, ShortGroup
from dspark.models.kv_cache import KVCache
from dspark.models.norm import RMSNorm
from dspark.models.rotary import RotaryEmbedding, apply_rotary
from dspark.models.sdpa import attention, without_cudnn_attention
from dspark.models.static_batch import PaddedBatch, attend_padded


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        # Qwen2 always has q/k/v biases and no output bias; Llama and Qwen3 follow attention_bias.
        attention_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        qkv_bias = config.model_type == "qwen2" or attention_bias
        d = config.hidden_size
        # q, k and v in one matmul (the loader packs the checkpoint's three projections).
        self.qkv_proj = nn.Linear(d, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=attention_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch | PaddedBatch | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """batch None: inside a compiled graph, where attention is one opaque op per layer that reads
        the batch bound by `compiled_forward.bind` (its Python metadata would guard every step)."""
        t, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qk, v = self.qkv_proj(x).split([(heads + kv_heads) * self.head_dim, kv_heads * self.head_dim], -1)
        qk, v = qk.view(t, heads + kv_heads, self.head_dim), v.view(t, kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), 1)
        # Queries and keys side by side: one rotation for both.
        q, k = apply_rotary(qk, cos, sin).split([heads, kv_heads], 1)
        if batch is None:
            out = torch.ops.dspark.attention(q, k, v, self.layer_idx)
        else:
            out = self.attend(q, k, v, batch, cache)
        return self.o_proj(out)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch | PaddedBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        """Write the new tokens' K/V into their slots, then attend: [T, H, hd] -> [T, H * hd]."""
        t = q.shape[0]
        k_cache, v_cache = cache.k[self.layer_idx], cache.v[self.layer_idx]
        decode = None if isinstance(batch, PaddedBatch) or batch.short is None else batch.short.decode
        if decode is not None:
            out = decode(q, k, v, k_cache, v_cache, batch.token_slots, batch.positions)
            if out is not None:
                return out
        # Indexed as [slot, position] over a transposed view: `cache[slots, :, positions] = k` (indices
        # around the head axis) is about 6x slower on the CPU, and the same one kernel on a GPU.
        where = (batch.token_slots, batch.positions)
        if isinstance(batch, PaddedBatch) or not write_kv(k_cache, v_cache, k, v, *where):
            k_cache.transpose(1, 2).index_put_(where, k)
            v_cache.transpose(1, 2).index_put_(where, v)

        if isinstance(batch, PaddedBatch):
            return attend_padded(q, k_cache, v_cache, batch).reshape(t, -1)
        if batch.short is not None and batch.short.covers_all:
            return _attend_short(q, k_cache, v_cache, batch.short).reshape(t, -1)
        out = torch.empty_like(q)
        if batch.short is not None:
            out[batch.short.tokens] = _attend_short(q, k_cache, v_cache, batch.short)
        for i in batch.long_rows:
            lo, hi, start = batch.offsets[i], batch.offsets[i + 1], batch.starts[i]
            end = start + batch.lengths[i]
            out[lo:hi] = attention(
                q[lo:hi].transpose(0, 1)[None],
                k_cache[batch.slots[i], :, :end][None],
                v_cache[batch.slots[i], :, :end][None],
                None if start == 0 else _causal_mask(start, hi - lo, q.device),
                is_causal=start == 0,
            )[0].transpose(0, 1)
        return out.reshape(t, -1)


def _attend_short(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: ShortGroup
) -> torch.Tensor:
    """Decode and verification rows: queries padded to [num_rows, n_max], one attention call."""
    if isinstance(g.slots, int):  # one request: no padding, and its cache prefix is a view
        keys, values = k_cache[g.slots, :, : g.max_len][None], v_cache[g.slots, :, : g.max_len][None]
        queries = q if g.covers_all else q[g.tokens]
        out = attention(queries.transpose(0, 1)[None], keys, values, g.mask)
        return out[0].transpose(0, 1)
    if g.dense:  # the requests in order, rows of equal length: nothing to scatter or gather back
        queries = q.view(g.num_rows, g.max_new, *q.shape[1:])
    else:
        queries = q.new_zeros(g.num_rows, g.max_new, *q.shape[1:])
        queries[g.rows, g.cols] = q[g.tokens]
    keys, values = k_cache[g.slots, :, : g.max_len], v_cache[g.slots, :, : g.max_len]  # a view for a slice
    out = attention(queries.transpose(1, 2), keys, values, g.mask).transpose(1, 2)
    return out.reshape(-1, *q.shape[1:]) if g.dense else out[g.rows, g.cols]


def _causal_mask(start: int, n: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, start + n]: query i (at position start + i) sees keys 0..start + i."""
    keys = torch.arange(start + n, device=device)
    return (keys[None, :] <= keys[start:, None])[None, None]


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x, cos, sin, batch: ForwardBatch | PaddedBatch | None, cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, V] float32 for batch.logit_rows
    layer_hidden: torch.Tensor | None  # [T, m * hidden]: outputs of the requested decoder layers


class _Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderModel(nn.Module):
    """The target model. `forward` writes the new tokens' K/V into their slots."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch | PaddedBatch,
        cache: KVCache,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        with without_cudnn_attention():
            logits, hidden = self.run(
                input_ids, batch.positions, batch.logit_rows, hidden_layers, batch, cache
            )
        return ForwardOutput(logits=logits, layer_hidden=hidden)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logit_rows: torch.Tensor | slice,
        hidden_layers: tuple[int, ...],
        batch: ForwardBatch | PaddedBatch | None,
        cache: KVCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [N, V] float32 of `logit_rows`, and the requested layers' outputs [T, m * hidden];
        with batch None, the body of a compiled graph (see `Attention.forward`)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        captured = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, batch, cache)
            if i in hidden_layers:
                captured.append(x)
        logits = self.lm_head(self.model.norm(x[logit_rows])).float()
        return logits, torch.cat(captured, dim=-1) if captured else None
