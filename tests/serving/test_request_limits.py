"""Limits at the edge: body size (413), stop strings, messages, logit_bias, choices and v2 inputs
(400 naming the field), text that is not Unicode, and tokenizing off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from dspark.serving.auth import BearerAuth
from dspark.serving.openai_routes import build_openai_app
from starlette.testclient import TestClient

from tests.serving.conftest import make_replica
from tests.serving.fake_engine import CharTokenizer, FakeEngine

LIMITS = dict(
    max_body_bytes=4096,
    max_messages=3,
    max_stop_strings=2,
    max_stop_chars=8,
    max_logit_bias=2,
    max_choices=4,
    max_v2_inputs=3,
)
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}


def app_of(replica):
    return build_openai_app(
        replica.service,
        BearerAuth(None),
        ready=replica.ready,
        metrics=replica.metrics_text,
        max_body_bytes=replica.config.max_body_bytes,
    )


@pytest.fixture(scope="module")
def replica():
    r = make_replica(FakeEngine(max_num_seqs=8), max_output_tokens=16, **LIMITS)
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def client(replica):
    with TestClient(app_of(replica), raise_server_exceptions=False) as c:
        yield c


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_body_over_the_limit_is_413_whether_announced_or_chunked(client):
    big = {**COMPLETION, "prompt": "x" * 5000}
    err = error(client.post("/v1/completions", json=big), 413)
    assert "max_body_bytes" in err["message"] and err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit cuts the body off while it is read
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 1000):
            yield payload[i : i + 1000]

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "max_body_bytes" in error(r, 413)["message"]
    near = {**COMPLETION, "metadata": {f"k{i}": "x" * 500 for i in range(7)}}  # 3.6 kB of 4 kB
    assert client.post("/v1/completions", json=near).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {**COMPLETION, "stop": ["a", "b", "c"]}, "stop", "3 stop strings"),
        ("/v1/completions", {**COMPLETION, "stop": "x" * 9}, "stop", "9 characters"),
        ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 4}, "messages", "4 messages"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "3 "),
        ("/v1/completions", {**COMPLETION, "n": 5}, "n", "5 choices"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"], "n": 2}, "n", "6 choices"),
    ],
)
def test_over_a_request_limit_is_400_naming_the_field(client, path, body, param, needle):
    err = error(client.post(path, json=body), 400)
    assert err["param"] == param and needle in err["message"], err


def test_at_the_limits_is_served(client):
    body = {**COMPLETION, "stop": ["zzzzzzzz", "y"], "logit_bias": {"1": 1, "2": -1}, "n": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {**CHAT, "messages": CHAT["messages"] * 3}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize(
    ("path", "raw", "where"),
    [
        ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "a \ud800 b"}]}, "content"),
        ("/v1/completions", COMPLETION | {"prompt": ["ok", "\udfff"]}, "prompt.1"),
        ("/v1/completions", COMPLETION | {"stop": ["\ud800"]}, "stop"),
        ("/v1/completions", COMPLETION | {"metadata": {"\ud801": "x"}}, "metadata"),
    ],
)
def test_a_lone_surrogate_is_400_naming_where(client, path, raw, where):
    # json.dumps escapes the surrogate as `\ud800`, valid JSON that decodes to no Unicode text.
    r = client.post(path, content=json.dumps(raw), headers={"content-type": "application/json"})
    err = error(r, 400)
    assert "lone surrogate" in err["message"] and where in err["message"], err
    assert client.post(path, json=CHAT if "messages" in raw else COMPLETION).status_code == 200


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30, "1e20"])
def test_top_k_beyond_int32_is_400(client, top_k):
    raw = json.dumps({**CHAT}).removesuffix("}") + f', "top_k": {top_k}' + "}"
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert error(r, 400)["param"] == "top_k"


def test_v2_inputs_over_the_limit_are_400(replica):
    reply = asyncio.run(replica.infer_v2(["a", "b", "c", "d"], {"max_tokens": 2}))
    assert reply.status == 400 and "4 input strings" in reply.body["error"]
    texts = asyncio.run(replica.infer_v2(["a", "b", "c"], {"max_tokens": 2}))
    assert len(texts) == 3 and all(isinstance(t, str) and t for t in texts)
    reply = asyncio.run(replica.infer_v2(["a \ud800"], {"max_tokens": 2}))
    assert reply.status == 400 and "lone surrogate" in reply.body["error"]


def test_a_v2_request_refused_for_one_input_aborts_the_others():
    """Two slots and no queue: of three inputs, one gets 429 and the two admitted are aborted."""
    engine = FakeEngine(max_num_seqs=2, step_delay_s=0.05)  # 200 tokens: 5 s or more
    r = make_replica(engine, max_queue=0, max_output_tokens=200)
    try:

        async def main():
            return await r.infer_v2(["a", "b", "c"], {"max_tokens": 200, "ignore_eos": True})

        t = time.monotonic()
        reply = asyncio.run(main())
        assert reply.status == 429 and time.monotonic() - t < 2, "the 429 waited for the other inputs"
        deadline = time.monotonic() + 2
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished_requests(), "the admitted inputs kept running"
        assert r.client.in_flight == 0
    finally:
        r.shutdown()


class SlowTokenizer(CharTokenizer):
    """Tokenizing takes 1.5 s (a huge prompt), holding its thread but releasing the GIL."""

    def __init__(self):
        self.started = threading.Event()

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        self.started.set()
        time.sleep(1.5)
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_tokenizing_runs_off_the_event_loop():
    engine = FakeEngine()
    engine.tokenizer = SlowTokenizer()
    r = make_replica(engine, max_output_tokens=16)
    try:

        async def main():
            transport = httpx.ASGITransport(app=app_of(r))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                t = time.monotonic()
                slow = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))
                while not engine.tokenizer.started.is_set():
                    await asyncio.sleep(0.01)
                health = await c.get("/health")
                probe_s = time.monotonic() - t
                return (await slow).status_code, health.status_code, probe_s

        chat, health, probe_s = asyncio.run(main())
        assert chat == 200 and health == 200
        assert probe_s < 0.75, f"/health waited {probe_s:.2f} s behind a request's chat template"
    finally:
        r.shutdown()


def test_json_nested_deeper_than_the_limit_is_400(client):
    schema: dict = {"type": "string"}
    for _ in range(300):  # 300 levels of nesting (a deeper body cannot be pickled to a replica)
        schema = {"a": schema}
    body = {
        **CHAT,
        "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": schema}},
    }
    err = error(client.post("/v1/chat/completions", json=body), 400)
    assert "nested deeper than 256 levels" in err["message"]
