"""min_tokens through the whole engine: EOS and stop tokens are masked from the target until
min_tokens exist, identically in plain decoding, speculative verification (at every block
position) and a prompt's first token, so greedy speculation reproduces plain decoding even when
the drafter proposes the masked tokens. The sampled distribution under min_tokens is checked with
the other processed targets in test_sampling_features."""

from __future__ import annotations

import pytest
from dspark.builder import sibling_engine
from dspark.drafters.ngram import NoDrafter
from dspark.engine.sampling_params import SamplingParams
from dspark.policies.factory import build_policy
from pydantic import ValidationError

from tests.conftest import write_tiny_model
from tests.engine.helpers import ScriptedDrafter, engine_on

EOS = 2  # LlamaConfig's default eos_token_id
PROMPTS = [[3, 9, 12, 40], [5, 5, 5, 7], [60, 2, 33, 17, 8]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny64") / "llama", "llama", seed=3)
    return engine_on(path, NoDrafter(), "none", max_num_seqs=16)


def _greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, **fields)


def test_min_tokens_holds_back_stop_tokens_and_eos(plain):
    free = [plain.generate([p], _greedy(ignore_eos=True))[0].token_ids for p in PROMPTS]
    for prompt, out in zip(PROMPTS, free, strict=True):
        stops = [out[1], out[4]]  # tokens the free output produces early
        early = plain.generate([prompt], _greedy(stop_token_ids=stops, ignore_eos=True))[0]
        assert len(early.token_ids) <= 5 and early.finish_reason == "stop"
        held = plain.generate([prompt], _greedy(stop_token_ids=stops, ignore_eos=True, min_tokens=12))[0]
        assert len(held.token_ids) >= 12
        assert not set(held.token_ids[:11]) & set(stops)
        assert held.finish_reason == ("stop" if held.token_ids[-1] in stops else "length")
    # EOS favoured by a bias: without min_tokens the first token ends the request, with it the sixth.
    eos_first = _greedy(logit_bias={EOS: 60.0})
    assert plain.generate([PROMPTS[0]], eos_first)[0].token_ids == [EOS]
    held = plain.generate([PROMPTS[0]], eos_first.model_copy(update={"min_tokens": 5}))[0]
    assert len(held.token_ids) == 6 and held.token_ids[-1] == EOS and EOS not in held.token_ids[:5]
    ignored = plain.generate([PROMPTS[0]], eos_first.model_copy(update={"min_tokens": 5, "ignore_eos": True}))
    assert ignored[0].token_ids.count(EOS) > 1  # ignore_eos: EOS is neither masked nor a stop


def test_greedy_speculation_with_min_tokens_equals_plain_decoding(plain):
    cases = []
    for j, prompt in enumerate(PROMPTS):
        free = plain.generate([prompt], _greedy(ignore_eos=True))[0].token_ids
        cases.append(([*prompt, 10 + j], _greedy(stop_token_ids=[free[1], free[3]], min_tokens=9 + j)))
        cases.append(([*prompt, 20 + j], _greedy(logit_bias={EOS: 60.0}, min_tokens=4 + j)))
    expected = [plain.generate([p], sp)[0].token_ids for p, sp in cases]
    # The drafter proposes the unmasked continuation: the stop tokens and EOS at the masked positions.
    unmasked = [
        plain.generate([p], sp.model_copy(update={"min_tokens": 0, "ignore_eos": True}))[0].token_ids
        for p, sp in cases
    ]
    assert all(u[: len(e)] != e for u, e in zip(unmasked, expected, strict=True))
    scripted = ScriptedDrafter(5, {tuple(p): u for (p, _), u in zip(cases, unmasked, strict=True)}, 0.1, 64)
    engine = sibling_engine(plain, scripted, build_policy("static:4"), max_batch_tokens=128)
    results = engine.generate([p for p, _ in cases], [sp for _, sp in cases])
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_min_tokens_bounds():
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured={"kind": "regex", "value": "a+"})
