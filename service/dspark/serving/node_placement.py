"""A replica placed by node type: which node type it runs on, and the settings that follow from it."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from dspark.node_resources import REPLICA_SLOTS, node_type_of
from dspark.serving.config import ServeConfig

log = logging.getLogger(__name__)


def settings_on_node(config: ServeConfig, resources: Mapping[str, float]) -> ServeConfig:
    """The replica's settings on a node with these Ray resources: its node type's SPS profile and,
    unless `num_cpus_per_replica` says otherwise, the node's CPUs shared by its replica slots.

    A node type without a profile in `sps_profiles` is served as a single server is: the engine
    takes a stored profile that matches it or measures one, unless `strict_profile` refuses.
    """
    if config.sps_profiles is None:
        return config
    node_type = node_type_of(resources)
    profile = config.sps_profiles.get(node_type) if node_type is not None else None
    update: dict[str, object] = {"sps_profile": profile, "sps_profiles": None}
    if config.num_cpus_per_replica is None:
        share = resources.get("CPU", 1.0) / max(1.0, resources.get(REPLICA_SLOTS, 1.0))
        update["num_cpus_per_replica"] = float(max(1, int(share)))
    if profile is not None:
        log.info("replica on node type %s: SPS profile %s", node_type, profile)
        return config.model_copy(update=update)
    missing = (
        f"sps_profiles has no profile for node type {node_type!r} (it has {sorted(config.sps_profiles)})"
        if node_type is not None
        else f"this replica's Ray node carries no dspark/node-type/* resource (it has {sorted(resources)})"
    )
    if config.strict_profile:
        raise RuntimeError(f"{missing}, and strict_profile is set")
    log.warning("%s: the engine takes a stored profile of this hardware or measures one", missing)
    return config.model_copy(update=update)


def this_node_resources() -> dict[str, float]:
    """The Ray resources of the node this process runs on."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return dict(node["Resources"])
    raise RuntimeError(f"Ray does not list this process's node {node_id}")


def on_this_node(config: ServeConfig) -> ServeConfig:
    """`settings_on_node` for the node this replica runs on (unchanged when not placed by node type)."""
    return settings_on_node(config, this_node_resources()) if config.placed_by_node_type else config
