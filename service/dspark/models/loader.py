"""Load an HF-format safetensors directory into the engine's own decoder."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dspark.models.config import load_target_config
from dspark.models.packed_linear import can_pack, pack_linears
from dspark.models.pull import ModelError
from dspark.models.transformer import DecoderModel

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def has_safetensors(model_dir: Path) -> bool:
    return (model_dir / SAFETENSORS_INDEX).is_file() or (model_dir / SAFETENSORS_FILE).is_file()


def weight_map(model_dir: Path) -> dict[str, str]:
    """Each tensor of a (possibly sharded) safetensors checkpoint and the file that holds it."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    if not (model_dir / SAFETENSORS_FILE).is_file():
        raise ModelError(f"{model_dir} has no model.safetensors (only safetensors checkpoints are supported)")
    with _open(model_dir / SAFETENSORS_FILE) as f:
        return dict.fromkeys(f.keys(), SAFETENSORS_FILE)


def load_state_dict(model_dir: Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a (possibly sharded) safetensors checkpoint: all of them, or only `names`.

    Only the files holding the wanted tensors are opened, and only those tensors are read.
    """
    files = weight_map(model_dir)
    wanted = files.keys() if names is None else names
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(by_file):
        with _open(model_dir / name) as f:
            try:
                state.update({key: f.get_tensor(key) for key in by_file[name]})
            except Exception as e:  # safetensors raises several error types for damaged files
                raise ModelError(f"cannot read {model_dir / name}: {e}") from e
    return state


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    try:
        handle = safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises several error types for damaged files
        raise ModelError(f"cannot read {path}: {e}") from e
    with handle as f:
        yield f


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
