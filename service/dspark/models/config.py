"""Target model configuration: transformers' config classes, checked for what the runner supports."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from dspark.models.pull import ModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def load_target_config(model_dir: Path) -> PretrainedConfig:
    """Read config.json; refuse architectures the runner does not implement, naming them."""
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot read the model config in {model_dir}: {e}") from e
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"unsupported architecture {config.model_type!r} ({', '.join(config.architectures or [])}) "
            f"in {model_dir}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        raise ModelError(f"{model_dir}: sliding-window attention is not supported")
    return config


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
