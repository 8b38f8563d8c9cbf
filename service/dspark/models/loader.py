"""Load an HF-format safetensors directory into the engine's own decoder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark.models.config import load_target_config
from dspark.models.packed_linear import can_pack, pack_linears
from dspark.models.pull import ModelError
from dspark.models.transformer import DecoderModel


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelError(f"{model_dir} has no model.safetensors (only safetensors checkpoints are supported)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(model_dir / name))
        except Exception as e:  # safetensors raises several error types for damaged files
            raise ModelError(f"cannot read {model_dir / name}: {e}") from e
    return state


# The runner's packed projections and the checkpoint tensors they are concatenated from.
PACKED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_names(key: str) -> list[str]:
    """The HF checkpoint tensor(s) behind one of the runner's parameters."""
    for packed, parts in PACKED_PROJECTIONS.items():
        if f".{packed}." in key:
            return [key.replace(packed, part) for part in parts]
    return [key]


def load_target_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    """Build the decoder for `model_dir` and load its weights, refusing mismatched checkpoints."""
    config = load_target_config(model_dir)
    with torch.device("meta"):
        model = DecoderModel(config)
    state = load_state_dict(model_dir)
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
    expected = list(model.state_dict())
    wanted = {name for key in expected for name in checkpoint_names(key)}
    missing = sorted(wanted - state.keys())
    unexpected = sorted(k for k in state.keys() - wanted if "rotary_emb" not in k)
    if missing or unexpected:
        raise ModelError(
            f"checkpoint in {model_dir} does not match its config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    state = {
        k: torch.cat([state[n] for n in checkpoint_names(k)]).to(dtype=dtype, device=device) for k in expected
    }
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if can_pack(device, dtype):
        pack_linears(model)
    return model.eval()
