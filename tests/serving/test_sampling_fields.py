"""The OpenAI fields beyond the basics: penalties, min_p, logit_bias, n, prompt lists, echo,
metadata, refused fields, per-request speculation and its figures. Over the fake engine (fields
reach the engine as asked) and over the real engine on a tiny target (they change the output as
asked; the figures add up to the Prometheus counters)."""

from __future__ import annotations

import json

import openai
import pytest
from dspark.drafters.ngram import NgramDrafter
from dspark.engine.sampling_params import SamplingParams
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import write_tiny_model
from tests.engine.helpers import engine_on
from tests.serving.conftest import make_client, make_replica
from tests.serving.fake_engine import CharTokenizer

TOK = CharTokenizer()


def oai(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def test_sampling_fields_reach_the_engine(fake):
    engine, client = fake
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "repetition_penalty": 1.3,
            "min_p": 0.1,
            "logit_bias": {"7": 3.5, "9": -100},
            "speculative": {"max_draft_tokens": 2},
            "metadata": {"team": "search"},
            "store": False,
            "service_tier": "auto",
            "parallel_tool_calls": True,
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "user": "u-1",
        },
    )
    assert r.status_code == 200, r.text
    (_, params) = engine.received[-1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.3)
    assert params.min_p == 0.1 and params.logit_bias == {7: 3.5, 9: -100.0}
    assert params.max_draft_tokens == 2
    client.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": "x", "max_tokens": 2, "speculative": {"enabled": False}},
    )
    assert engine.received[-1][1].max_draft_tokens == 0


def test_n_samples_get_derived_seeds_and_openai_indices(fake):
    engine, client = fake
    r = oai(client).completions.create(
        model="fake-model", prompt=["ab", "cde"], n=3, max_tokens=5, temperature=1.0, seed=40
    )
    assert [c.index for c in r.choices] == list(range(6))
    received = engine.received[-6:]
    assert [len(ids) for ids, _ in received] == [2, 2, 2, 3, 3, 3]  # prompt-major, as the indices
    assert [p.seed for _, p in received] == [40, 41, 42, 40, 41, 42]
    again = oai(client).completions.create(
        model="fake-model", prompt=["ab", "cde"], n=3, max_tokens=5, temperature=1.0, seed=40
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    assert len({c.text for c in r.choices[:3]}) > 1
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 30
    chat = oai(client).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3, temperature=0
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same


def test_prompt_list_choices_equal_single_prompt_requests(fake):
    _, client = fake
    c = oai(client)
    prompts = ["Hello", "abc", "zz top"]
    batch = c.completions.create(model="fake-model", prompt=prompts, max_tokens=6, temperature=0)
    single = [
        c.completions.create(model="fake-model", prompt=p, max_tokens=6, temperature=0) for p in prompts
    ]
    assert [ch.text for ch in batch.choices] == [s.choices[0].text for s in single]
    ids = c.completions.create(model="fake-model", prompt=[[40, 41], [42]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3


def test_streamed_choices_interleave_and_add_up(fake):
    _, client = fake
    c = oai(client)
    kwargs = dict(model="fake-model", prompt=["ab", "xyz"], n=2, max_tokens=7, temperature=0)
    full = c.completions.create(**kwargs)
    chunks = list(c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", "", ""]
    finished = set()
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [ch.text for ch in full.choices] and finished == {0, 1, 2, 3}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_echo_prefixes_the_prompt(fake):
    _, client = fake
    c = oai(client)
    plain = c.completions.create(model="fake-model", prompt="Hello", max_tokens=5, temperature=0)
    echoed = c.completions.create(model="fake-model", prompt="Hello", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text
    stream = c.completions.create(
        model="fake-model", prompt=[[40, 41]], max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream).startswith(TOK.decode([40, 41]))


REFUSED = [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
        "not both",
    ),
    ("/v1/completions", {"structured_outputs": {"regex": "a+", "choice": ["x"]}}, "exactly one"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "structured_outputs"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio"),
    ("/v1/completions", {"suffix": "!"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 1, "structured_outputs": {"regex": "a+"}}, "min_tokens"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"speculative": {"enabled": False, "max_draft_tokens": 2}}, "speculative"),
    ("/v1/completions", {"speculative": {"max_draft_tokens": -1}}, "max_draft_tokens"),
    ("/v1/completions", {"speculative": {"on": True}}, "speculative"),
    ("/v1/completions", {"metadata": {"k": 1}}, "metadata"),
]


@pytest.mark.parametrize(("path", "extra", "needle"), REFUSED, ids=[r[2] for r in REFUSED])
def test_unsupported_or_bad_fields_get_a_400_naming_them(fake, path, extra, needle):
    _, client = fake
    base = {"model": "fake-model", "max_tokens": 3}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "x"}
    r = client.post(path, json=base | extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] + str(err["param"]), err
    assert not err["message"].startswith("Value error")


def test_n_beyond_the_kv_cache_is_a_400_with_the_numbers(fake):
    _, client = fake
    r = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": ["ab", "cd"], "n": 5, "max_tokens": 6}
    )
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "10 sequences" in message and "80 tokens" in message and "holds 8 sequences" in message, message


def test_spec_stats_add_up_to_the_counters_over_the_fake_engine(fake):
    _, client = fake
    before = counters(client)
    body = client.post(
        "/v1/completions",
        json={
            "model": "fake-model",
            "prompt": ["ab", "c"],
            "n": 2,
            "max_tokens": 9,
            "return_spec_stats": True,
        },
    ).json()
    stats = body["spec_decode_stats"]
    after = counters(client)
    assert stats["draft_tokens"] == after["draft"] - before["draft"] > 0
    assert stats["accepted_tokens"] == after["accepted"] - before["accepted"]
    assert stats["tau"] == pytest.approx(1 + stats["accepted_tokens"] / stats["rounds"], abs=1e-4)
    events = client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
            "return_spec_stats": True,
        },
    ).text
    last = json.loads(events.strip().split("\n\n")[-2].removeprefix("data: "))
    assert last["choices"] == [] and last["spec_decode_stats"]["rounds"] > 0
    plain = client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 3}
    ).json()
    assert "spec_decode_stats" not in plain


