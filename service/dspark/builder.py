"""Wire an engine from its configuration: target, drafter, verify policy and its SPS profile."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from dspark.drafters.checkpoint import SharedWeights
from dspark.drafters.factory import load_drafter, resolve_drafter_spec
from dspark.engine.config import EngineConfig, resolve_device, resolve_dtype
from dspark.engine.drafter import Drafter
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.policy_spec import needs_profile
from dspark.engine.verify_policy import VerifyPolicy
from dspark.models.hub import served_name, tokenizer_dir
from dspark.models.loader import load_target_model
from dspark.models.pull import resolve_target
from dspark.policies.factory import build_policy, resolve_policy_spec
from dspark.profiling.acquire import acquire_profile

log = logging.getLogger(__name__)


def engine_from_config(config: EngineConfig) -> LLMEngine:
    """Load the target, resolve `auto` drafter and policy, acquire the SPS profile a profiled
    policy needs (stored, or measured on this engine), and return the engine."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_target(config.target)
    started = time.perf_counter()
    model = load_target_model(model_dir, dtype, device)
    log.info("loaded %s (%s, %s) in %.1f s", config.target, dtype, device, time.perf_counter() - started)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_dir(config.tokenizer) if config.tokenizer else model_dir
    )
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    shared = SharedWeights(model.model.embed_tokens.weight, model.lm_head.weight)
    drafter_spec = resolve_drafter_spec(config.drafter, model.config)
    gamma = config.gamma if drafter_spec == "ngram" else None
    drafter = load_drafter(drafter_spec, model.config, device, dtype, shared=shared, gamma=gamma)
    policy_spec = resolve_policy_spec(config.policy, drafter)
    config = config.model_copy(update={"drafter": drafter_spec, "policy": policy_spec})
    # The profiled policies need this engine (its KV cache) to measure SPS(B) when no stored
    # profile matches, so the engine starts under `none` and receives its policy after.
    engine = LLMEngine(
        config, model, tokenizer, drafter, build_policy("none"), device, dtype, served_name(config.target)
    )
    sps = None
    if needs_profile(policy_spec):
        sps = acquire_profile(
            engine, config.sps_profile, config.strict_profile, quick=config.build_in_background
        )
    engine.policy = build_policy(policy_spec, sps=sps, settings=config.policy_settings)
    log.info(
        "engine: %s on %s (%s), drafter %s, policy %s",
        config.target,
        device,
        dtype,
        drafter.name,
        engine.policy.name,
    )
    return engine


def read_chat_template(spec: str) -> str:
    """A chat template given as a file path or as the template itself (as vLLM's --chat-template)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in spec:
        raise ValueError(f"chat template {spec!r} is neither a file nor a Jinja template")
    return spec


def sibling_engine(
    engine: LLMEngine,
    drafter: Drafter,
    policy: VerifyPolicy,
    engine_type: type[LLMEngine] = LLMEngine,
    **config_updates,
) -> LLMEngine:
    """Another engine (of `engine_type`) over `engine`'s loaded weights with its own KV cache, e.g.
    to compare drafters or policies on one model load."""
    config = engine.config.model_copy(
        update={"drafter": drafter.name, "policy": policy.name, **config_updates}
    )
    return engine_type(
        config,
        engine.model,
        engine.tokenizer,
        drafter,
        policy,
        engine.device,
        engine.dtype,
        engine.model_name,
    )
