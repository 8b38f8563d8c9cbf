"""Drafter checkpoint configuration (parsed from config.json) and target compatibility checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from transformers import Qwen3Config

from dspark.drafters.published import (
    aux_to_decoder_layers,
    dflash_default_layers,
    dflash_refusals,
    eagle3_layer_refusals,
    flatten_speculators,
    is_speculators,
)

DrafterKind = Literal["dspark", "dflash", "eagle3"]

DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)
DFLASH_ARCHITECTURES = ("DFlashDraftModel", "Qwen3DFlashModel", "Qwen3DFlashDraftModel")
EAGLE3_ARCHITECTURES = ("Eagle3DraftModel", "LlamaForCausalLMEagle3", "Qwen3ForCausalLMEagle3")
NO_QK_NORM_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


class TargetShape(BaseModel):
    """What a drafter must agree with in its target model."""

    model_config = ConfigDict(frozen=True)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)

    @classmethod
    def of(cls, target_config: Any) -> TargetShape:
        """From a transformers config, a config dict, a TargetShape, or a model directory / config.json path."""
        if isinstance(target_config, TargetShape):
            return target_config
        if isinstance(target_config, str | Path):
            path = Path(target_config)
            target_config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        if isinstance(target_config, dict):
            cfg = target_config.get("text_config", target_config)
            return cls(**{k: cfg[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")})
        cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers
        )


class DraftConfig(BaseModel):
    """The drafter-specific part of a checkpoint's config.json; layer sizes stay in `layers` (HF config)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    kind: DrafterKind
    architecture: str
    vocab_size: int
    hidden_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...] = Field(min_length=1)
    num_target_layers: int | None = None
    block_size: int = Field(ge=1)
    gamma: int = Field(ge=1, description="Draft tokens per round.")
    # DSpark: anchor + gamma-1 masks -> gamma drafts; DFlash: anchor + gamma masks -> gamma drafts.
    anchor_predicts: bool = True
    mask_token_id: int | None = None
    markov_head_type: str | None = None
    markov_rank: int = 0
    confidence_head: bool = False
    confidence_with_markov: bool = False
    draft_vocab_size: int | None = None  # reduced drafting vocabulary (`d2t` mapping)
    qk_norm: bool = True  # EAGLE-3: q_norm / k_norm in attention (Qwen3 layer; a Llama layer has none)
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(h), not h
    markov_draft_vocab: bool = False  # W1 / W2 of the Markov head cover the drafting vocabulary only
    layers: Any  # transformers Qwen3Config: decoder layer hyper-parameters (heads, head_dim, rope, eps)
    raw: dict[str, Any]

    @classmethod
    def load(
        cls, checkpoint_dir: str | Path, gamma: int | None = None, target_layers: int | None = None
    ) -> DraftConfig:
        path = Path(checkpoint_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in drafter checkpoint {checkpoint_dir}")
        return cls.from_dict(json.loads(path.read_text()), gamma=gamma, target_layers=target_layers)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], gamma: int | None = None, target_layers: int | None = None
    ) -> DraftConfig:
        """`target_layers` (the target's layer count) places the default feature layers of a
        checkpoint that names neither its feature layers nor `num_target_layers`, as vLLM does."""
        if is_speculators(raw):
            raw = flatten_speculators(raw)
        arch = checkpoint_architecture(raw)
        nested = raw.get("dflash_config") or raw.get("eagle_config") or {}
        layer_keys = {
            k: v for k, v in raw.items() if k not in ("architectures", "dflash_config", "eagle_config")
        }
        # Llama-style configs omit head_dim (Qwen3Config would default it to 128).
        layer_keys.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        layers = Qwen3Config(**layer_keys)
        common = {
            "architecture": arch,
            "vocab_size": raw["vocab_size"],
            "hidden_size": raw["hidden_size"],
            "num_target_layers": raw.get("num_target_layers"),
            "layers": layers,
            "raw": raw,
        }
        if arch in DSPARK_ARCHITECTURES or arch in DFLASH_ARCHITECTURES:
            _refuse(arch, dflash_refusals(raw))
            head = raw.get("markov_head_type")
            head = None if head in (None, "", "none") else head
            kind: DrafterKind = "dspark" if head is not None else "dflash"
            anchor_predicts = arch in DSPARK_ARCHITECTURES
            block = int(raw.get("block_size", nested.get("block_size", 0)))
            rank = int(raw.get("markov_rank", 0)) if head else 0
            conf = bool(raw.get("enable_confidence_head", False))
            conf_markov = conf and bool(raw.get("confidence_head_with_markov", False)) and rank > 0
            markov_draft_vocab = bool(raw.get("markov_over_draft_vocab", False)) and head is not None
            if markov_draft_vocab and not 0 < int(raw.get("draft_vocab_size") or 0) < raw["vocab_size"]:
                raise ValueError("markov_over_draft_vocab needs a draft_vocab_size below vocab_size")
            ids = raw.get("target_layer_ids", nested.get("target_layer_ids"))
            n_target = raw.get("num_target_layers") or target_layers
            if not ids and arch in DFLASH_ARCHITECTURES and n_target:
                ids = dflash_default_layers(n_target, raw["num_hidden_layers"])
            if raw.get("mask_token_id", nested.get("mask_token_id")) is None:
                raise ValueError(f"{arch} config names no mask_token_id (nor dflash_config.mask_token_id)")
            return cls(
                kind=kind,
                target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
                target_layer_ids=tuple(ids or ()),
                block_size=block,
                gamma=gamma or (block if anchor_predicts else block - 1),
                anchor_predicts=anchor_predicts,
                mask_token_id=raw.get("mask_token_id", nested.get("mask_token_id")),
                markov_head_type=head,
                markov_rank=rank,
                confidence_head=conf,
                confidence_with_markov=conf_markov,
                draft_vocab_size=raw.get("draft_vocab_size"),
                markov_draft_vocab=markov_draft_vocab,
                **common,
            )
        if arch in EAGLE3_ARCHITECTURES:
            _refuse(arch, eagle3_layer_refusals(raw))
            ids = raw.get("target_layer_ids")
            if not ids and (
                aux := raw.get("eagle_aux_hidden_state_layer_ids")
                or nested.get("eagle_aux_hidden_state_layer_ids")
            ):
                ids = aux_to_decoder_layers(aux)
            n_target = raw.get("num_target_layers") or target_layers
            if not ids:
                if not n_target:
                    raise ValueError(
                        "EAGLE-3 config names neither target_layer_ids (eagle_aux_hidden_state_layer_ids) "
                        "nor num_target_layers, and no target was given to place the default layers"
                    )
                ids = default_eagle3_layers(n_target)
            g = gamma or int(raw.get("block_size", 7))
            return cls(
                kind="eagle3",
                target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
                target_layer_ids=tuple(ids),
                block_size=g,
                gamma=g,
                draft_vocab_size=raw.get("draft_vocab_size"),
                qk_norm=arch not in NO_QK_NORM_ARCHITECTURES,
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
                **common,
            )
        raise AssertionError(arch)  # checkpoint_architecture refuses the others

    def check_target(self, target: TargetShape) -> None:
        """Refuse a target this drafter was not built for, naming every mismatch."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocabulary size {self.vocab_size} != target's {target.vocab_size}")
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.target_hidden_size} != target's {target.hidden_size}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            problems.append(
                f"num_target_layers {self.num_target_layers} != target's {target.num_hidden_layers} layers"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            problems.append(f"target layers {bad} outside the target's 0..{target.num_hidden_layers - 1}")
        if problems:
            raise ValueError(f"{self.architecture} drafter does not match the target: " + "; ".join(problems))


def checkpoint_architecture(raw: dict[str, Any]) -> str:
    """The architecture a drafter config.json declares (a `speculators` one as the EAGLE-3 it is);
    an architecture no drafter here runs is refused, naming the known ones."""
    if is_speculators(raw):
        raw = flatten_speculators(raw)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in DSPARK_ARCHITECTURES + DFLASH_ARCHITECTURES + EAGLE3_ARCHITECTURES:
        raise ValueError(
            f"unknown drafter architecture {arch!r}; known: "
            f"{DSPARK_ARCHITECTURES + DFLASH_ARCHITECTURES + EAGLE3_ARCHITECTURES} "
            "and speculators_model_type eagle3"
        )
    return arch


def checkpoint_kind(raw: dict[str, Any]) -> DrafterKind:
    """dspark, dflash or eagle3, from a drafter config.json alone."""
    arch = checkpoint_architecture(raw)
    if arch in EAGLE3_ARCHITECTURES:
        return "eagle3"
    if is_speculators(raw):
        raw = flatten_speculators(raw)
    return "dflash" if raw.get("markov_head_type") in (None, "", "none") else "dspark"


def _refuse(arch: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{arch} drafter cannot be run here: " + "; ".join(problems))


def default_eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's usual low / middle / high feature layers (decoder-layer indices)."""
    return (1, num_layers // 2 - 1, num_layers - 4)
