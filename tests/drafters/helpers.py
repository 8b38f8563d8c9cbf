"""Helpers: the tiny DeepSpec reference fixture, target features computed by HF, and requests."""

from __future__ import annotations

from pathlib import Path

import torch
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.sampling_params import SamplingParams
from transformers import Qwen3ForCausalLM

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec-qwen3-dspark-tiny"
VARIANTS = ("vanilla", "gated", "rnn")
TARGET_LAYERS = (0, 2, 4)


def target_features(target: Qwen3ForCausalLM, token_ids: list[int], layers=TARGET_LAYERS) -> torch.Tensor:
    """[n, len(layers) * hidden]: outputs of the given decoder layers (HF hidden_states index layer + 1)."""
    with torch.no_grad():
        out = target(torch.tensor([token_ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)


def make_request(request_id: str, tokens: list[int], num_cached: int, temperature: float = 0.0) -> Request:
    """A decoding request whose first `num_cached` tokens are cached and whose last token is the anchor."""
    assert num_cached == len(tokens) - 1
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(temperature=temperature),
        num_cached=num_cached,
    )


def sampling_for(requests: list[Request], seeds: list[int | None] | None = None) -> SamplingTensors:
    """Sampling tensors of the requests' params, with a fresh seeded generator per row when given."""
    seeds = seeds or [None] * len(requests)
    gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
    return SamplingTensors.from_params([r.params for r in requests], gens)


def sequence(length: int, seed: int, vocab: int = 1000) -> list[int]:
    """A deterministic pseudo-random token sequence (ids below the fixture's mask token)."""
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_same_distributions(row_probs, alone_probs, alone_tokens):
    """A request drafted alone draws from what its row in a mixed batch holds; a greedy request
    alone gets None (one-hot), its batch row the one-hot distributions."""
    if alone_probs is None:
        one_hot = torch.nn.functional.one_hot(alone_tokens, row_probs.shape[-1]).to(row_probs.dtype)
        assert torch.equal(row_probs, one_hot)
    else:
        torch.testing.assert_close(row_probs, alone_probs[0], atol=1e-5, rtol=1e-4)


class PerEngineNgram(NgramDrafter):
    """An n-gram drafter whose `fresh_copy` is a new instance, standing in for drafters with
    per-request state."""

    def fresh_copy(self) -> PerEngineNgram:
        return PerEngineNgram(self.gamma)
