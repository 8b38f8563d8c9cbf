"""The prefix-aware router's choices as pure functions: the prompt key, the bounded per-replica prefix
index, the fallback to the least loaded replica; and which app shape a config gets."""

from __future__ import annotations

import pytest
from dspark.serving.config import load_config
from dspark.serving.openai_schemas import ChatCompletionRequest, CompletionRequest
from dspark.serving.prefix_routing import PrefixIndex, block_hashes, choose, prompt_key

SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers in one sentence. " * 3}


def chat(*contents: str) -> ChatCompletionRequest:
    roles = ["user", "assistant"]
    messages = [SYSTEM] + [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return ChatCompletionRequest(model="m", messages=messages)


def test_a_conversations_next_turn_extends_its_key():
    first = prompt_key(chat("Summarize the river story."))
    second = prompt_key(chat("Summarize the river story.", "A boat sank.", "Who was on it?"))
    assert second.startswith(first) and len(second) > len(first)
    other = prompt_key(chat("Summarize the forest story."))
    assert not other.startswith(first)


def test_completion_prompts_are_keyed_and_batches_are_not():
    assert prompt_key(CompletionRequest(model="m", prompt="Once upon a time")) == "Once upon a time"
    assert prompt_key(CompletionRequest(model="m", prompt=[5, 6, 7])) == "5 6 7"
    assert prompt_key(CompletionRequest(model="m", prompt=["a", "b"])) is None
    assert prompt_key("chat") is None  # the route name beside the request in a handle call


def test_block_hashes_are_chained_over_whole_blocks():
    a = block_hashes("x" * 64 + "y" * 64 + "z" * 10, block_chars=64)
    b = block_hashes("x" * 64 + "y" * 64 + "w" * 64, block_chars=64)
    assert len(a) == 2 and b[:2] == a  # the partial last block is no block
    c = block_hashes("q" * 64 + "y" * 64, block_chars=64)
    assert c[1] != a[1]  # same second block after another first one: another prefix


def test_the_index_matches_the_longest_prefix_a_replica_was_sent():
    index = PrefixIndex()
    index.keep_only(["r1", "r2"])
    turn1 = block_hashes(prompt_key(chat("Tell me about the harbor and its ships at night.")))
    turn2 = block_hashes(
        prompt_key(chat("Tell me about the harbor and its ships at night.", "They sail.", "Where to?"))
    )
    index.insert("r1", turn1)
    assert index.match("r1", turn2) == len(turn1) > 0
    assert index.match("r2", turn2) == 0
    index.insert("r2", turn2)
    assert index.match("r2", turn2) == len(turn2)
    index.keep_only(["r2", "r3"])  # r1 gone, r3 new
    assert index.match("r1", turn2) == 0 and index.held("r3") == 0


def test_the_index_is_bounded_and_forgets_the_least_recent_first():
    index = PrefixIndex(max_blocks=10)
    old = block_hashes("o" * 64 * 4)
    index.insert("r", old)
    for i in range(5):
        index.insert("r", block_hashes(f"{i}" * 64 * 3))
    assert index.held("r") == 10
    assert index.match("r", old) == 0
    recent = block_hashes("4" * 64 * 3)
    assert index.match("r", recent) == 3
    # An evicted head does not hide the rest: the longest block present covers the whole prefix.
    index = PrefixIndex(max_blocks=3)
    index.insert("r", block_hashes("a" * 64 * 4))
    assert index.match("r", block_hashes("a" * 64 * 5)) == 4


def test_the_replica_holding_the_prefix_wins_while_within_the_threshold():
    route = choose(
        ["a", "b"], loads={"a": 5, "b": 0}, matched={"a": 4, "b": 0}, held={}, imbalance_threshold=8
    )
    assert route.decision == "prefix" and route.ranks == [["a"], ["b"]]
    # Of two holders of the same match, the less loaded first.
    route = choose(["a", "b", "c"], {"a": 3, "b": 1, "c": 0}, {"a": 2, "b": 2}, {}, 8)
    assert route.ranks == [["b", "a"], ["c"]]


def test_a_holder_busier_than_the_threshold_loses_to_the_least_loaded():
    route = choose(
        ["a", "b"], loads={"a": 9, "b": 0}, matched={"a": 4, "b": 0}, held={}, imbalance_threshold=8
    )
    assert route.decision == "imbalanced" and route.ranks == [["b"], ["a"]]


def test_without_a_match_the_least_loaded_then_the_emptiest_wins():
    route = choose(["a", "b", "c"], {"a": 1, "b": 0, "c": 0}, {}, held={"b": 50, "c": 10})
    assert route.decision == "least_loaded" and route.ranks == [["c"], ["b", "a"]]
    # A replica whose load is unknown (it did not answer the probe) comes last.
    route = choose(["a", "b"], {"a": None, "b": 7}, {}, {})
    assert route.ranks == [["b"], ["a"]]


@pytest.mark.parametrize(
    ("values", "routed", "router"),
    [
        ({}, False, None),  # `make serve`: the one replica takes HTTP itself
        ({"num_replicas": 2}, True, "prefix"),
        ({"autoscaling": {"min_replicas": 1, "max_replicas": 3}}, True, "prefix"),
        ({"router": "round-robin"}, True, "round-robin"),
        ({"num_replicas": 2, "router": "pow2"}, True, "pow2"),
        ({"num_replicas": 2, "kserve": True}, False, "prefix"),  # KServe's front end holds the handle
    ],
)
def test_the_app_shape_follows_replicas_and_router(values, routed, router):
    config = load_config(overrides=values, environ={})
    assert (config.routed, config.engine_router) == (routed, router)
    assert config.direct_ingress is (not routed and not config.kserve)


def test_the_engine_deployment_gets_the_router_class():
    from dspark.serving.deployment import deployment_options

    opts = deployment_options(load_config(overrides={"num_replicas": 2}, environ={}))
    # Ray ships the class's module by value: the class unpickles as a copy.
    assert opts["request_router_config"].get_request_router_class().__name__ == "PrefixAwareRouter"
    pow2 = deployment_options(load_config(overrides={"num_replicas": 2, "router": "pow2"}, environ={}))
    assert "request_router_config" not in pow2  # Ray's default
    assert "request_router_config" not in deployment_options(load_config(environ={}))


def test_a_router_with_direct_ingress_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"--router .* ingress `proxy`"):
        load_config(overrides={"router": "prefix", "ingress": "direct"}, environ={})
    with pytest.raises(ValueError, match="router"):
        load_config(overrides={"router": "random"}, environ={})
