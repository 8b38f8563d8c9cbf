"""The request routers' metrics, in this process's registry: the ingress's /metrics appends them to
the engine replica's. The prefix-match rate is `dspark_router_matched_blocks_total /
dspark_router_prompt_blocks_total`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from dspark.serving.prefix_routing import BLOCK_CHARS

REGISTRY = CollectorRegistry(auto_describe=True)
DECISIONS = Counter(
    "dspark_router_decisions",
    "Routing decisions for generation requests, by router and decision (prefix: the replica sent "
    "the longest part of the prompt; imbalanced: that one was too busy; least_loaded: no replica was "
    "sent any; in_turn: round robin). A request whose chosen replicas are all full is decided again.",
    ["router", "decision"],
    registry=REGISTRY,
)
PROMPT_BLOCKS = Counter(
    "dspark_router_prompt_blocks",
    f"Prefix blocks ({BLOCK_CHARS} characters) of routed prompts.",
    ["router"],
    registry=REGISTRY,
)
MATCHED_BLOCKS = Counter(
    "dspark_router_matched_blocks",
    "Prefix blocks of routed prompts that the replica they were routed to had been sent before.",
    ["router"],
    registry=REGISTRY,
)
