"""Structured outputs under speculation: constrained sampling follows the constrained target
exactly (tiny target), greedy constrained output equals plain constrained decoding and validates
(real target), bad constraints are refused before queueing, a grammar failure fails one request."""

from __future__ import annotations

import json
from collections.abc import Sequence

import jsonschema
import pytest
import torch
from dspark.builder import sibling_engine
from dspark.drafters.ngram import NgramDrafter, NoDrafter
from dspark.engine import drafting, structured
from dspark.engine.drafter import DraftBlock, Drafter
from dspark.engine.prompt import encode_prompt
from dspark.engine.request import Request
from dspark.engine.sampler import SamplingTensors
from dspark.engine.sampling_params import SamplingParams, StructuredOutput
from dspark.engine.structured import GrammarCompiler
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from tests.conftest import write_tiny_model
from tests.engine.helpers import DistributionDrafter, engine_on

pytestmark = pytest.mark.long

V = 8
N = 36_000  # as the other exact-distribution tests: a 0.03 bias cannot pass TV < 0.01


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Tokens 0..7 are the letters a..h; h is EOS."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="h")


# Needs 4+ letters (never accepting within 3 tokens, so EOS stays forbidden) and avoids the
# model's EOS ids (2 = c, 7 = h); the allowed letters per position, written out independently:
REGEX = "[ab][abd][d-g][abd-g]+"
ALLOWED = [[0, 1], [0, 1, 3], [3, 4, 5, 6]]


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny8") / "llama", "llama", seed=5, vocab_size=V)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def constrained_marginals(hf, prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Exact distributions of output tokens 0-2 with and without the mask (temperature 1)."""
    out = []
    for masked in (True, False):
        marginals, prefixes = [], {(): 1.0}
        for k in range(3):
            dist, nxt = torch.zeros(V), {}
            seqs = list(prefixes)
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]
            for s, row in zip(seqs, logits, strict=True):
                if masked:
                    keep = torch.full((V,), float("-inf"))
                    keep[ALLOWED[k]] = 0.0
                    row = row + keep
                p_row = torch.softmax(row, -1)
                dist += prefixes[s] * p_row
                for t in range(V):
                    if p_row[t] > 0:
                        nxt[(*s, t)] = prefixes[s] * p_row[t].item()
            marginals.append(dist)
            prefixes = nxt
        out.append(marginals)
    return out[0], out[1]


def test_constrained_speculative_sampling_follows_the_constrained_target(tiny8):
    path, hf = tiny8
    prompt = [1, 5, 2, 7]
    exact, unconstrained = constrained_marginals(hf, prompt)
    # Drafts from the unconstrained marginals: some are forbidden and must be rejected.
    drafter = DistributionDrafter(torch.stack(unconstrained[1:]).log())
    engine = engine_on(path, drafter, "static:2", char_tokenizer(), max_num_seqs=1024, max_batch_tokens=8192)
    params = SamplingParams(max_tokens=3, structured=StructuredOutput(kind="regex", value=REGEX))
    results = engine.generate([prompt] * N, params)
    tokens = torch.tensor([r.token_ids for r in results])
    tvs = [
        0.5 * (torch.bincount(tokens[:, k], minlength=V).float() / N - exact[k]).abs().sum().item()
        for k in range(3)
    ]
    print(f"regex-constrained: TV per output token {[round(t, 4) for t in tvs]}")
    assert max(tvs) < 0.01, tvs
    for k in range(3):
        assert set(tokens[:, k].unique().tolist()) <= set(ALLOWED[k])
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0.02 < accepted / sum(r.stats.draft_tokens for r in results) < 0.9  # forbidden drafts rejected


class ConstantDrafter(Drafter):
    """Proposes the same block for every request (one-hot drafts)."""

    name = "constant"

    def __init__(self, block: list[int]) -> None:
        self.block = block
        self.gamma = len(block)

    def propose(
        self, requests: Sequence[Request], sampling: SamplingTensors, horizon: int | None = None
    ) -> DraftBlock:
        return DraftBlock(torch.tensor([self.block] * len(requests), dtype=torch.long), None)


def test_grammar_check_of_drafts_finds_the_first_forbidden_one():
    """`first_forbidden` against the letters a..h (h the EOS): a..b twice, then the end."""
    compiler = GrammarCompiler(char_tokenizer(), V, [7])
    grammar = compiler.compile(StructuredOutput(kind="regex", value="[ab]{2}"))
    assert grammar.first_forbidden([0, 1]) is None
    assert grammar.first_forbidden([4, 0]) == 0
    assert grammar.first_forbidden([0, 4, 0]) == 1
    assert grammar.first_forbidden([0, 1, 0]) == 2  # complete: only the EOS may follow
    assert grammar.first_forbidden([0, 7]) == 1  # EOS before the grammar is complete
    assert grammar.first_forbidden([0, 1, 7, 4]) is None  # nothing after an accepted EOS is read
    # Checking moved nothing: the matcher still expects the first letter.
    assert grammar.allowed([], 1, V)[0].nonzero().flatten().tolist() == [0, 1]
    assert grammar.advance([1, 0]) and grammar.first_forbidden([7]) is None


