"""Hostile input against the real engine (SmolLM2-135M on the CPU, in its own process as served) and
the real app, without Ray: the rows of `test_live_server.HOSTILE`, then the schema fuzz of
`test_schema_fuzz`, whose generated values here reach the real tokenizer, chat template, sampler
and grammar compiler, where the fake engine accepts anything. No input may produce a 5xx, and the
engine must serve the next request."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from tests.serving.conftest import make_client
from tests.serving.test_live_server import HOSTILE

pytestmark = [pytest.mark.slow, pytest.mark.real_server]
KEY = {"Authorization": "Bearer fuzz-key"}


@pytest.fixture(scope="module")
def real_schema():
    from dspark.serving.config import ServeConfig
    from dspark.serving.replica import EngineReplica

    config = ServeConfig(
        drafter="ngram",
        policy="static:4",
        dtype="float32",
        device="cpu",
        compile=False,
        max_num_seqs=4,
        max_model_len=256,
        max_output_tokens=4,
    )
    # The engine runs in its own process: schemathesis's module-global portal keeps the app (and so
    # an engine on a thread of this worker, 1.2 GB) alive to the end of the session.
    replica = EngineReplica(config)
    client = make_client(replica, api_key="fuzz-key")
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", client.app, headers=KEY), client
    finally:
        replica.shutdown()


def test_hostile_rows_are_4xx_and_the_next_request_is_served(real_schema):
    _, client = real_schema
    normal = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for change, answers in HOSTILE:
        body = json.dumps({**normal, "temperature": 0.5, **change})
        r = client.post(
            "/v1/chat/completions", content=body, headers={**KEY, "content-type": "application/json"}
        )
        assert r.status_code in answers, (list(change), r.status_code, r.text[:300])
        after = client.post("/v1/chat/completions", json=normal, headers=KEY)
        assert after.status_code == 200, (list(change), after.text[:300])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_input_yields_a_server_error_from_the_real_engine(real_schema, path):
    schema, client = real_schema
    operation = schema[path]["POST"]
    valid_and_invalid = st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])

    @given(case=valid_and_invalid)
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case):
        case.headers = {**(case.headers or {}), **KEY}
        response = case.call()
        assert response.status_code < 500, (response.status_code, response.text[:500])

    check()
    ok = client.post(
        "/v1/completions",
        json={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 2},
        headers=KEY,
    )
    assert ok.status_code == 200, ok.text
