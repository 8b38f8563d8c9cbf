"""Ray custom resources that mark a worker node's profiled type and the engine replicas it can hold.

A Ray worker node of node type T starts with `node_resources(T, slots)` (`ray start --resources`,
or a KubeRay worker group's `rayStartParams.resources`). An application placed by node type asks
one `REPLICA_SLOTS` for each replica, so no replica lands on the head or on a node nobody profiled,
and each replica reads its node type back from its node's resources (`node_type_of`) to load that
type's SPS profile. Imported by the serving replicas and by the operator, which has no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

NODE_TYPE_PREFIX = "dspark/node-type/"
REPLICA_SLOTS = "dspark/replica-slots"


def node_type_resource(node_type: str) -> str:
    """The resource that a node of `node_type` carries (one unit)."""
    if not node_type or node_type != node_type.strip():
        raise ValueError(f"node type {node_type!r} must be a non-empty name without surrounding spaces")
    return NODE_TYPE_PREFIX + node_type


def node_resources(node_type: str, slots: int) -> dict[str, float]:
    """The custom resources a worker node of `node_type` holding `slots` engine replicas starts with."""
    if slots < 1:
        raise ValueError(f"a node of type {node_type!r} must hold at least one replica, not {slots}")
    return {node_type_resource(node_type): 1.0, REPLICA_SLOTS: float(slots)}


def node_type_of(resources: Mapping[str, float]) -> str | None:
    """The node type a node's resources name, or None for a node of no profiled type."""
    types = sorted(
        name.removeprefix(NODE_TYPE_PREFIX) for name in resources if name.startswith(NODE_TYPE_PREFIX)
    )
    if len(types) > 1:
        raise ValueError(f"a node carries one node type, not {types}")
    return types[0] if types else None