def test_a_constraint_compiles_once_and_each_request_advances_its_own_copy(monkeypatch):
    compiler = GrammarCompiler(char_tokenizer(), V, [7])
    calls, real = [], structured.compile_grammar
    monkeypatch.setattr(structured, "compile_grammar", lambda spec: calls.append(spec) or real(spec))
    spec = StructuredOutput(kind="regex", value="[ab]{2}")
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert len(calls) == 1
    assert first.advance([0]) and first.first_forbidden([2]) == 0  # a then c: forbidden
    # The second copy did not move with the first: it still expects the first letter.
    assert second.allowed([], 1, V)[0].nonzero().flatten().tolist() == [0, 1]
    assert compiler.compile(spec).allowed([], 1, V)[0].nonzero().flatten().tolist() == [0, 1]
    compiler.compile(StructuredOutput(kind="regex", value="[cd]"))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="invalid regex"):
        compiler.compile(StructuredOutput(kind="regex", value="[a"))
    with pytest.raises(ValueError, match="invalid regex"):  # refused again, not served from the cache
        compiler.compile(StructuredOutput(kind="regex", value="[a"))


def test_forbidden_drafts_are_cut_from_the_forward_and_output_stays_plain(tiny8):
    """A drafter whose every token the grammar forbids: each structured request's forward carries its
    anchor alone (1 token, not 1 + k), its unconstrained neighbour the whole block, and the greedy
    output is plain constrained decoding's."""
    path, _ = tiny8
    regex = StructuredOutput(kind="regex", value="[ab]{6}")
    structured = SamplingParams(temperature=0.0, max_tokens=10, structured=regex)
    free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 5, 2, 7], [3, 3, 1], [6, 0, 4, 4, 1]]
    plain = engine_on(path, NoDrafter(), "none", char_tokenizer())
    expected = plain.generate(prompts + [prompts[0]], [structured] * 3 + [free])
    engine = engine_on(path, ConstantDrafter([4, 4, 4]), "static:3", char_tokenizer())  # 4 = e
    carried: list[list[int]] = []
    run = engine.runner.run

    def recording_run(plan, draft_tokens, layers):
        if plan.decodes:
            carried.append([len(d) for d in draft_tokens])
        return run(plan, draft_tokens, layers)

    engine.runner.run = recording_run
    got = engine.generate(prompts + [prompts[0]], [structured] * 3 + [free])
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for r in got[:3]:
        body = r.text.rstrip("ch")  # c and h are the model's EOS ids
        assert r.finish_reason == "stop" and len(body) == 6 and set(body) <= {"a", "b"}, r.text
        # One forbidden draft verified (and rejected) per round; nothing else drafted.
        assert r.stats.draft_tokens == r.stats.rounds and r.stats.accepted_tokens == 0
    steps_with_all_four = [c for c in carried if len(c) == 4]
    assert steps_with_all_four and all(c[:3] == [0, 0, 0] for c in steps_with_all_four), carried
    assert max(c[3] for c in steps_with_all_four) == 3, carried  # the neighbour is not cut


def test_a_grammar_failure_after_the_cut_fails_that_request_alone(tiny8):
    """The grammar check cuts the forward, then the mask computation fails: that request ends with
    an error (it cannot accept the draft its forward never carried), its neighbour is unharmed."""
    path, _ = tiny8
    engine = engine_on(path, ConstantDrafter([4, 4, 4]), "static:3", char_tokenizer())
    regex = StructuredOutput(kind="regex", value="[ab]{6}")
    # Without its masks the bias makes the forbidden draft (e) the target's choice.
    biased = SamplingParams(temperature=0.0, max_tokens=10, structured=regex, logit_bias={4: 100.0})
    broken = engine.add_request([1, 5, 2], biased)
    fine = engine.add_request([3, 3, 1], SamplingParams(temperature=0.0, max_tokens=10, structured=regex))

    def failing_allowed(*args):
        raise RuntimeError("simulated mask failure")

    outputs = engine.step()  # the prompts, and the first tokens under working masks
    engine.requests[broken].grammar.allowed = failing_allowed
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = {o.request_id: o for o in outputs if o.finished}
    assert final[broken].finish_reason == "error" and "simulated" in final[broken].error
    assert final[fine].finish_reason == "stop" and final[fine].num_output_tokens == 7