def counters(client) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "vllm:spec_decode_num_draft_tokens_total":
                values["draft"] = sample.value
            elif sample.name == "vllm:spec_decode_num_accepted_tokens_total":
                values["accepted"] = sample.value
            elif sample.name == "vllm:spec_decode_num_drafts_total":
                values["drafts"] = sample.value
    return values


# ---- the real engine on a tiny target --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chars(tmp_path_factory):
    """A tiny random target over the character tokenizer's vocabulary."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tinychars") / "llama", "llama", seed=2, vocab_size=len(TOK)
    )


@pytest.fixture
def real(tiny_chars):
    engine = engine_on(tiny_chars, NgramDrafter(4), "static:3", TOK, max_num_seqs=8)
    replica = make_replica(engine, served_model_name="tiny", max_output_tokens=64)
    with make_client(replica) as c:
        yield engine, c
    replica.shutdown()


def complete(client, **fields) -> dict:
    r = client.post("/v1/completions", json={"model": "tiny", "temperature": 0, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_fields_change_the_real_output_as_the_engine_does(real, tiny_chars):
    _, client = real
    prompt = "abcabc"
    plain = engine_on(tiny_chars, NgramDrafter(4), "none", TOK)
    cases = [
        {"presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"repetition_penalty": 2.0},
        {"logit_bias": {str(TOK.encode("q")[0]): 100}},
    ]
    base = complete(client, prompt=prompt, max_tokens=16)["choices"][0]["text"]
    for fields in cases:
        got = complete(client, prompt=prompt, max_tokens=16, **fields)["choices"][0]["text"]
        params = {k: v for k, v in fields.items() if k != "logit_bias"}
        bias = {int(k): v for k, v in fields.get("logit_bias", {}).items()}
        want = plain.generate(
            [TOK.encode(prompt)],
            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=bias, **params),
        )[0].text
        assert got == want and got != base, fields
    assert got == "q" * 16


def test_speculation_off_in_a_mixed_batch_and_figures_add_up(real, tiny_chars):
    """Concurrent requests (one batch): speculation off reproduces plain decoding and verifies no
    draft; the response figures sum to the counters' increments."""
    import concurrent.futures

    _, client = real
    plain = engine_on(tiny_chars, NgramDrafter(4), "none", TOK)
    prompt = "abababab"
    want = plain.generate(
        [TOK.encode(prompt)], SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    )
    before = counters(client)
    bodies = [
        dict(prompt=prompt, max_tokens=24, temperature=0.8, seed=3, speculative={"enabled": False}),
        dict(prompt=prompt, max_tokens=24),
        dict(prompt="xyxyxyxy", max_tokens=24, speculative={"max_draft_tokens": 1}),
        dict(prompt=prompt, max_tokens=24, n=2, temperature=1.0, seed=9),
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda b: complete(client, return_spec_stats=True, **b), bodies))
    after = counters(client)
    stats = [r["spec_decode_stats"] for r in replies]
    assert replies[0]["choices"][0]["text"] == want[0].text
    assert stats[0]["draft_tokens"] == 0 and stats[0]["rounds"] == 23
    assert stats[1]["draft_tokens"] > 0 and stats[1]["accepted_tokens"] > 0
    assert 0 < stats[2]["draft_tokens"] <= stats[2]["rounds"]
    for key, counter in (("draft_tokens", "draft"), ("accepted_tokens", "accepted"), ("drafts", "drafts")):
        assert sum(s[key] for s in stats) == after[counter] - before[counter], key
