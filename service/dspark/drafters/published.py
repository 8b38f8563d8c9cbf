"""Published drafter layouts translated into this project's: vLLM `speculators` EAGLE-3 configs and
weight names, and the checks that refuse what the drafters here cannot run.

- EAGLE-3 as the EAGLE authors publish it (`LlamaForCausalLMEagle3`, keys `midlayer.*`) and as
  SpecForge does (`Qwen3ForCausalLMEagle3`) need no renaming.
- `speculators` EAGLE-3 (`speculators_model_type: eagle3`): the layer's hyper-parameters sit in
  `transformer_layer_config`, the feature layers in `eagle_aux_hidden_state_layer_ids` (HF
  `hidden_states` indices, one above this project's decoder-layer ids), gamma in
  `speculators_config.proposal_methods[].speculative_tokens`, and the layer's keys are `layers.0.*`.
- z-lab DFlash (`DFlashDraftModel`) keys are DeepSpec's already.
"""

from __future__ import annotations

from typing import Any

import torch

SPECULATORS_LAYER_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Qwen3ForCausalLMEagle3"}


def is_speculators(raw: dict[str, Any]) -> bool:
    return raw.get("speculators_model_type") is not None


def flatten_speculators(raw: dict[str, Any]) -> dict[str, Any]:
    """A `speculators` config as the flat EAGLE-3 config it stands for (the layer's fields at the top).

    `norm_before_residual` defaults to true when absent, as vLLM reads these configs."""
    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise ValueError(
            f"speculators_model_type {kind!r} is not supported; of the speculators formats only eagle3 loads"
        )
    if raw.get("norm_before_fc"):
        raise ValueError("speculators EAGLE-3 with norm_before_fc (an input_norm before fc) is not supported")
    layer = dict(raw.get("transformer_layer_config") or {})
    model_type = layer.get("model_type", "llama")
    if model_type not in SPECULATORS_LAYER_ARCHITECTURES:
        raise ValueError(
            f"speculators EAGLE-3 transformer_layer_config.model_type {model_type!r} is not supported; "
            f"known: {sorted(SPECULATORS_LAYER_ARCHITECTURES)}"
        )
    flat = layer | {
        "architectures": [SPECULATORS_LAYER_ARCHITECTURES[model_type]],
        "norm_before_residual": bool(raw.get("norm_before_residual", True)),
    }
    for key in ("draft_vocab_size", "target_hidden_size"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = list(raw["eagle_aux_hidden_state_layer_ids"])
    if (tokens := _speculative_tokens(raw.get("speculators_config") or {})) is not None:
        flat["block_size"] = tokens
    return flat


def aux_to_decoder_layers(aux_ids: list[int]) -> tuple[int, ...]:
    """vLLM / SGLang / speculators `eagle_aux_hidden_state_layer_ids` index HF `hidden_states` (the
    input of decoder layer i, 0 = the embeddings); this project's `target_layer_ids` index decoder
    layer outputs, so aux id i is layer i - 1."""
    if min(aux_ids) < 1:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {aux_ids}: id 0 (the embedding output) is not a feature "
            "the engine hands to drafters"
        )
    return tuple(i - 1 for i in aux_ids)


def _speculative_tokens(spec: dict[str, Any]) -> int | None:
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    chosen = [m for m in methods if m.get("proposal_type") == default] or methods
    return chosen[0].get("speculative_tokens") if chosen else None


def eagle3_layer_refusals(raw: dict[str, Any]) -> list[str]:
    """What an EAGLE-3 config asks for that the one-layer drafter here cannot run."""
    problems = []
    if (layers := raw.get("num_hidden_layers", 1)) != 1:
        problems.append(f"num_hidden_layers {layers} (only one decoder layer, the midlayer, runs here)")
    if raw.get("mlp_bias"):
        problems.append("mlp_bias (the MLP has no biases here)")
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        problems.append("eagle_config.use_aux_hidden_state false (no fused target features)")
    return problems


def dflash_refusals(raw: dict[str, Any]) -> list[str]:
    """What a DFlash / DSpark config asks for that the backbone here cannot run."""
    problems = []
    sliding = [i for i, t in enumerate(raw.get("layer_types") or []) if t == "sliding_attention"]
    if raw.get("use_sliding_window") and sliding and raw.get("sliding_window"):
        problems.append(f"sliding-window attention in layers {sliding} (context is attended in full here)")
    if raw.get("mlp_bias"):
        problems.append("mlp_bias (the MLP has no biases here)")
    return problems


def dflash_default_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab DFlash's feature layers when `dflash_config` names none: spread over 1..N-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def project_state_dict(
    state: dict[str, torch.Tensor], kind: str, vocab_size: int, draft_vocab_size: int | None
) -> dict[str, torch.Tensor]:
    """Rename a published checkpoint's tensors to this project's keys.

    `speculators` / vLLM name the EAGLE-3 layer `layers.0`; this project (and the EAGLE authors)
    `midlayer`. A `d2t` / `t2d` over the whole vocabulary is the identity and is dropped."""
    if kind == "eagle3":
        state = {
            ("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
            for k, v in state.items()
        }
    if (draft_vocab_size or vocab_size) == vocab_size and "d2t" in state:
        if torch.count_nonzero(state["d2t"]):
            raise ValueError("d2t maps a full-size draft vocabulary onto other ids (not the identity)")
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    return state
