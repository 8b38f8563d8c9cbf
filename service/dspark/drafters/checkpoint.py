"""Load and save drafter checkpoints (HF layout: config.json + safetensors).

Layout of DeepSpec's `Qwen3DSparkModel` (the published `deepseek-ai/dspark_qwen3_*_block7`), which
the project's own drafters also use: keys `fc`, `hidden_norm`, `layers.N.*`, `norm`,
`markov_head.*`, `confidence_head.proj`, optionally `embed_tokens` / `lm_head` (frozen copies of the
target's; when absent they come from the target). EAGLE-3 checkpoints: see `eagle3_model.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dspark.drafters.config import DraftConfig, TargetShape
from dspark.drafters.dspark_model import DSparkModel
from dspark.drafters.eagle3_model import Eagle3Model
from dspark.drafters.published import project_state_dict
from dspark.models.loader import has_safetensors, load_state_dict, weight_map

_TORCH_FILE = "pytorch_model.bin"


@dataclass
class SharedWeights:
    """The target's token embedding [V, d] and LM head [V, d], shared (not copied) with the drafter."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor


def read_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single or sharded safetensors, or pytorch_model.bin)."""
    root = Path(checkpoint_dir)
    if has_safetensors(root):
        state = load_state_dict(root)
    elif (root / _TORCH_FILE).is_file():
        state = torch.load(root / _TORCH_FILE, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no model.safetensors (or index / {_TORCH_FILE}) in {root}")
    return {_strip_prefix(k): v for k, v in state.items()}


def _strip_prefix(key: str) -> str:
    return key[len("model.") :] if key.startswith("model.") else key


def load_target_shared_weights(target_dir: str | Path) -> SharedWeights:
    """Read only the embedding and LM head from a HF causal-LM directory (tied heads supported)."""
    root = Path(target_dir)
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    tied = head not in weight_map(root)
    state = load_state_dict(root, [embed] if tied else [embed, head])
    return SharedWeights(state[embed], state[embed] if tied else state[head])


def build_model(config: DraftConfig) -> nn.Module:
    return Eagle3Model(config) if config.kind == "eagle3" else DSparkModel(config)


def load_draft_model(
    checkpoint_dir: str | Path,
    target: TargetShape | object | None = None,
    shared: SharedWeights | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    gamma: int | None = None,
) -> DSparkModel | Eagle3Model:
    """Build the drafter described by `checkpoint_dir/config.json` and load its weights.

    The target's embedding / LM head are used when `shared` is given (one copy in memory), else the
    checkpoint's copies; a checkpoint without them needs `shared`. With `target` (any config
    `TargetShape.of` accepts), a vocabulary / hidden size / layer mismatch is refused.
    """
    shape = TargetShape.of(target) if target is not None else None
    config = DraftConfig.load(
        checkpoint_dir, gamma=gamma, target_layers=shape.num_hidden_layers if shape else None
    )
    if shape is not None:
        config.check_target(shape)
    with torch.device("meta"):
        model = build_model(config)
    state = project_state_dict(
        read_state_dict(checkpoint_dir), config.kind, config.vocab_size, config.draft_vocab_size
    )
    if shared is not None:
        state["embed_tokens.weight"] = shared.embed_tokens
        if "lm_head.weight" in model.shared_keys:
            state["lm_head.weight"] = shared.lm_head
    missing = [k for k in model.state_dict() if k not in state]
    if missing:
        hint = " (pass the target's SharedWeights)" if set(missing) & set(model.shared_keys) else ""
        raise ValueError(f"checkpoint {checkpoint_dir} lacks weights {missing}{hint}")
    unexpected = [k for k in state if k not in model.state_dict()]
    if unexpected:
        raise ValueError(
            f"checkpoint {checkpoint_dir} has weights this {config.kind} drafter does not use: {unexpected}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype).eval()


def save_draft_model(
    model: DSparkModel | Eagle3Model, out_dir: str | Path, include_shared: bool = False
) -> None:
    """Write config.json + model.safetensors in the layout `load_draft_model` reads.

    Weights shared with the target (`model.shared_keys`) are left out unless `include_shared`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.raw, indent=2) + "\n")
    tensors = {
        key: value.detach().contiguous().cpu()
        for key, value in model.state_dict().items()
        if include_shared or key not in model.shared_keys
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
