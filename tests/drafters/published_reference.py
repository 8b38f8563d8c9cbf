"""The published drafters' forward passes, written out in plain torch from their authors' code
(EAGLE-3: the EAGLE repo / vLLM `llama_eagle3.py` / speculators `Eagle3FirstLayerMixin`; DFlash:
z-lab `DFlashDraftModel`), over their own checkpoint keys. Independent of `dspark.drafters`, so a
drafter loaded from a published layout can be checked against what its authors compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [S, heads, hd] rotated at positions [S] (HF `apply_rotary_pos_emb`, default rope)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    freqs = positions[:, None].float() * inv_freq
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    rotated = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [S, H, hd], k/v [T, KVH, hd] (HF repeat_kv), mask [S, T] True = attend -> [S, H * hd]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("shd,thd->hst", q, k) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hst,thd->shd", scores.softmax(-1), v).flatten(1)


def mlp(sd: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ sd[f"{p}mlp.gate_proj.weight"].T, x @ sd[f"{p}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ sd[f"{p}mlp.down_proj.weight"].T


def eagle3_layer(
    sd: dict[str, torch.Tensor],
    p: str,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    cfg: dict,
    norm_before_residual: bool,
) -> torch.Tensor:
    """The EAGLE-3 decoder layer (prefix p: `midlayer.` or `layers.0.`) over a causal sequence of
    entries: embeds [S, d] of tokens i+1, hidden [S, d] (fc output or fed-back layer output)."""
    eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    normed = rms(hidden, sd[f"{p}hidden_norm.weight"], eps)
    residual = normed if norm_before_residual else hidden
    x = torch.cat([rms(embeds, sd[f"{p}input_layernorm.weight"], eps), normed], -1)
    q = (x @ sd[f"{p}self_attn.q_proj.weight"].T).unflatten(-1, (heads, hd))
    k = (x @ sd[f"{p}self_attn.k_proj.weight"].T).unflatten(-1, (kv_heads, hd))
    v = (x @ sd[f"{p}self_attn.v_proj.weight"].T).unflatten(-1, (kv_heads, hd))
    if f"{p}self_attn.q_norm.weight" in sd:
        q, k = rms(q, sd[f"{p}self_attn.q_norm.weight"], eps), rms(k, sd[f"{p}self_attn.k_norm.weight"], eps)
    pos, theta = torch.arange(x.shape[0]), _theta(cfg)
    causal = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).tril()
    attn = attention(rope(q, pos, theta), rope(k, pos, theta), v, causal)
    out = residual + attn @ sd[f"{p}self_attn.o_proj.weight"].T
    return out + mlp(sd, p, rms(out, sd[f"{p}post_attention_layernorm.weight"], eps))


def eagle3_logits(sd: dict[str, torch.Tensor], out: torch.Tensor, cfg: dict, vocab: int) -> torch.Tensor:
    """Target-vocabulary logits: draft row i is target id i + d2t[i] (vLLM `compute_logits`)."""
    draft = rms(out, sd["norm.weight"], cfg["rms_norm_eps"]) @ sd["lm_head.weight"].T
    if draft.shape[-1] == vocab:
        return draft
    full = draft.new_full((*draft.shape[:-1], vocab), float("-inf"))
    full[..., torch.arange(draft.shape[-1]) + sd["d2t"]] = draft
    return full


def eagle3_greedy_round(
    sd: dict[str, torch.Tensor],
    p: str,
    cfg: dict,
    embed: torch.Tensor,
    features: torch.Tensor,
    tokens: list[int],
    gamma: int,
    norm_before_residual: bool,
) -> tuple[list[int], torch.Tensor]:
    """Greedy draft tokens after `tokens` (features [P, m*h] of tokens[:-1]), recomputed from scratch
    each step as the EAGLE authors' `topK_genrate` chain does for one branch, and the first logits."""
    hidden = features @ sd["fc.weight"].T
    ids = torch.tensor(tokens[1:])
    drafted, first = [], None
    for _ in range(gamma):
        out = eagle3_layer(sd, p, embed[ids], hidden, cfg, norm_before_residual)
        logits = eagle3_logits(sd, out[-1], cfg, embed.shape[0])
        first = logits if first is None else first
        token = logits.argmax(-1)
        drafted.append(int(token))
        ids, hidden = torch.cat([ids, token[None]]), torch.cat([hidden, out[-1:]])
    return drafted, first


def dflash_block_logits(
    sd: dict[str, torch.Tensor],
    cfg: dict,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    features: torch.Tensor,
    anchor: int,
) -> torch.Tensor:
    """z-lab `spec_generate`'s draft logits [block_size - 1, V] for one block: anchor + masks at
    positions P.., attending to the context of positions 0..P-1 and to the whole block."""
    eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, theta = cfg["head_dim"], _theta(cfg)
    block, mask_id = cfg["block_size"], cfg["dflash_config"]["mask_token_id"]
    ctx = rms(features @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    n_ctx = ctx.shape[0]
    x = embed[torch.tensor([anchor] + [mask_id] * (block - 1))]
    pos = torch.arange(n_ctx + block)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, sd[f"{p}input_layernorm.weight"], eps)
        q = (h @ sd[f"{p}self_attn.q_proj.weight"].T).unflatten(-1, (heads, hd))
        k = (torch.cat([ctx, h]) @ sd[f"{p}self_attn.k_proj.weight"].T).unflatten(-1, (kv_heads, hd))
        v = (torch.cat([ctx, h]) @ sd[f"{p}self_attn.v_proj.weight"].T).unflatten(-1, (kv_heads, hd))
        q = rope(rms(q, sd[f"{p}self_attn.q_norm.weight"], eps), pos[n_ctx:], theta)
        k = rope(rms(k, sd[f"{p}self_attn.k_norm.weight"], eps), pos, theta)
        x = x + attention(q, k, v, None) @ sd[f"{p}self_attn.o_proj.weight"].T
        x = x + mlp(sd, p, rms(x, sd[f"{p}post_attention_layernorm.weight"], eps))
    return rms(x, sd["norm.weight"], eps)[1:] @ lm_head.T


def _theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
