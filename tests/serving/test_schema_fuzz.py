"""Property-based fuzz of the OpenAPI schema (schemathesis): no input may produce a 5xx.

Runs against the real FastAPI app and OpenAI service in this process, over the fake engine so that
hundreds of generated requests stay fast; the live-server tests cover the real engine's paths.
"""

from __future__ import annotations

import pytest
import schemathesis
from dspark.serving.auth import is_open
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from tests.serving.conftest import make_client, make_replica

replica = make_replica(max_output_tokens=32)
client = make_client(replica, api_key="fuzz-key")
schema = schemathesis.openapi.from_asgi(
    "/openapi.json", client.app, headers={"Authorization": "Bearer fuzz-key"}
)


# One pytest parameter per operation rather than `@schema.parametrize()`, whose items share a node
# id: pytest-xdist keys tests by node id and would run one operation of the six.
OPERATIONS = [result.ok() for result in schema.get_all_operations()]
LABELS = [op.label for op in OPERATIONS]


def cases(operation):
    """Valid and invalid requests, as `@schema.parametrize()` draws them."""
    return st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])


@pytest.mark.parametrize("operation", OPERATIONS, ids=LABELS)
def test_no_input_yields_a_server_error(operation):
    @given(case=cases(operation))
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case):
        case.headers = {**(case.headers or {}), "Authorization": "Bearer fuzz-key"}
        response = case.call()
        assert response.status_code < 500, (response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert "error" in response.json()

    check()


@pytest.mark.parametrize("operation", OPERATIONS, ids=LABELS)
def test_without_the_key_every_guarded_route_answers_401(operation):
    @given(case=cases(operation))
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call()
        if is_open(case.formatted_path):  # probes and scrapes stay open
            assert response.status_code < 500
        else:
            assert response.status_code == 401

    check()


def teardown_module() -> None:
    replica.shutdown()
