"""Test-only drafters and engine builders."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from dspark.engine.config import EngineConfig
from dspark.engine.drafter import DraftBlock, Drafter
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors, logits_to_probs, sample
from dspark.models.loader import load_target_model
from dspark.policies.factory import build_policy


class ScriptedDrafter(Drafter):
    """Proposes a known continuation with random corruptions, so verification sees both outcomes."""

    name = "scripted"

    def __init__(
        self, gamma: int, continuations: dict[tuple[int, ...], list[int]], corrupt: float, vocab: int
    ) -> None:
        self.gamma = gamma
        self.continuations = continuations  # prompt ids -> reference output ids
        self.corrupt = corrupt
        self.vocab = vocab
        self.rng = torch.Generator().manual_seed(0)

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        rows = []
        for r in requests:
            ref = self.continuations.get(tuple(r.prompt_token_ids), [])
            done = len(r.output_token_ids)
            row = (ref[done : done + self.gamma] + [0] * self.gamma)[: self.gamma]
            noise = torch.rand(self.gamma, generator=self.rng) < self.corrupt
            rows.append(
                [
                    int(torch.randint(self.vocab, (1,), generator=self.rng)) if bad else t
                    for t, bad in zip(row, noise.tolist(), strict=True)
                ]
            )
        return DraftBlock(torch.tensor(rows, dtype=torch.long).reshape(len(requests), self.gamma), None)


class DistributionDrafter(Drafter):
    """Samples each draft token from fixed logits (processed with the request's sampling params)."""

    name = "distribution"

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits  # [gamma, V]
        self.gamma = logits.shape[0]

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        n = len(requests)
        probs = logits_to_probs(self.logits.expand(n, *self.logits.shape).contiguous(), sampling)
        return DraftBlock(sample(probs, sampling.generators), probs)


def engine_on(model_dir, drafter: Drafter, policy: str, tokenizer=None, **config) -> LLMEngine:
    cfg = EngineConfig(
        target=str(model_dir), dtype="float32", device="cpu", gamma=max(drafter.gamma, 1), **config
    )
    model = load_target_model(model_dir, torch.float32, torch.device("cpu"))
    return LLMEngine(
        cfg,
        model,
        tokenizer,
        drafter,
        build_policy(policy),
        torch.device("cpu"),
        torch.float32,
        str(model_dir),
    )


def shipped_dspark_drafter(engine: LLMEngine) -> Drafter:
    """The target's shipped DSpark drafter over `engine`'s weights (fp32, CPU), for real-model tests."""
    from dspark.drafters.checkpoint import SharedWeights
    from dspark.drafters.factory import load_drafter

    model = engine.model
    shared = SharedWeights(model.model.embed_tokens.weight, model.lm_head.weight)
    return load_drafter("dspark", model.config, torch.device("cpu"), torch.float32, shared=shared)


def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int], params) -> torch.Tensor:
    """Processed logits of one position, token by token (independent of `logits_processors`):
    logit_bias, repetition over prompt + output, frequency and presence over the output, and the
    stop tokens masked while fewer than min_tokens exist (EOS is not known here: ignore_eos)."""
    x = logits.clone().float()
    for token, bias in params.logit_bias.items():
        x[token] += bias
    seen = set(prompt) | set(output)
    for t in range(x.shape[-1]):
        if t in seen:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        count = output.count(t)
        x[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    if len(output) < params.min_tokens:
        x[list(params.stop_token_ids)] = float("-inf")
    return x


def reference_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then min_p (no top-k / top-p), as a plain softmax; greedy is one-hot."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()
