"""Inter-token latency of running streams while a large JSON schema compiles.

Against a running `dspark serve`: N streams decode, then one request with a JSON schema of about
`--schema-mb` MB arrives. Its grammar compiles off the stepping thread, so the streams' gaps
between tokens while it compiles should stay close to those before. Prints one table: the
streams' inter-token gaps before the schema arrived and while it compiled (until its first
token), and their ratio.

    dspark serve --port 8000 &   # defaults, the engine in its own process
    python scripts/structured_compile_itl.py --url http://127.0.0.1:8000 --streams 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time

import httpx


def big_schema(megabytes: float) -> dict:
    """An object schema of about `megabytes` MB: many optional string fields with patterns and
    enums, which the grammar compiler must all turn into lexemes."""
    props: dict[str, dict] = {}
    size, i = 0, 0
    while size < megabytes * 1_000_000:
        field = {
            "type": "string",
            "pattern": f"^(id{i}_[a-z]{{2,6}}|[A-Z][a-z]{{1,8}}-{i % 97}[0-9]{{0,3}})$",
            "description": f"field {i} " + "x" * 40,
        }
        if i % 3 == 0:
            field = {"enum": [f"v{i}_{k}" for k in range(8)]}
        props[f"field_{i}"] = field
        size += len(json.dumps(field)) + 16
        i += 1
    return {"type": "object", "properties": props, "additionalProperties": False}


async def stream(client: httpx.AsyncClient, body: dict, times: list[float]) -> None:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text":"' in line:
                times.append(time.monotonic())


def gaps(times: list[list[float]], start: float, end: float) -> list[float]:
    """Inter-token gaps (ms) of every stream whose later token falls in [start, end)."""
    out = []
    for ts in times:
        out += [(b - a) * 1000 for a, b in itertools.pairwise(ts) if start <= b < end]
    return out


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


async def main(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        times: list[list[float]] = [[] for _ in range(args.streams)]
        tasks = [asyncio.create_task(stream(client, body, t)) for t in times]
        while min(len(t) for t in times) < 2:  # every stream past its first token
            for t in tasks:
                if t.done():
                    t.result()  # raises the HTTP error of a stream the server refused
                    raise SystemExit("a stream ended before its second token")
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.before_s)
        schema = big_schema(args.schema_mb)
        request = {
            "model": model,
            "prompt": "Fill in the record as JSON:",
            "max_tokens": 8,
            "temperature": 0,
            "structured_outputs": {"json": schema},
        }
        sent = time.monotonic()
        first: list[float] = []
        structured = asyncio.create_task(stream(client, request, first))
        while not first and not structured.done():
            await asyncio.sleep(0.005)
        compiled = first[0] if first else time.monotonic()
        await structured  # raises on an HTTP error (a schema the server refused)
        if any(t.done() for t in tasks):
            raise SystemExit("a stream finished during the compile: raise --max-tokens")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    before = gaps(times, sent - args.before_s, sent)
    during = gaps(times, sent, compiled)
    size = len(json.dumps(schema)) / 1e6
    print(f"schema {size:.2f} MB; from arrival to its first token {compiled - sent:.2f} s")
    print("| window | gaps | median ms | p90 ms | max ms |")
    print("|---|---|---|---|---|")
    for name, g in (("before", before), ("during the compile", during)):
        print(f"| {name} | {len(g)} | {statistics.median(g):.1f} | {p(g, 90):.1f} | {max(g):.1f} |")
    ratio = statistics.median(during) / statistics.median(before)
    print(f"median inter-token latency during / before: {ratio:.2f} (acceptance: at most 2)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--schema-mb", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=2000, help="per stream: enough to outlast the compile")
    ap.add_argument("--before-s", type=float, default=3.0, help="window of gaps measured before the schema")
    asyncio.run(main(ap.parse_args()))
