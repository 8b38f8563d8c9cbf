"""The data stages of `dspark train`: prompts -> self-distilled samples -> stored target features.

Each stage writes its output under `data_dir` and is skipped when that output is complete, so
the drafters of one target share one data directory and an interrupted run resumes.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from dspark.training.config import TrainConfig
from dspark.training.features import SHARD_PATTERN, extract_features
from dspark.training.prompts import PROMPTS_FILE, NoUsableData, read_jsonl, select_prompts, write_prompts
from dspark.training.selfdistill import SAMPLES_FILE, generate_samples

log = logging.getLogger(__name__)
MANIFEST_FILE = "manifest.json"


def _data_key(cfg: TrainConfig) -> dict:
    """What determines the data directory's content; a different one in the same dir is refused."""
    return {"target": cfg.target, "data": cfg.data.model_dump(mode="json")}


def check_manifest(cfg: TrainConfig) -> None:
    path = cfg.data_dir / MANIFEST_FILE
    key = _data_key(cfg)
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("key") != key:
            raise ValueError(
                f"{cfg.data_dir} was built from a different target/data config; use another data_dir "
                "or delete it"
            )
    else:
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "timings_s": {}}, indent=2) + "\n")


def _record_time(cfg: TrainConfig, stage: str, seconds: float) -> None:
    path = cfg.data_dir / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["timings_s"][stage] = round(manifest["timings_s"].get(stage, 0.0) + seconds, 1)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def prepare_data(cfg: TrainConfig, device: torch.device, dtype: torch.dtype, progress: bool = True) -> list[Path]:
    """Run the missing data stages; returns the feature shard paths."""
    from dspark.commands.generate import encode_prompt
    from dspark.models.pull import resolve_target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_manifest(cfg)
    data_dir = cfg.data_dir
    model_dir = resolve_target(cfg.target)
    prompts_path = data_dir / PROMPTS_FILE
    if not prompts_path.is_file():
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts, report = select_prompts(cfg.data, tokenizer, encode_prompt)
        write_prompts(data_dir, prompts, report)
        log.info("prompts: %s; dropped for evaluation overlap: %s", report["selected"], report["dropped"])
        _record_time(cfg, "prompts", time.perf_counter() - start)
    everything = read_jsonl(prompts_path)
    if not everything:
        raise NoUsableData(f"{prompts_path} holds no prompts")
    prompts = [p for p in everything if "response_ids" not in p]
    raw = [
        {**p, "temperature": None, "finish_reason": "raw", "index": i}
        for i, p in enumerate(everything)
        if "response_ids" in p
    ]

    samples_path = data_dir / SAMPLES_FILE
    done = len(read_jsonl(samples_path)) if samples_path.is_file() else 0
    if prompts and done < len(prompts):
        from dspark.engine.config import EngineConfig
        from dspark.engine.llm_engine import LLMEngine

        start = time.perf_counter()
        engine = LLMEngine.from_config(
            EngineConfig(
                target=str(model_dir),
                drafter="none",
                policy="none",
                dtype=_dtype_name(dtype),
                device=str(device),
                max_num_seqs=cfg.data.generation_batch,
                max_batch_tokens=max(2048, cfg.data.max_prompt_tokens + 16),
                max_model_len=cfg.data.max_prompt_tokens + cfg.data.max_new_tokens + 16,
                seed=cfg.data.seed,
            )
        )
        generate_samples(engine, prompts, cfg.data, data_dir, progress=progress)
        del engine
        _record_time(cfg, "generate", time.perf_counter() - start)
    generated = read_jsonl(samples_path) if samples_path.is_file() else []
    samples = [s for s in generated + raw if len(s["response_ids"]) >= 2]
    if not samples:
        raise NoUsableData(f"{samples_path}: no sample has a response of at least 2 tokens")

    n_shards = (len(samples) + 255) // 256
    if not all((data_dir / SHARD_PATTERN.format(i)).is_file() for i in range(n_shards)):
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        extract_features(
            model, samples, cfg.data.feature_layers, data_dir, cfg.data.feature_batch_tokens, progress=progress
        )
        del model
        _record_time(cfg, "features", time.perf_counter() - start)
    return [data_dir / SHARD_PATTERN.format(i) for i in range(n_shards)]


def _dtype_name(dtype: torch.dtype) -> str:
    return "bfloat16" if dtype == torch.bfloat16 else "float32"
