"""Build a fresh drafter (config.json content + network) for a target from a `DrafterSpec`."""

from __future__ import annotations

from collections import Counter

import torch
from dspark.drafters.checkpoint import build_model
from dspark.drafters.config import DraftConfig
from dspark.drafters.draft_vocab import d2t_offsets
from dspark.drafters.dspark_model import DSparkModel, restrict_draft_vocabulary
from dspark.drafters.eagle3_model import Eagle3Model
from dspark.training.config import DrafterSpec
from torch import nn

_LAYER_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
)


def drafter_raw_config(
    spec: DrafterSpec,
    target: dict,
    target_layer_ids: tuple[int, ...],
    mask_token_id: int,
) -> dict:
    """config.json of a new drafter whose layers have the target's width, heads and rope."""
    raw = {k: target[k] for k in _LAYER_KEYS if k in target}
    raw.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    raw.update(
        model_type="qwen3",
        intermediate_size=spec.intermediate_size or target["intermediate_size"],
        num_hidden_layers=spec.num_layers,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        block_size=spec.block_size,
        target_layer_ids=list(target_layer_ids),
        num_target_layers=target["num_hidden_layers"],
        target_hidden_size=target["hidden_size"],
    )
    if spec.kind == "eagle3":
        raw["architectures"] = ["Eagle3DraftModel"]
        raw["num_hidden_layers"] = 1
        if spec.draft_vocab_size and spec.draft_vocab_size < target["vocab_size"]:
            raw["draft_vocab_size"] = spec.draft_vocab_size
        return raw
    raw["architectures"] = ["Qwen3DSparkModel"]
    raw["mask_token_id"] = mask_token_id
    if spec.kind == "dspark":
        raw.update(
            markov_head_type=spec.markov_head_type,
            markov_rank=spec.markov_rank,
            enable_confidence_head=spec.confidence_head,
            confidence_head_with_markov=spec.confidence_head,
        )
        if spec.markov_vocab == "draft":
            raw.update(draft_vocab_size=spec.draft_vocab_size, markov_over_draft_vocab=True)
    else:
        raw["enable_confidence_head"] = False
    return raw


def draft_vocabulary(token_counts: Counter, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties by id), sorted: EAGLE-3's reduced vocabulary."""
    ranked = sorted(range(vocab_size), key=lambda t: (-token_counts.get(t, 0), t))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def new_drafter(
    raw: dict,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    target_state: dict[str, torch.Tensor] | None = None,
    init_layers: tuple[int, ...] | None = None,
    draft_vocab: torch.Tensor | None = None,
    seed: int = 0,
) -> DSparkModel | Eagle3Model:
    """A randomly initialised drafter with the target's embedding / LM head (frozen) and, where
    asked, weights copied from target decoder layers (HF Llama/Qwen key names). With `draft_vocab`
    it drafts over those ids only, so training fits the distribution drafting samples from."""
    torch.manual_seed(seed)
    config = DraftConfig.from_dict(raw)
    model = build_model(config)
    model.embed_tokens.weight = nn.Parameter(embed.detach().clone(), requires_grad=False)
    if isinstance(model, DSparkModel):
        model.lm_head.weight = nn.Parameter(lm_head.detach().clone(), requires_grad=False)
        head = model.markov_head
        if head is not None:
            nn.init.zeros_(head.markov_w2.weight)  # the head starts as B = 0 (plain DFlash)
            nn.init.normal_(head.markov_w1.weight, std=0.02)
            if head.t2d is not None:
                with torch.no_grad():
                    head.markov_w1.weight[-1].zero_()  # the row of tokens outside the drafting vocabulary
                    model.d2t.copy_(d2t_offsets(draft_vocab))
                    head.set_rows(draft_vocab)
        if draft_vocab is not None and model.d2t is None:
            restrict_draft_vocabulary(model, draft_vocab)
    else:
        vocab = draft_vocab if draft_vocab is not None else torch.arange(config.vocab_size)
        with torch.no_grad():
            model.lm_head.weight.copy_(lm_head[vocab])  # start from the target's head rows
            if model.d2t is not None:
                model.d2t.copy_(d2t_offsets(vocab))
                model.t2d.zero_()
                model.t2d[vocab] = True
    if target_state is not None:
        _copy_target_weights(model, target_state, init_layers or ())
    return model


def _copy_target_weights(model: nn.Module, state: dict[str, torch.Tensor], layers: tuple[int, ...]) -> None:
    """Final norm and, per draft layer, the target layer's tensors whose shapes fit."""
    own = model.state_dict()
    copies = {"norm.weight": "model.norm.weight"}
    prefixes = (
        [(f"layers.{i}.", f"model.layers.{layer}.") for i, layer in enumerate(layers[: len(model.layers)])]
        if isinstance(model, DSparkModel)
        else [("midlayer.", f"model.layers.{layers[0]}.")]
        if layers
        else []
    )
    for mine, theirs in prefixes:
        for key in own:
            if key.startswith(mine):
                copies[key] = theirs + key[len(mine) :]
    with torch.no_grad():
        for mine, theirs in copies.items():
            if theirs in state and state[theirs].shape == own[mine].shape:
                own[mine].copy_(state[theirs])
