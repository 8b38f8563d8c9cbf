"""Prefix caching on multi-turn chat: conversations that each open on their own document, their
turns sent one at a time (round robin: every conversation's turn 1, then every turn 2, ...), each
turn resending the whole conversation through the chat completions API, streamed, greedy.

Prints the prefix-cache hit rate (from /metrics and from `usage.prompt_tokens_details`) and TTFT
per turn; `--answers FILE` saves every answer, to compare two servers' outputs.

Usage:
  python scripts/multiturn_prefix_bench.py --serve "--ingress proxy --max-num-seqs 16"
  python scripts/multiturn_prefix_bench.py --serve "--ingress proxy --max-num-seqs 16 --no-prefix-caching"
  python scripts/multiturn_prefix_bench.py --url http://127.0.0.1:8000 --conversations 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
from dspark.bench.http_load import wait_until_serving

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = [
    "Summarize this document in one sentence.",
    "Which place does it mention first?",
    "What happens at the end?",
    "Give the document a short title.",
    "Name two people or things it describes.",
    "Is the tone happy or sad?",
]
_VOCABULARY = (
    "the a of and to in on at by with from over under after before while river market stone winter "
    "garden letter engine silver harbor forest morning candle bridge window orchard village thunder "
    "meadow lantern copper valley mirror island shadow farmer teacher sailor doctor child queen "
    "merchant painter walked carried found opened watched built lost remembered sold crossed followed "
    "quiet old bright heavy narrow golden cold early distant broken gentle busy empty small large "
    "slowly again together alone across toward behind beyond near far house road ship letter field "
    "storm rain snow light fire water bread wine music story song dream night day year city town"
)
WORDS = _VOCABULARY.split()


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def chat_turn(client: httpx.Client, base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy turn: its text, TTFT and usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started, ttft, text, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return {"text": "".join(text), "ttft": ttft, "usage": usage}


COUNTERS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:spec_decode_num_draft_tokens_total": "drafts",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}


def read_counters(client: httpx.Client, base: str) -> dict[str, float]:
    """The prefix-cache and draft counters of /metrics, summed over their labels."""
    totals = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in client.get(f"{base}/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            totals[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def http_sender(client: httpx.Client, base: str, max_tokens: int) -> Callable[[list[dict]], dict]:
    model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
    return lambda messages: chat_turn(client, base, model, messages, max_tokens)


def engine_sender(engine_flags: str, max_tokens: int) -> Callable[[list[dict]], dict]:
    """Turns through an engine in this process, rendered as the server renders chat (TTFT here
    includes no HTTP)."""
    from dspark.builder import engine_from_config
    from dspark.engine.config import EngineConfig
    from dspark.engine.sampling_params import SamplingParams

    fields = {}
    for flag in shlex.split(engine_flags):
        name, _, value = flag.removeprefix("--").partition("=")
        fields[name.replace("-", "_")] = value
    engine = engine_from_config(EngineConfig(**fields))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def send(messages: list[dict]) -> dict:
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        stats = engine.generate([prompt], params)[0]
        first = stats.stats.first_token_time
        return {
            "text": stats.text,
            "ttft": first - stats.stats.arrival_time if first is not None else None,
            "usage": {
                "prompt_tokens": len(prompt),
                "prompt_tokens_details": {"cached_tokens": stats.stats.cached_tokens},
            },
        }

    return send


def run(
    send: Callable[[list[dict]], dict],
    args: argparse.Namespace,
    counters: Callable[[], dict[str, float]] | None = None,
) -> dict:
    """The workload through `send`; with `counters` (a /metrics reader), each turn's draft
    acceptance too: turn 1 drafts on misses, later turns on hits when prefix caching is on."""
    rng = random.Random(args.seed)
    chats = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{document(rng, args.doc_words)}\n\n{QUESTIONS[0]}"},
        ]
        for _ in range(args.conversations)
    ]
    turns, answers = [], []
    for turn in range(args.turns):
        results = []
        start = counters() if counters else None
        for chat in chats:
            result = send(chat)
            results.append(result)
            answers.append(result["text"])
            chat.append({"role": "assistant", "content": result["text"]})
            chat.append({"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]})
        ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
        prompt = sum(r["usage"].get("prompt_tokens", 0) for r in results)
        cached = sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in results)
        end = counters() if counters else None
        drafts = end["drafts"] - start["drafts"] if counters else 0.0
        turns.append(
            {
                "acceptance": (end["accepted"] - start["accepted"]) / drafts if drafts else None,
                "turn": turn + 1,
                "ttft_mean_s": statistics.mean(ttfts) if ttfts else None,
                "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
            }
        )
    later = [t["ttft_mean_s"] for t in turns[1:] if t["ttft_mean_s"] is not None]
    return {
        "conversations": args.conversations,
        "turns": turns,
        "hit_rate_usage": sum(t["cached_tokens"] for t in turns) / sum(t["prompt_tokens"] for t in turns),
        "ttft_mean_turns_2_on_s": statistics.mean(later) if later else None,
        "answers": answers,
    }


def serve(args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, "-c", "from dspark.cli import main; main()", "serve", "--port", str(args.port)]
    log = open(args.serve_log, "w")  # noqa: SIM115 - open for the server's lifetime
    return subprocess.Popen(
        command + shlex.split(args.serve), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def run_http(args: argparse.Namespace) -> dict:
    """The workload against --url, or a server started with --serve flags (stopped after)."""
    process = None
    base = (args.url or f"http://127.0.0.1:{args.port}").rstrip("/")
    try:
        if args.serve is not None:
            process = serve(args)
            wait_until_serving(base, 900, alive=lambda: process.poll() is None)
        with httpx.Client(timeout=600, trust_env=False) as client:
            before = read_counters(client, base)
            report = run(
                http_sender(client, base, args.max_tokens), args, lambda: read_counters(client, base)
            )
            after = read_counters(client, base)
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=120)
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    report["hit_rate_metrics"] = hits / queries if queries else 0.0
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="A running server, e.g. http://127.0.0.1:8000.")
    target.add_argument("--serve", help="Start `dspark serve` with these flags (quoted) on --port.")
    target.add_argument(
        "--in-process",
        metavar="ENGINE_FLAGS",
        help='An engine in this process, e.g. "--max-num-seqs=16 --compile=false" (hit rates; no HTTP).',
    )
    parser.add_argument("--port", type=int, default=8240)
    parser.add_argument("--serve-log", default="multiturn-prefix-serve.log")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=250)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answers", help="Write every answer (in send order) to this JSON file.")
    args = parser.parse_args()

    if args.in_process is not None:
        report = run(engine_sender(args.in_process, args.max_tokens), args)
    else:
        report = run_http(args)
    for t in report["turns"]:
        share = t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0
        acceptance = f"  draft acceptance {t['acceptance']:.3f}" if t.get("acceptance") is not None else ""
        print(
            f"turn {t['turn']}: TTFT mean {t['ttft_mean_s']:.3f} s  p50 {t['ttft_p50_s']:.3f} s  "
            f"cached {t['cached_tokens']}/{t['prompt_tokens']} prompt tokens ({share:.2f}){acceptance}"
        )
    from_metrics = report.get("hit_rate_metrics")
    print(
        f"prefix hit rate: {report['hit_rate_usage']:.3f} (usage)"
        + (f", {from_metrics:.3f} (/metrics)" if from_metrics is not None else "")
        + f"; TTFT mean of turns 2-{args.turns}: {report['ttft_mean_turns_2_on_s']:.3f} s"
    )
    if args.answers:
        with open(args.answers, "w") as f:
            json.dump(report["answers"], f, indent=1)


if __name__ == "__main__":
    main()
