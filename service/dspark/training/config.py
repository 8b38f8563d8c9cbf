"""`dspark train` configuration (one YAML / JSON file reproduces a run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from dspark.models.registry import DEFAULT_MODEL
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceSpec(_Strict):
    source: str = Field(description="sharegpt | champ | neetcode | rg-math | jsonl:PATH")
    domains: dict[str, int] = Field(description="Prompts to take per domain, e.g. {chat: 400, code: 200}.")


class DataConfig(_Strict):
    """Prompts, the target's own responses (self-distillation) and the stored target features."""

    sources: list[SourceSpec] = Field(default_factory=list, description="Prompts answered by the target.")
    raw_text: list[SourceSpec] = Field(
        default_factory=list,
        description="Prompts with the corpus's own answers (no generation); p^t still comes from the target.",
    )
    corpus: list[Path] = Field(
        default_factory=list,
        description="Self-distilled corpus directories (e.g. data/selfdistill/smollm2-135m): every shard "
        "in them is used as it is, nothing is regenerated.",
    )
    max_prompt_tokens: int = Field(256, ge=8)
    max_new_tokens: int = Field(256, ge=8)
    greedy_fraction: float = Field(0.3, ge=0.0, le=1.0, description="Share of responses generated at T=0.")
    temperature: float = Field(1.0, gt=0.0, description="Temperature of the sampled responses.")
    feature_layers: tuple[int, ...] = Field((1, 14, 26), min_length=1, description="Target layers stored.")
    decontaminate: bool = Field(
        True, description="Drop prompts overlapping HumanEval / GSM8K test / MT-Bench."
    )
    require_eval_sets: bool = Field(
        False, description="Refuse to run when an evaluation set's package is missing (cannot check overlap)."
    )
    ngram: int = Field(8, ge=3, description="Word n-gram length of the overlap test.")
    loops: Literal["keep", "truncate"] = Field(
        "keep",
        description="Looping answers (a tail that only repeats its own 8-grams): keep them, or cut each "
        "32 tokens into its loop (dspark/training/loops.py).",
    )
    generation_batch: int = Field(64, ge=1)
    feature_batch_tokens: int = Field(4096, ge=64)
    seed: int = 0

    @model_validator(mode="after")
    def _some_source(self) -> DataConfig:
        if not self.sources and not self.raw_text and not self.corpus:
            raise ValueError("data needs at least one entry in sources, raw_text or corpus")
        return self


class DrafterSpec(_Strict):
    kind: Literal["dspark", "dflash", "eagle3"]
    num_layers: int = Field(2, ge=1)
    block_size: int = Field(7, ge=2, description="gamma: draft tokens per round (and EAGLE-3's TTT horizon).")
    target_layer_ids: tuple[int, ...] | None = Field(None, description="Defaults to data.feature_layers.")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    markov_rank: int = Field(32, ge=1)
    markov_vocab: Literal["full", "draft"] = Field(
        "full",
        description="'draft': the Markov head's W1 / W2 cover only the draft_vocab_size drafting tokens "
        "(2 Vd r weights instead of 2 V r, so a larger rank fits the same file size).",
    )
    confidence_head: bool = True
    intermediate_size: int | None = None  # defaults to the target's
    draft_vocab_size: int | None = Field(
        None,
        description="Reduced vocabulary of the most frequent response tokens: EAGLE-3 trains its head "
        "on it; DSpark / DFlash train on the whole vocabulary and draft over this one (set at export).",
    )
    init_from_target_layers: tuple[int, ...] | None = Field(
        None, description="Copy these target decoder layers' weights into the draft layers where shapes fit."
    )

    @model_validator(mode="after")
    def _markov_vocab_needs_one(self) -> DrafterSpec:
        if self.markov_vocab == "draft" and (self.kind != "dspark" or not self.draft_vocab_size):
            raise ValueError("markov_vocab: draft needs kind: dspark and a draft_vocab_size")
        return self


class OptimConfig(_Strict):
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps (overrides epochs).")
    sequences_per_step: int = Field(8, ge=1)
    anchors_per_sequence: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(100, ge=1)
    seed: int = 0


class LossConfig(_Strict):
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    kl: float = Field(
        0.0,
        ge=0,
        description="Forward KL(p^t || p^d): pushes up tokens the drafter rates low, where TV barely does.",
    )
    decay: float | None = Field(
        None, description="w_k = exp(-(k-1)/decay); None = block_size, as in the paper."
    )


def as_current(model: type[BaseModel], stored: dict) -> dict | None:
    """A stored dump read as the current `model` writes it: fields added since take their defaults,
    so a config stored before them compares equal to one that leaves them at those defaults. None
    when it no longer validates."""
    try:
        return model.model_validate(stored).model_dump(mode="json")
    except ValidationError:
        return None


class TrainConfig(_Strict):
    target: str = Field(DEFAULT_MODEL, description="Model name or HF-format directory.")
    data_dir: Path = Field(
        description="Prompts, responses and features (shared by the drafters of one target)."
    )
    out_dir: Path = Field(description="Training state and the exported checkpoint (out_dir/final).")
    data: DataConfig
    drafter: DrafterSpec
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Autocast dtype of target and drafter forwards; losses stay fp32."
    )
    features: Literal["online", "cached"] = Field(
        "online",
        description="online: the frozen target's forward on each batch (nothing stored); cached: "
        "feature shards under data_dir (about 4.4 KB per token for SmolLM2-135M), loaded into memory.",
    )
    warm_start: Literal["auto", "shipped", "none"] | Path = Field(
        "auto",
        description="Weights a run without a checkpoint starts from: auto = the shipped drafter of this "
        "kind when this target has one of the same shape, else fresh; shipped = that drafter or an error; "
        "none = fresh; or a drafter checkpoint directory.",
    )

    @model_validator(mode="after")
    def _layers_stored(self) -> TrainConfig:
        ids = self.drafter.target_layer_ids
        if ids is not None and not set(ids) <= set(self.data.feature_layers):
            raise ValueError(
                f"drafter.target_layer_ids {list(ids)} must be among data.feature_layers "
                f"{list(self.data.feature_layers)} (only those are stored)"
            )
        return self

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.target_layer_ids or self.data.feature_layers

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """From a YAML or JSON file; relative data_dir / out_dir are taken from the current directory."""
        text = Path(path).read_text()
        raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        return cls.model_validate(raw)
