"""Who accepts HTTP: the one replica itself (Ray Serve direct ingress) or Ray Serve's proxy."""

from __future__ import annotations

import socket

import pytest
from dspark.serving.config import load_config
from dspark.serving.runtime import DIRECT_INGRESS_FLAG, PortUnavailable, check_port_free, ingress_env


@pytest.mark.parametrize(
    ("values", "direct"),
    [
        ({}, True),
        ({"ingress": "proxy"}, False),
        ({"num_replicas": 2}, False),
        # Autoscaling may scale to zero or above one: only the proxy routes (and wakes) replicas.
        ({"autoscaling": {"min_replicas": 0, "max_replicas": 1}}, False),
        ({"kserve": True}, False),
        ({"ingress": "direct"}, True),
    ],
)
def test_auto_ingress_is_direct_only_for_one_fixed_replica(values, direct):
    assert load_config(overrides=values, environ={}).direct_ingress is direct


def test_direct_ingress_puts_the_one_replica_on_the_server_port():
    env = ingress_env(load_config(overrides={"port": 8123}, environ={}), environ={})
    assert env[DIRECT_INGRESS_FLAG] == "1"
    # Ray allocates replica ports from [min, max): here only the server's own port.
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "8123",
        "8124",
    )
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"
    assert ingress_env(load_config(overrides={"ingress": "proxy"}, environ={})) == {}


def test_a_draining_period_set_in_the_environment_is_kept():
    """A pod behind a load balancer may want Ray's own deregistration wait; `dspark serve` keeps it."""
    config = load_config(environ={})
    env = ingress_env(config, {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "7"})
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "7"
    assert ingress_env(config, {})["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


def test_a_port_in_use_is_refused_with_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed: free again
