"""The OpenAI API over a fake engine, in this process: formats, validation, auth, metrics."""

import json

import openai
import pytest
from dspark.serving.metrics import METRIC_NAMES
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.conftest import make_client, make_replica
from tests.serving.fake_engine import CharTokenizer, FakeEngine

TOK = CharTokenizer()


def expected_text(prompt: str, n: int) -> str:
    engine = FakeEngine()
    from dspark.engine.sampling_params import SamplingParams

    engine.add_request(TOK.encode(prompt), SamplingParams(max_tokens=n, temperature=0))
    ids = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            ids += o.new_token_ids
    return TOK.decode(ids)


def oai(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def test_completion_and_usage(shared_client):
    r = oai(shared_client).completions.create(model="fake-model", prompt="Hello", max_tokens=9, temperature=0)
    assert r.choices[0].text == expected_text("Hello", 9)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 9, 14)
    assert r.object == "text_completion" and r.model == "fake-model"


def test_streamed_completion_equals_non_streamed(shared_client):
    c = oai(shared_client)
    chunks = list(
        c.completions.create(
            model="fake-model",
            prompt="Hello",
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected_text("Hello", 9)
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].choices == []
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_stream_and_not(shared_client):
    c = oai(shared_client)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    full = c.chat.completions.create(model="fake-model", messages=msgs, max_tokens=7, temperature=0)
    prompt = TOK.apply_chat_template(msgs)
    assert full.choices[0].message.content == expected_text(prompt, 7)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(TOK.encode(prompt)) and full.usage.completion_tokens == 7
    stream = list(
        c.chat.completions.create(
            model="fake-model",
            messages=msgs,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        == full.choices[0].message.content
    )
    assert stream[-1].usage.total_tokens == full.usage.total_tokens


def test_seeded_sampling_is_reproducible(shared_client):
    c = oai(shared_client)
    a = c.completions.create(model="fake-model", prompt="x", max_tokens=8, temperature=0.9, seed=42)
    b = c.completions.create(model="fake-model", prompt="x", max_tokens=8, temperature=0.9, seed=42)
    assert a.choices[0].text == b.choices[0].text


def test_stop_string(shared_client):
    text = expected_text("Hello", 20)
    stop = text[5]  # one character: the fake engine does not hold back partial stop matches
    r = oai(shared_client).completions.create(
        model="fake-model", prompt="Hello", max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]


def test_completion_logprobs_and_token_ids(shared_client):
    r = oai(shared_client).completions.create(
        model="fake-model", prompt="Hello", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == [-0.25] * 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [0, 1, 2, 3]
    r2 = shared_client.post(
        "/v1/completions",
        json={
            "model": "fake-model",
            "prompt": [40, 41],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    tokens = r2.json()["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens) and len(tokens) == 3


def test_chat_logprobs(shared_client):
    r = oai(shared_client).chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob == -0.25 for t in content)


def test_models(shared_client):
    data = oai(shared_client).models.list().data
    assert [m.id for m in data] == ["fake-model"]


BAD = [
    ("/v1/completions", b'{"model": "fake-model", "prompt": ', "malformed"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": "fake-model", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": [10**6]}, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x" * 300}, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "stop": [""]}, "stop"),
    (
        "/v1/completions",
        {"model": "fake-model", "prompt": "x", "stream_options": {"include_usage": True}},
        "stream",
    ),
    ("/v1/chat/completions", {"model": "fake-model", "messages": []}, "messages"),
    (
        "/v1/chat/completions",
        {"model": "fake-model", "messages": [{"role": "user", "content": ""}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]},
        "role",
    ),
    ("/v1/chat/completions", {"model": "fake-model", "messages": "hello"}, "messages"),
    (
        "/v1/chat/completions",
        {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        "logprobs",
    ),
    ("/v1/chat/completions", [1, 2, 3], "body"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD)
def test_bad_input_gets_400_with_openai_error(shared_client, path, body, needle):
    if isinstance(body, bytes):
        r = shared_client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = shared_client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in (err["message"] + str(err.get("param"))).lower() or needle == "malformed"
    assert err["type"] == "BadRequestError"


def test_unknown_model_is_404_and_openai_client_raises(shared_client):
    with pytest.raises(openai.NotFoundError):
        oai(shared_client).completions.create(model="gpt-9", prompt="x", max_tokens=2)
    r = shared_client.get("/v1/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_api_key_guards_inference_but_not_probes():
    engine = FakeEngine()
    replica = make_replica(engine)
    try:
        with make_client(replica, api_key="s3cret") as c:
            body = {"model": "fake-model", "prompt": "x", "max_tokens": 2}
            assert c.post("/v1/completions", json=body).status_code == 401
            wrong = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models").status_code == 401
            assert engine.steps == 0 and engine._owner is None  # nothing reached the engine
            for probe in ("/health", "/ready", "/metrics"):
                assert c.get(probe).status_code == 200
            ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(
                    base_url="http://testserver/v1", api_key="bad", http_client=c, max_retries=0
                ).models.list()
    finally:
        replica.shutdown()


def test_ready_follows_the_engine_loop():
    replica = make_replica(FakeEngine())
    try:
        with make_client(replica) as c:
            assert c.get("/ready").json() == {"ready": True}
            replica.loop.stop(0.0)
            assert c.get("/ready").status_code == 503
    finally:
        replica.shutdown()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_metrics_exposed_and_consistent(client):
    c = oai(client)
    for i in range(3):
        c.completions.create(model="fake-model", prompt=f"p{i}", max_tokens=10, temperature=0)
    text = client.get("/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    s = _samples(text)
    draft = s[("vllm:spec_decode_num_draft_tokens_total", ())]
    accepted = s[("vllm:spec_decode_num_accepted_tokens_total", ())]
    per_pos = sum(
        v for (n, labels), v in s.items() if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    )
    assert 0 < accepted <= draft and per_pos == accepted
    assert s[("vllm:generation_tokens_total", ())] == 30
    assert s[("vllm:prompt_tokens_total", ())] == 6
    assert s[("vllm:e2e_request_latency_seconds_count", ())] == 3
    assert s[("vllm:time_to_first_token_seconds_count", ())] == 3
    assert s[("vllm:num_requests_running", ())] == 0
    assert s[("dspark_verify_budget_count", ())] > 0 and s[("dspark_sps_estimate", ())] == pytest.approx(
        100.0
    )
    assert s[("dspark_confidence_calibration_error", ())] == pytest.approx(0.1 * accepted / draft)


def test_sse_wire_format(shared_client):
    with shared_client.stream(
        "POST",
        "/v1/completions",
        json={"model": "fake-model", "prompt": "ab", "max_tokens": 4, "temperature": 0, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"