def test_cutting_forbidden_drafts_changes_no_sampled_token(tiny8, monkeypatch):
    """Seeded sampling, drafts drawn uniformly (most of them forbidden): every token is the one the
    uncut forward gives. The cut keeps each forbidden draft's residual (drawing from the target row
    itself instead changes tokens). An unconstrained neighbour keeps the block width, and so the
    seeded draws, the same in both runs."""
    path, _ = tiny8
    prompt = [1, 5, 2, 7]
    regex = StructuredOutput(kind="regex", value=REGEX)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6, structured=regex) for i in range(48)]
    params.append(SamplingParams(temperature=1.0, seed=99, max_tokens=80, ignore_eos=True))

    def run():
        engine = engine_on(path, DistributionDrafter(torch.zeros(2, V)), "static:2", char_tokenizer())
        return engine.generate([prompt] * len(params), params)

    cut = run()
    monkeypatch.setattr(drafting, "cut_at_grammars", lambda decodes, tokens, lengths: (lengths, lengths))
    uncut = run()
    assert [r.token_ids for r in cut] == [r.token_ids for r in uncut]
    drafted = [sum(r.stats.draft_tokens for r in results[:-1]) for results in (cut, uncut)]
    assert drafted[0] < drafted[1], drafted  # the cut verified fewer drafts


SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 10}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "temps": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        },
        "required": ["city", "temps"],
        "additionalProperties": False,
    },
]


FIELDS = {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10},
    "active": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 4},
}


def many_schemas(count: int = 30) -> list[dict]:
    """Objects of 1-3 fields (strings, bounded numbers, booleans, enums, arrays), a third of them
    nested one level; bounded so that every one can finish within the token budget."""
    names = list(FIELDS)
    schemas = []
    for i in range(count):
        chosen = [names[(i + j * 3) % len(names)] for j in range(1 + i % 3)]
        chosen = list(dict.fromkeys(chosen))
        obj = {
            "type": "object",
            "properties": {n: FIELDS[n] for n in chosen},
            "required": chosen,
            "additionalProperties": False,
        }
        if i % 3 == 2:
            obj = {
                "type": "object",
                "properties": {"item": obj, "count": FIELDS["age"]},
                "required": ["item", "count"],
                "additionalProperties": False,
            }
        schemas.append(obj)
    return schemas


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    plain = engine_on(smollm_dir, NoDrafter(), "none", tokenizer, max_num_seqs=8)
    return plain, tokenizer


def test_greedy_constrained_speculation_equals_plain_and_validates(smollm):
    plain, tokenizer = smollm
    prompt = encode_prompt(tokenizer, "Describe a person, a colour and a city as JSON.")
    constraints = [StructuredOutput(kind="json_schema", value=json.dumps(s)) for s in SCHEMAS]
    constraints += [
        StructuredOutput(kind="regex", value=r"(yes|no), because [a-z ]{1,20}\."),
        StructuredOutput(kind="choice", value=json.dumps(["Paris", "London", "Rome"])),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured=c) for c in constraints]
    expected = [plain.generate([prompt], p)[0] for p in params]
    spec = sibling_engine(plain, NgramDrafter(4), _policy("static:4"))
    got = spec.generate([prompt] * len(params), params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for schema, r in zip(SCHEMAS, got, strict=False):
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)
    assert got[4].text in ("Paris", "London", "Rome")
    assert sum(r.stats.draft_tokens for r in got) > 0


def test_thirty_schemas_validate_with_and_without_speculation(smollm):
    plain, tokenizer = smollm
    schemas = many_schemas()
    prompt = encode_prompt(tokenizer, "Fill in a JSON record.")
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=128,
            structured=StructuredOutput(kind="json_schema", value=json.dumps(s)),
        )
        for s in schemas
    ]
    expected = plain.generate([prompt] * len(params), params)
    got = sibling_engine(plain, NgramDrafter(4), _policy("static:4")).generate([prompt] * len(params), params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for schema, r in zip(schemas, got, strict=True):
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)
    assert sum(r.stats.draft_tokens for r in got) > 0


def test_invalid_constraints_are_refused_before_queueing(smollm):
    plain, _ = smollm
    for kind, value, needle in [
        ("regex", "[ab", "unclosed"),
        ("json_schema", '{"type": "objectx"}', "objectx"),
        ("json_schema", "{not json", "json_schema"),
        ("grammar", "start: foo", "foo"),
    ]:
        with pytest.raises(ValueError, match=needle):
            plain.add_request([1, 2], SamplingParams(structured=StructuredOutput(kind=kind, value=value)))
    assert not plain.has_unfinished_requests()


def test_a_grammar_failure_fails_that_request_alone(smollm):
    plain, tokenizer = smollm
    prompt = encode_prompt(tokenizer, "Say something.")
    engine = sibling_engine(plain, NgramDrafter(4), _policy("static:4"))
    regex = StructuredOutput(kind="regex", value="[a-z ]{1,30}")
    broken = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, structured=regex))
    fine = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20))

    class BrokenMatcher:
        def __getattr__(self, name):
            raise RuntimeError("simulated library failure")

    engine.requests[broken].grammar.matcher = BrokenMatcher()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = {o.request_id: o for o in outputs if o.finished}
    assert final[broken].finish_reason == "error" and "simulated" in final[broken].error
    assert final[fine].finish_reason in ("stop", "length") and final[fine].num_output_tokens > 1


def _policy(spec: str):
    from dspark.policies.factory import build_policy

    return build_policy(spec)
