"""Routing between replicas on multi-turn chat: two engine replicas on a local multi-node Ray
cluster, behind the HTTP ingress, under each request router in turn (`--router prefix`,
`round-robin`, `pow2`), each run twice (twins), every run on freshly started replicas.

The workload is scripts/multiturn_prefix_bench.py's: conversations that each open on their own
document after the shared system prompt, each turn resending the whole conversation, streamed,
greedy. Here `--users` conversations run at once, each sending its turns one after the other, so
the turns of a conversation meet the others' in an order no router can count on.

Prints per run the engines' prefix-cache hit rate (prompt tokens served from cache / prompt tokens,
from each response's `usage`), over all turns and over turns 2 on, the mean TTFT of turn 1 and of
turns 2 on, and the router's own prefix-match rate (its /metrics); then the mean of each router's
twins and the hit-rate ratio of `prefix` to the others.

Usage:
  python scripts/multireplica_prefix_bench.py                              # 32 conversations x 4 turns
  python scripts/multireplica_prefix_bench.py --routers prefix round-robin --twins 1 --conversations 4
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import tempfile
import threading
import time

import httpx
from multiturn_prefix_bench import QUESTIONS, SYSTEM, chat_turn, document

APP = "dspark"


def start_cluster(replicas: int, replica_cpus: float):
    """A head node that holds no replica (no CPUs: Serve's controller, proxy and ingress need none)
    and one worker node per replica, each of the replica's CPUs, joined by this driver.

    Its files go to a directory of their own (RAY_TMPDIR), so that a bare `ray.init()` elsewhere on
    the machine does not find and join it."""
    import ray
    from dspark.serving.runtime import daemon_env, replica_env
    from ray.cluster_utils import Cluster

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rb-", dir="/tmp")  # short: Unix socket paths
    os.environ.update(daemon_env(os.environ))  # the nodes' daemons read it at their start
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
    )
    for _ in range(replicas):
        cluster.add_node(num_cpus=replica_cpus, node_ip_address="127.0.0.1")
    ray.init(
        address=cluster.address,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": replica_env()},
    )
    return cluster


def deploy(config) -> str:
    """The OpenAI app (ingress + engine replicas) on fresh replicas; returns its base URL."""
    from dspark.serving.deployment import openai_app
    from ray import serve

    serve.run(openai_app(config), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/ready", timeout=5, trust_env=False).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base} was not ready within 900 s")


def conversations(args: argparse.Namespace) -> list[list[dict]]:
    rng = random.Random(args.seed)
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{document(rng, args.doc_words)}\n\n{QUESTIONS[0]}"},
        ]
        for _ in range(args.conversations)
    ]


def run_workload(base: str, args: argparse.Namespace) -> list[dict]:
    """Every conversation's turns, `args.users` conversations at a time; one record per turn."""
    todo: queue.Queue[list[dict]] = queue.Queue()
    for chat in conversations(args):
        todo.put(chat)
    records: list[dict] = []
    lock = threading.Lock()

    def user() -> None:
        with httpx.Client(timeout=600, trust_env=False) as client:
            model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
            while True:
                try:
                    chat = todo.get_nowait()
                except queue.Empty:
                    return
                for turn in range(args.turns):
                    result = chat_turn(client, base, model, chat, args.max_tokens)
                    with lock:
                        records.append({"turn": turn + 1, **result})
                    chat.append({"role": "assistant", "content": result["text"]})
                    chat.append({"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]})

    threads = [threading.Thread(target=user) for _ in range(args.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def warm_up(base: str, args: argparse.Namespace) -> None:
    """A few short unrelated chats, so no run's first turns pay for a replica's first request."""
    with httpx.Client(timeout=600, trust_env=False) as client:
        model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
        for i in range(4):
            chat_turn(client, base, model, [{"role": "user", "content": f"Count to {i + 3}."}], 4)


def router_match_rate(base: str) -> float | None:
    totals = {}
    text = httpx.get(f"{base}/metrics", timeout=30, trust_env=False).text
    for line in text.splitlines():
        for name in ("dspark_router_matched_blocks_total", "dspark_router_prompt_blocks_total"):
            if line.startswith(name + "{"):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    prompt = totals.get("dspark_router_prompt_blocks_total")
    return totals["dspark_router_matched_blocks_total"] / prompt if prompt else None


def summarize(records: list[dict]) -> dict:
    def hit_rate(rs: list[dict]) -> float:
        prompt = sum(r["usage"].get("prompt_tokens", 0) for r in rs)
        cached = sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in rs)
        return cached / prompt if prompt else 0.0

    def mean_ttft(rs: list[dict]) -> float | None:
        ttfts = [r["ttft"] for r in rs if r["ttft"] is not None]
        return statistics.mean(ttfts) if ttfts else None

    first = [r for r in records if r["turn"] == 1]
    later = [r for r in records if r["turn"] > 1]
    return {
        "requests": len(records),
        "hit_rate": hit_rate(records),
        "hit_rate_turns_2_on": hit_rate(later),
        "ttft_mean_turn_1_s": mean_ttft(first),
        "ttft_mean_turns_2_on_s": mean_ttft(later),
    }


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--routers", nargs="+", default=["prefix", "round-robin", "pow2"])
    parser.add_argument("--twins", type=int, default=2, help="Runs of each router.")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs of each worker node and replica."
    )
    parser.add_argument("--config", help="A serve YAML file of further settings (dtype, drafter, ...).")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--prefix-cache-gib",
        type=float,
        help="Each replica's prefix store beside its KV slots (default: the engine's). 0 with a few "
        "slots bounds what a replica can keep to about the conversations it serves at once.",
    )
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--users", type=int, default=8, help="Conversations under way at once.")
    parser.add_argument("--doc-words", type=int, default=250)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8250)
    parser.add_argument(
        "--engine-stall-timeout-s",
        type=float,
        default=300.0,
        help="An engine's first step after its start can take longer than the server's 30 s on a busy "
        "machine; the watchdog would kill it as hung.",
    )
    parser.add_argument("--out", help="Write every run's figures to this JSON file.")
    args = parser.parse_args()

    # Every node is on 127.0.0.1, where Ray would take "127.0.0.1" in the driver's address for this
    # machine's outward IP; read when Ray is imported.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from dspark.serving.config import load_config
    from ray import serve

    cluster = start_cluster(args.replicas, args.replica_cpus)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
    runs = []
    try:
        for twin in range(args.twins):
            for router in args.routers:
                config = load_config(
                    args.config,
                    overrides={
                        "router": router,
                        "num_replicas": args.replicas,
                        "num_cpus_per_replica": args.replica_cpus,
                        "max_num_seqs": args.max_num_seqs,
                        "build_in_background": False,
                        "port": args.port,
                        "engine_stall_timeout_s": args.engine_stall_timeout_s,
                        "prefix_cache_gib": args.prefix_cache_gib,  # None: the engine's
                    },
                    environ={},
                )
                started = time.monotonic()
                base = deploy(config)
                ready_s = time.monotonic() - started
                warm_up(base, args)
                started = time.monotonic()
                records = run_workload(base, args)
                run = {
                    "router": router,
                    "twin": twin + 1,
                    "ready_s": ready_s,
                    "workload_s": time.monotonic() - started,
                    **summarize(records),
                    "router_match_rate": router_match_rate(base),
                }
                runs.append(run)
                print(
                    f"{router:12s} twin {twin + 1}: hit rate {fmt(run['hit_rate'])} "
                    f"(turns 2-{args.turns}: {fmt(run['hit_rate_turns_2_on'])})  "
                    f"TTFT mean turn 1 {fmt(run['ttft_mean_turn_1_s'])} s, "
                    f"turns 2-{args.turns} {fmt(run['ttft_mean_turns_2_on_s'])} s  "
                    f"router match {fmt(run['router_match_rate'])}  "
                    f"({run['workload_s']:.0f} s, ready in {ready_s:.0f} s)",
                    flush=True,
                )
                serve.delete(APP)
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)

    means = {}
    print(f"\n| router | hit rate | hit rate, turns 2-{args.turns} | TTFT mean, turns 2-{args.turns} |")
    print("|---|---|---|---|")
    for router in args.routers:
        mine = [r for r in runs if r["router"] == router]
        means[router] = statistics.mean(r["hit_rate"] for r in mine)
        later = [r["ttft_mean_turns_2_on_s"] for r in mine if r["ttft_mean_turns_2_on_s"] is not None]
        print(
            f"| {router} | {' / '.join(fmt(r['hit_rate']) for r in mine)} "
            f"| {' / '.join(fmt(r['hit_rate_turns_2_on']) for r in mine)} "
            f"| {' / '.join(fmt(x) for x in later)} s |"
        )
    if "prefix" in means:
        for router, rate in means.items():
            if router != "prefix" and rate > 0:
                print(f"hit rate prefix / {router}: {means['prefix'] / rate:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
