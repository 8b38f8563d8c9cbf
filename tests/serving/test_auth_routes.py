"""With an API key, every route of the real apps (OpenAI and KServe front ends) answers 401 without
it, except the allow-list of probes and scrapes: the routes are walked as the apps register them, so
a route added later is covered too."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from dspark.serving.auth import OPEN_ROUTES, is_open
from dspark.serving.config import ServeConfig
from fastapi import FastAPI
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from tests.serving.conftest import make_client, make_replica

KEY = "route-key"


def walk(routes, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path template) of every route, mounted sub-apps and included routers included
    (FastAPI keeps an included router as one entry: its `original_router` with the prefix)."""
    for route in routes:
        if (included := getattr(route, "original_router", None)) is not None:
            yield from walk(included.routes, prefix + route.include_context.prefix)
        elif isinstance(route, Mount):
            yield from walk(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            for method in sorted(route.methods or {"GET"}):
                if method != "HEAD":
                    yield method, prefix + route.path


def concrete(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "m", template)


def check_routes(client: TestClient, expected_guarded: set[str]) -> None:
    routes = sorted(set(walk(client.app.routes)))
    seen_guarded, seen_open = set(), set()
    for method, template in routes:
        path = concrete(template)
        r = client.request(method, path)
        if is_open(path):
            seen_open.add(template)
            assert r.status_code != 401, (method, path)
        else:
            seen_guarded.add(template)
            assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
            assert r.json()["error"]["code"] == "invalid_api_key"
            wrong = client.request(method, path, headers={"Authorization": "Bearer not-" + KEY})
            assert wrong.status_code == 401, (method, path)
    missing = expected_guarded - seen_guarded
    assert not missing, f"routes not walked: {missing}"
    assert seen_open, "no open probe was walked"
    # An unknown path needs the key too (no route discovery without it).
    assert client.get("/no/such/route").status_code == 401


def test_openai_mode_guards_every_route_but_the_allow_list():
    replica = make_replica()
    try:
        with make_client(replica, api_key=KEY) as client:
            check_routes(client, {"/v1/completions", "/v1/chat/completions", "/v1/models", "/openapi.json"})
            for probe in ("/health", "/ready", "/metrics"):
                assert client.get(probe).status_code == 200
            auth = {"Authorization": f"Bearer {KEY}"}
            assert client.get("/v1/models", headers=auth).status_code == 200
    finally:
        replica.shutdown()


class _Method:
    def __init__(self, value):
        self.value = value

    def remote(self, *args, **kwargs):
        async def result():
            return self.value

        return result()


class FakeHandle:
    """The parts of the engine deployment's handle that the open probes call."""

    ready = _Method(True)
    health = _Method(None)  # no problem
    metrics_text = _Method(b"")
    models = _Method({"object": "list", "data": []})


@pytest.fixture
def kserve_app(monkeypatch) -> FastAPI:
    """KServe's real app with every route it registers at start-up, built on a fresh FastAPI app
    (the module-level one is shared by the process, so the live-server tests get theirs untouched)."""
    import kserve.model_server
    from dspark.serving.kserve_model import build_kserve_server

    app = FastAPI()
    monkeypatch.setattr(kserve.model_server, "app", app)
    rest = build_kserve_server(ServeConfig(api_key=KEY, port=8000), FakeHandle(), "m")
    rest.create_application()
    return app


def test_kserve_mode_guards_every_route_but_the_allow_list(kserve_app):
    with TestClient(kserve_app, raise_server_exceptions=False) as client:
        check_routes(
            client,
            {
                "/v2/repository/models/{model_name}/unload",
                "/v2/repository/models/{model_name}/load",
                "/v2/models/{model_name}/infer",
                "/v2/models/{model_name}",
                "/v1/models/{model_name}:predict",
                "/openai/v1/chat/completions",
                "/openai/v1/completions",
                "/",
            },
        )
        for probe in ("/health", "/ready", "/v2/health/live", "/v2/health/ready", "/v2/models/m/ready"):
            assert client.get(probe).status_code == 200, probe


@pytest.mark.parametrize(
    ("path", "open_"),
    [
        ("/health", True),
        ("/ready", True),
        ("/metrics", True),
        ("/v2/health/live", True),
        ("/v2/models/m/ready", True),
        ("/health/", False),
        ("//health", False),
        ("/v2/models//ready", False),
        ("/v2/models/m/versions/1/ready", False),
        ("/v2/models/m/ready/x", False),
        ("/v2/repository/models/m/unload", False),
        ("/openai/health", False),
        ("/", False),
    ],
)
def test_allow_list_matches_whole_paths(path, open_):
    assert is_open(path) is open_
    assert len(OPEN_ROUTES) == 5
