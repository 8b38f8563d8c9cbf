"""Fixtures of the serving tests: the OpenAI app over a fake engine, without Ray; the engine runs on
a thread of this process or in its own process (`EngineProcess`)."""

from __future__ import annotations

import pytest
from dspark.serving.auth import BearerAuth
from dspark.serving.config import ServeConfig
from dspark.serving.openai_routes import build_openai_app
from dspark.serving.replica import EngineReplica
from starlette.testclient import TestClient

from tests.serving.fake_engine import FakeEngine, fake_engine_factory


def make_replica(engine: FakeEngine | None = None, **config) -> EngineReplica:
    """A replica over `engine` (default: a new FakeEngine) stepped on a thread of this process."""
    return EngineReplica(ServeConfig(**config), engine or FakeEngine())


def make_process_replica(**config) -> EngineReplica:
    """A replica whose FakeEngine runs in its own process, as the server's engine does by default."""
    return EngineReplica(ServeConfig(**config), factory=fake_engine_factory)


def make_client(replica: EngineReplica, api_key: str | None = None) -> TestClient:
    app = build_openai_app(
        replica.service,
        BearerAuth(api_key),
        ready=replica.ready,
        metrics=replica.metrics_text,
        health=replica.health,
    )
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(params=["process", "thread"])
def replica(request):
    r = (
        make_process_replica(max_output_tokens=64)
        if request.param == "process"
        else make_replica(max_output_tokens=64)
    )
    yield r
    r.shutdown()


@pytest.fixture
def client(replica) -> TestClient:
    with make_client(replica) as c:
        yield c


@pytest.fixture(scope="module", params=["process", "thread"])
def shared_client(request) -> TestClient:
    """A client shared by a module's tests that need no fresh engine (nothing counted from zero): one
    engine process for them all instead of one per test, each an interpreter importing torch."""
    factory = make_process_replica if request.param == "process" else make_replica
    replica = factory(max_output_tokens=64)
    with make_client(replica) as c:
        yield c
    replica.shutdown()


@pytest.fixture
def fake():
    """A fake engine (8 slots) and a client of the OpenAI app over it, the engine on a thread."""
    engine = FakeEngine(max_num_seqs=8)
    replica = make_replica(engine, max_output_tokens=64)
    with make_client(replica) as c:
        yield engine, c
    replica.shutdown()
