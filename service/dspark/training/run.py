"""`dspark train` end to end: data stages, training, export."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch
from dspark.engine.config import resolve_device, resolve_dtype
from dspark.training.config import TrainConfig
from dspark.training.features import Sequence, load_sequences
from dspark.training.online import OnlineFeatures, token_sequences
from dspark.training.pipeline import collect_samples, load_target, prepare_data
from dspark.training.prompts import NoUsableData
from dspark.training.trainer import Trainer

log = logging.getLogger(__name__)


def _target_tensors(model_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from dspark.drafters.checkpoint import read_state_dict

    config = json.loads((model_dir / "config.json").read_text())
    state = {
        ("model." + k if not k.startswith(("model.", "lm_head")) else k): v
        for k, v in read_state_dict(model_dir).items()
    }
    # read_state_dict strips a leading "model."; HF names are restored above for the copies.
    return config, state


def mask_token_for(model_dir: Path) -> int:
    """A token that never occurs in chat text to mark block positions: the tokenizer's unk / pad."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for candidate in (tok.unk_token_id, tok.pad_token_id, tok.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def build_trainer(cfg: TrainConfig, progress: bool = True, skip_bad_shards: bool = False) -> Trainer:
    """The data stages, then a Trainer at the run's checkpoint (or its warm start)."""
    from dspark.models.pull import resolve_target

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model_dir = resolve_target(cfg.target)
    online = None
    if cfg.features == "cached":
        shards = prepare_data(cfg, device, dtype, progress=progress, skip_bad_shards=skip_bad_shards)
        sequences = load_sequences(shards, cfg.data.feature_layers, cfg.target_layer_ids)
    else:
        groups = collect_samples(cfg, device, dtype, progress=progress, skip_bad_shards=skip_bad_shards)
        sequences = token_sequences([samples for _, samples in groups])
        online = OnlineFeatures(
            load_target(model_dir, device, dtype), cfg.target_layer_ids, cfg.data.feature_batch_tokens
        )
    sequences = [s for s in sequences if len(s.tokens) - s.prompt_len >= 2]
    if not sequences:
        raise NoUsableData(f"{cfg.data_dir}: no sequence has a response to train on")
    return trainer_for(cfg, sequences, online)


def trainer_for(cfg: TrainConfig, sequences: list[Sequence], online: OnlineFeatures | None = None) -> Trainer:
    """A Trainer over `sequences` (with their features unless `online` fills them), at the run's
    checkpoint or its warm start."""
    from dspark.models.pull import resolve_target

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model_dir = resolve_target(cfg.target)
    target_config, target_state = _target_tensors(model_dir)
    target_config = target_config.get("text_config", target_config)
    embed = target_state["model.embed_tokens.weight"]
    head = target_state.get("lm_head.weight", embed)
    return Trainer(
        cfg,
        sequences,
        target_config,
        (embed, head),
        target_state
        if cfg.drafter.init_from_target_layers
        else {"model.norm.weight": target_state["model.norm.weight"]},
        mask_token_for(model_dir),
        dtype,
        device,
        online,
    )


def run_training(
    cfg: TrainConfig,
    progress: bool = True,
    stop_after: int | None = None,
    export_to: Path | None = None,
    skip_bad_shards: bool = False,
    export_every: int | None = None,
) -> Path | None:
    """Prepare the data, train (resuming), export; returns the exported directory (None if stopped early).
    `export_every` N also exports out_dir/step-NNNNNN every N steps (learning-curve points)."""
    start = time.perf_counter()
    trainer = build_trainer(cfg, progress, skip_bad_shards)
    metrics = trainer.train(progress=progress, stop_after=stop_after, export_every=export_every)
    log.info("training metrics: %s", metrics)
    if trainer.step < trainer.total:
        return None
    out = trainer.export()
    if export_to is not None:
        export_to.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors", "training.json"):
            shutil.copy2(out / name, export_to / name)
        out = export_to
    log.info("exported %s after %.0f s", out, time.perf_counter() - start)
    return out
