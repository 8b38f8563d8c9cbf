"""Two engine replicas (fake engines) behind the HTTP ingress deployment and the prefix-aware router,
on a real Ray Serve on loopback: a conversation's turns stay on one replica, a new conversation goes
to the other, and the router's metrics count what it matched."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import httpx
import pytest
import ray.cloudpickle as cloudpickle
from dspark.serving.config import ServeConfig
from dspark.serving.openai_schemas import ChatCompletionRequest
from dspark.serving.prefix_routing import block_hashes, prompt_key

import tests.serving.fake_engine as fake_engine_module
from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import _wait_ready, free_port

pytestmark = pytest.mark.real_server

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never repeat the question. "


class RecordingEngine(FakeEngine):
    """Appends `<replica pid> <prompt tokens>` for every request it takes to a file."""

    def __init__(self, log: str, **settings):
        super().__init__(**settings)
        self.log = log

    def add_request(self, prompt_token_ids, params, request_id=None, on_output=None) -> str:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {len(prompt_token_ids)}\n")
        return super().add_request(prompt_token_ids, params, request_id, on_output)


def recording_engine(config: object = None, log: str = "") -> RecordingEngine:
    return RecordingEngine(log, max_num_seqs=4, max_model_len=8192)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from dspark.serving.deployment import APP_NAME, openai_app
    from dspark.serving.runtime import start_ray
    from ray import serve

    log = tmp_path_factory.mktemp("routed") / "requests.log"
    log.touch()
    # The replicas need this file's engine: ship its modules with the factory.
    this = __import__(__name__, fromlist=["_"])
    for module in (this, fake_engine_module):
        cloudpickle.register_pickle_by_value(module)
    port = free_port()
    config = ServeConfig(
        port=port,
        num_replicas=2,
        num_cpus_per_replica=0.5,
        engine_in_thread=True,
        max_output_tokens=16,
        graceful_shutdown_timeout_s=1,
    )
    start_ray(num_cpus=2)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(
            openai_app(config, functools.partial(recording_engine, log=str(log))),
            name=APP_NAME,
            route_prefix="/",
        )
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base + "/ready", timeout_s=120)
        yield base, log
    finally:
        serve.shutdown()
        for module in (this, fake_engine_module):
            cloudpickle.unregister_pickle_by_value(module)


def replicas_that_took(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()]


def converse(
    client: httpx.Client, base: str, opening: str, turns: int, system: str = SYSTEM
) -> list[ChatCompletionRequest]:
    """Send `turns` turns of one conversation, each resending it whole; return the requests sent."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
    sent = []
    for turn in range(turns):
        body = {"model": "fake-model", "messages": messages, "max_tokens": 8, "temperature": 0}
        sent.append(ChatCompletionRequest(**body))
        if turn == 1:  # one streamed turn: the stream crosses the ingress too
            with client.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
                answer = "".join(
                    c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
                )
        else:
            r = client.post(f"{base}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    return sent


def counter(metrics: str, name: str, **labels: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_turns_stick_to_one_replica_and_the_router_counts_its_matches(app):
    base, log = app
    with httpx.Client(timeout=60, trust_env=False) as client:
        first = converse(client, base, "Tell me about the old harbor, its ships and the storm. " * 2, 4)
        took = replicas_that_took(log)
        assert len(took) == 4 and len(set(took)) == 1, took
        # Nothing in common with the first: to the emptier replica.
        converse(client, base, "Describe the mountain village. " * 3, 1, system="Be terse. " * 12)
        assert replicas_that_took(log)[4] != took[0]
        # The first's system prompt: to the replica holding it.
        third = converse(client, base, "Describe the mountain village. " * 3, 1)
        assert replicas_that_took(log)[5] == took[0]

        metrics = client.get(f"{base}/metrics").text
    assert counter(metrics, "dspark_router_decisions_total", router="prefix", decision="prefix") == 4
    assert counter(metrics, "dspark_router_decisions_total", router="prefix", decision="least_loaded") == 2
    keys = [block_hashes(prompt_key(r)) for r in first]
    # Each later turn matched its previous turn's blocks, the third conversation its system prompt's.
    system_blocks = leading_equal(block_hashes(prompt_key(third[0])), keys[-1])
    expected = sum(len(k) for k in keys[:-1]) + system_blocks
    assert system_blocks > 0
    assert counter(metrics, "dspark_router_matched_blocks_total", router="prefix") == expected
    assert counter(metrics, "dspark_router_prompt_blocks_total", router="prefix") > expected
    assert re.search(r'^vllm:num_requests_running\{model_name="fake-model"\}', metrics, re.M)


def test_bad_input_is_refused_at_the_ingress_naming_the_field(app):
    base, _ = app
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
        trust_env=False,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
