"""Property-based fuzz of the OpenAPI schema (schemathesis): no input may produce a 5xx.

Runs against the real FastAPI app and OpenAI service in this process, over the fake engine so that
hundreds of generated requests stay fast; the live-server tests cover the real engine's paths.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from tests.serving.conftest import make_client, make_replica

replica = make_replica(max_output_tokens=32)
client = make_client(replica, api_key="fuzz-key")
schema = schemathesis.openapi.from_asgi("/openapi.json", client.app)


@schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_yields_a_server_error(case):
    case.headers = {**(case.headers or {}), "Authorization": "Bearer fuzz-key"}
    response = case.call()
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert "error" in response.json()


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_without_the_key_inference_routes_answer_401(case):
    response = case.call()
    if case.path.startswith("/v1/") and case.method.upper() == case.operation.method.upper():
        assert response.status_code == 401
    else:  # probes stay open; a method a route lacks is 405 with or without a key
        assert response.status_code < 500


def teardown_module() -> None:
    replica.shutdown()
