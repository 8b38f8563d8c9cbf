"""Acceptance tests against the real server (real engine, Ray Serve on loopback), in both front ends.

Driven with the official `openai` client. The module starts Ray once and one server per front end
(standalone Ray Serve ingress, then KServe's ModelServer over the Serve deployment), and stops
everything at the end.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from dspark.serving.metrics import METRIC_NAMES
from prometheus_client.parser import text_string_to_metric_families

from tests.serving.live_server import API_KEY, LiveServer, start

pytestmark = [pytest.mark.slow, pytest.mark.real_server]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module", params=["ray", "kserve"])
def server(request):
    from dspark.serving.runtime import shutdown

    live = start(request.param)
    try:
        yield live
    finally:
        live.stop()
        if request.param == "kserve":  # the last front end: stop Ray too
            shutdown()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.openai_base, api_key=API_KEY, max_retries=0, timeout=120)


def metrics(server: LiveServer) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.base + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def test_completion_usage_matches_tokens(client, server):
    r = client.completions.create(
        model=server.model,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text and r.usage.completion_tokens == len(lp.tokens) <= 6
    assert r.usage.prompt_tokens == 5 and r.usage.total_tokens == 5 + r.usage.completion_tokens
    assert all(t.startswith("token_id:") for t in lp.tokens) and all(v <= 0 for v in lp.token_logprobs)
    stream = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPTS[0],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    assert stream[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_stream_and_not(client, server):
    msgs = [{"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = full.choices[0].message.content
    assert content and full.usage.completion_tokens == len(full.choices[0].logprobs.content) <= 6
    assert all(len(t.top_logprobs) == 2 for t in full.choices[0].logprobs.content)
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=msgs,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == [server.model]


def test_concurrent_streams_are_independent_and_equal_solo_outputs(client, server):
    solo = {
        p: client.completions.create(model=server.model, prompt=p, max_tokens=6, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    }
    aclient = openai.AsyncOpenAI(base_url=server.openai_base, api_key=API_KEY, max_retries=0, timeout=300)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(
            model=server.model, prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(PROMPTS[i % 4]) for i in range(16)))
        finally:
            await aclient.close()

    texts = asyncio.run(main())
    assert texts == [solo[PROMPTS[i % 4]] for i in range(16)]


def test_disconnects_free_slots_and_memory_stays_bounded(server):
    body = {
        "model": server.model,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 64,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
    }
    # Each request would run 64 tokens; every client leaves after its first event.

    async def drop_after_first_event(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", server.openai_base + "/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                break

    async def rounds(n: int) -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            for _ in range(n // 16):
                await asyncio.gather(*(drop_after_first_event(c) for _ in range(16)))

    def settle() -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = metrics(server)
            if m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0:
                return m
            time.sleep(0.5)
        raise AssertionError("requests still running after their clients left")

    # 208 abandoned requests on the standalone server; the KServe path (same replica code) gets 48.
    warmup, measured = (48, 160) if server.mode == "ray" else (16, 32)
    start = metrics(server)[("vllm:generation_tokens_total", ())]
    asyncio.run(rounds(warmup))
    settled = settle()
    before = settled[("process_resident_memory_bytes", ())]
    engine_rss = ("dspark_engine_process_resident_memory_bytes", ())
    engine_before = settled.get(engine_rss)
    asyncio.run(rounds(measured))
    settled = settle()
    after = settled[("process_resident_memory_bytes", ())]
    total = warmup + measured
    generated = settled[("vllm:generation_tokens_total", ())] - start
    assert generated < total * 64 / 4, (
        f"{generated} tokens for {total} abandoned requests: aborts did not stop them"
    )
    assert after - before < 64 * 2**20, (
        f"replica RSS grew {(after - before) / 2**20:.0f} MiB over {measured} requests"
    )
    # The standalone front end runs the engine in its own process: its memory is exported too.
    assert (engine_before is not None) == (server.mode == "ray")
    if engine_before is not None:
        grew = settled[engine_rss] - engine_before
        assert grew < 64 * 2**20, f"engine RSS grew {grew / 2**20:.0f} MiB over {measured} requests"


def test_over_capacity_gets_429_quickly_and_server_survives(server):
    body = {"model": server.model, "prompt": "Count: 1, 2, 3,", "max_tokens": 4, "temperature": 0}

    async def timed(c: httpx.AsyncClient) -> tuple[int, float, str | None]:
        t = time.monotonic()
        r = await c.post(server.openai_base + "/completions", json=body, headers=AUTH)
        return r.status_code, time.monotonic() - t, r.headers.get("retry-after")

    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(timed(c) for _ in range(40)))

    results = asyncio.run(main())
    codes = [code for code, _, _ in results]
    assert set(codes) <= {200, 429} and codes.count(200) >= 16 and codes.count(429) >= 1
    rejected = [(dt, ra) for code, dt, ra in results if code == 429]
    assert all(dt < 5.0 and ra == "1" for dt, ra in rejected)
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    assert (
        httpx.post(server.openai_base + "/completions", json=body, headers=AUTH, timeout=120).status_code
        == 200
    )


def test_api_key_required_and_rejected_requests_never_reach_the_engine(server):
    before = metrics(server)
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.openai_base + "/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.openai_base, api_key="wrong", max_retries=0).models.list()
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.base + probe, timeout=30).status_code == 200
    after = metrics(server)
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total"):
        assert after[(name, ())] == before[(name, ())]


BAD_BODIES = [
    {"model": "smollm2-135m", "prompt": "x", "max_tokens": -1},
    {"model": "smollm2-135m", "prompt": "x", "max_tokens": 10**9},
    {"model": "smollm2-135m", "prompt": "x", "temperature": -1},
    {"model": "smollm2-135m", "prompt": "x", "top_p": 2},
    {"model": "smollm2-135m", "prompt": "x", "unknown_field": True},
    {"model": "no-such-model", "prompt": "x"},
    {"model": "smollm2-135m", "prompt": "word " * 600},
    {"model": "smollm2-135m", "prompt": [999999999]},
]


def test_bad_input_is_4xx_with_openai_error(server):
    for body in BAD_BODIES:
        r = httpx.post(server.openai_base + "/completions", json=body, headers=AUTH, timeout=30)
        assert 400 <= r.status_code < 500 and set(r.json()["error"]) >= {
            "message",
            "type",
            "param",
            "code",
        }, body
    bad_chat = [
        {"model": server.model, "messages": []},
        {"model": server.model, "messages": [{"role": "user"}]},
        {"model": server.model, "messages": [{"role": "user", "content": 5}]},
    ]
    for body in bad_chat:
        r = httpx.post(server.openai_base + "/chat/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400, body
    r = httpx.post(server.openai_base + "/chat/completions", content=b"{not json", headers=AUTH, timeout=30)
    assert r.status_code == 400 and "error" in r.json()


def test_metrics_names_and_spec_decode_counters_add_up(server):
    m = metrics(server)
    names = {name for name, _ in m}
    for name in METRIC_NAMES:
        assert any(n == name or n.startswith(name + "_") for n in names), name
    draft = m[("vllm:spec_decode_num_draft_tokens_total", ())]
    accepted = m[("vllm:spec_decode_num_accepted_tokens_total", ())]
    per_pos = sum(v for (n, _), v in m.items() if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert draft > 0 and accepted <= draft and per_pos == accepted
    assert m[("vllm:generation_tokens_total", ())] > 0 and m[("vllm:num_requests_running", ())] == 0


def test_a_chat_turn_reports_the_prefix_it_reused(client, server):
    """The second turn resends the first: usage says how much of it came from the prefix cache, as
    much as /metrics counted."""
    chat = [{"role": "user", "content": "List ten colours of the rainbow and of the sea, one per line."}]
    first = client.chat.completions.create(model=server.model, messages=chat, max_tokens=8, temperature=0)
    chat += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now the first three again."},
    ]
    before = metrics(server).get(("vllm:prefix_cache_hits_total", ()), 0.0)
    second = client.chat.completions.create(model=server.model, messages=chat, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 and cached % 16 == 0
    assert metrics(server)[("vllm:prefix_cache_hits_total", ())] - before == cached


@pytest.mark.parametrize("server", ["kserve"], indirect=True)
def test_kserve_v2_round_trip(server):
    assert httpx.get(server.base + "/v2/health/live", timeout=10).status_code == 200
    assert httpx.get(server.base + "/v2/health/ready", timeout=10).status_code == 200
    meta = httpx.get(f"{server.base}/v2/models/{server.model}", headers=AUTH, timeout=10).json()
    assert meta["inputs"][0]["name"] == "text_input" and meta["outputs"][0]["datatype"] == "BYTES"
    req = {
        "inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": PROMPTS[:2]}],
        "parameters": {"max_tokens": 5, "temperature": 0},
    }
    r = httpx.post(f"{server.base}/v2/models/{server.model}/infer", json=req, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "text_output" and len(out["data"]) == 2 and all(out["data"])
    solo = openai.OpenAI(base_url=server.openai_base, api_key=API_KEY, max_retries=0).completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=5, temperature=0
    )
    assert out["data"][0] == solo.choices[0].text
    assert (
        httpx.post(f"{server.base}/v2/models/{server.model}/infer", json=req, timeout=30).status_code == 401
    )
    bad = {**req, "parameters": {"max_tokens": -4}}
    r = httpx.post(f"{server.base}/v2/models/{server.model}/infer", json=bad, headers=AUTH, timeout=30)
    assert r.status_code == 400


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# The hostile requests of the input-robustness table, each otherwise a valid chat request:
# (what it changes, the answers it may get).
HOSTILE = [
    ({"top_k": 1e20}, {400}),
    ({"top_k": 2**63}, {400}),
    ({"top_k": 10**6}, {200}),  # legal: the vocabulary size or more is off
    ({"messages": [{"role": "user", "content": "a \ud800 b"}]}, {400}),
    ({"stop": ["x" * 5_000_000]}, {413}),
    ({"stop": ["x" * 5_000]}, {400}),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, {400}),
    ({"messages": [{"role": "user", "content": "hi"}] * 2049}, {400}),
    ({"seed": 2**64}, {400}),
    ({"logit_bias": {"49152": 5}}, {400}),  # one past SmolLM2's vocabulary
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "d", "schema": _nested_schema(400)},
            }
        },
        {400},
    ),
]


def test_hostile_requests_are_4xx_and_the_server_keeps_serving(server):
    """One server, every hostile request in turn, each followed by a normal request that gets 200."""
    normal = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    url = server.openai_base + "/chat/completions"
    with httpx.Client(timeout=120, headers=AUTH) as c:
        for change, answers in HOSTILE:
            # json.dumps escapes a lone surrogate as `\ud800`, which is what a hostile client sends.
            body = json.dumps({**normal, "temperature": 0.5, **change})
            r = c.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code in answers, (list(change), r.status_code, r.text[:300])
            if r.status_code != 200:
                assert "error" in r.json() or "detail" in r.json()
            after = c.post(url, json=normal)
            assert after.status_code == 200, (list(change), after.text[:300])
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
        if server.mode == "kserve":
            infer = f"{server.base}/v2/models/{server.model}/infer"

            def v2(texts, **params):
                inputs = [{"name": "text_input", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]
                body = json.dumps({"inputs": inputs, "parameters": {"max_tokens": 2, **params}})
                return c.post(infer, content=body, headers={"content-type": "application/json"})

            assert v2(["a \ud800 b"]).status_code == 400
            assert v2(["hi"], top_k=2**63).status_code == 400
            assert v2(["hi"] * 65).status_code == 400
            assert v2(["hi"]).status_code == 200


def test_tokenizer_routes_behind_the_key(server):
    """/tokenize and /detokenize beside the OpenAI routes (under /openai with KServe), key required."""
    root = server.openai_base.removesuffix("/v1")
    body = {"model": server.model, "prompt": PROMPTS[0]}
    assert httpx.post(root + "/tokenize", json=body, timeout=30).status_code == 401
    r = httpx.post(root + "/tokenize", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    usage = openai.OpenAI(base_url=server.openai_base, api_key=API_KEY, max_retries=0).completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=1
    )
    assert r.json()["count"] == len(ids) == usage.usage.prompt_tokens
    back = httpx.post(root + "/detokenize", json={"tokens": ids}, headers=AUTH, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": PROMPTS[0]}
