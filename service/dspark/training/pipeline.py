"""The data stages of `dspark train`: samples (committed corpus shards, or prompts answered here)
-> stored target features.

Each stage writes its output under `data_dir` and is skipped when that output is complete, so
the drafters of one target share one data directory and an interrupted run resumes.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from dspark.training.config import DataConfig, TrainConfig, as_current
from dspark.training.features import SHARD_PATTERN, extract_features
from dspark.training.loops import truncate_loop
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
        stored = json.loads(path.read_text()).get("key") or {}
        if {"target": stored.get("target"), "data": as_current(DataConfig, stored.get("data") or {})} != key:
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


def collect_samples(
    cfg: TrainConfig,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    skip_bad_shards: bool = False,
) -> list[tuple[Path, list[dict]]]:
    """The training samples in groups, each with its feature directory (used by cached features).

    Samples come from the committed corpus shards (`data.corpus`, read as they are) and from
    `data.sources` / `data.raw_text` (generated here); each group of samples has its own feature
    shards, so a corpus that grows only adds feature shards for its new shards.
    """
    from dspark.models.pull import resolve_target

    check_manifest(cfg)
    model_dir = resolve_target(cfg.target)
    groups: list[tuple[Path, list[dict]]] = []  # (feature directory, samples)
    if cfg.data.sources or cfg.data.raw_text:
        groups.append((cfg.data_dir, _prompt_samples(cfg, model_dir, device, dtype, progress)))
    groups += _corpus_samples(cfg, model_dir, skip_bad_shards)
    if cfg.data.loops == "truncate":
        groups = [(d, [_loop_cut(s) for s in samples]) for d, samples in groups]
    if not any(samples for _, samples in groups):
        raise NoUsableData(f"{cfg.data_dir}: no sample has a response of at least 2 tokens")
    return groups


def _loop_cut(sample: dict) -> dict:
    return {**sample, "response_ids": truncate_loop(sample["response_ids"])}


def prepare_data(
    cfg: TrainConfig,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    skip_bad_shards: bool = False,
) -> list[Path]:
    """Run the missing data stages, cached target features included; returns the feature shard paths."""
    from dspark.models.pull import resolve_target

    groups = collect_samples(cfg, device, dtype, progress, skip_bad_shards)
    paths_of = {d: [d / SHARD_PATTERN.format(i) for i in range((len(s) + 255) // 256)] for d, s in groups}
    missing = [(d, s) for d, s in groups if not all(p.is_file() for p in paths_of[d])]
    if missing:
        start = time.perf_counter()
        model = load_target(resolve_target(cfg.target), device, dtype)
        for feature_dir, samples in missing:
            feature_dir.mkdir(parents=True, exist_ok=True)
            extract_features(
                model,
                samples,
                cfg.data.feature_layers,
                feature_dir,
                cfg.data.feature_batch_tokens,
                progress=progress,
            )
        del model
        _record_time(cfg, "features", time.perf_counter() - start)
    return [p for d, _ in groups for p in paths_of[d]]


def load_target(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """The frozen target (HF causal LM) whose hidden states are the drafters' features."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model.requires_grad_(False)


def _corpus_samples(cfg: TrainConfig, model_dir: Path, skip_bad: bool) -> list[tuple[Path, list[dict]]]:
    """Per corpus shard: its feature directory (named by the shard's content hash) and samples."""
    from dspark.training.corpus import target_name
    from dspark.training.shards import load_corpus, target_identity

    if not cfg.data.corpus:
        return []
    identity = target_identity(target_name(cfg.target), model_dir)
    groups = []
    for corpus_dir in cfg.data.corpus:
        if not corpus_dir.is_dir():
            raise NoUsableData(f"corpus directory {corpus_dir} does not exist")
        shards = load_corpus(corpus_dir, identity, skip_bad=skip_bad)
        if not shards:
            log.warning("corpus %s holds no usable shard", corpus_dir)
        for shard in shards:
            feature_dir = (
                cfg.data_dir
                / "corpus-features"
                / f"{corpus_dir.resolve().name}-{shard.path.stem}-{shard.manifest.bin_sha256[:12]}"
            )
            samples = [
                {"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "domain": s.domain}
                for s in shard.samples
                if len(s.response_ids) >= 2
            ]
            groups.append((feature_dir, samples))
    log.info(
        "corpus: %d shards, %d responses, %d response tokens",
        len(groups),
        sum(len(s) for _, s in groups),
        sum(len(x["response_ids"]) for _, s in groups for x in s),
    )
    return groups


def _prompt_samples(
    cfg: TrainConfig, model_dir: Path, device: torch.device, dtype: torch.dtype, progress: bool
) -> list[dict]:
    """Samples of `data.sources` (answered here by the target) and `data.raw_text`."""
    from dspark.engine.prompt import encode_prompt
    from transformers import AutoTokenizer

    data_dir = cfg.data_dir
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
        from dspark.builder import engine_from_config
        from dspark.engine.config import EngineConfig

        start = time.perf_counter()
        engine = engine_from_config(
            EngineConfig(
                target=str(model_dir),
                drafter="none",
                policy="none",
                dtype=_dtype_name(dtype),
                device=str(device),
                max_num_seqs=cfg.data.generation_batch,
                max_batch_tokens=max(2048, cfg.data.max_prompt_tokens + 16),
                max_model_len=cfg.data.max_prompt_tokens + cfg.data.max_new_tokens + 16,
            )
        )
        generate_samples(engine, prompts, cfg.data, data_dir, progress=progress)
        del engine
        _record_time(cfg, "generate", time.perf_counter() - start)
    generated = read_jsonl(samples_path) if samples_path.is_file() else []
    samples = [s for s in generated + raw if len(s["response_ids"]) >= 2]
    if not samples:
        raise NoUsableData(f"{samples_path}: no sample has a response of at least 2 tokens")
    return samples


def _dtype_name(dtype: torch.dtype) -> str:
    return "bfloat16" if dtype == torch.bfloat16 else "float32"
