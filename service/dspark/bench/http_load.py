"""A closed-loop HTTP client for OpenAI-compatible servers: `users` streams in flight until `requests` finish.

Every server is measured the same way (streamed chat completions, greedy, the same prompts in the
same order), so figures of different servers are comparable. Token counts come from each stream's
final `usage` chunk, not from counting chunks: a speculative server sends several tokens a chunk.

The client shares the machine with the server under test, so it is kept lean: aiohttp reads the
stream (about a third of httpx's CPU per chunk), and a chunk is parsed only until the first token
arrives and for the usage at the end.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass
class RequestTiming:
    output_tokens: int
    latency_s: float
    ttft_s: float


@dataclass
class LevelResult:
    """One closed-loop level against one server."""

    users: int
    requests: int
    output_tokens: int
    seconds: float
    aggregate_tokens_per_s: float
    per_user_p50: float  # a request's output tokens over its latency, median over requests
    ttft_p50_s: float
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)  # by role (bench.cpu_share)

    def as_dict(self) -> dict:
        return asdict(self)


async def _one_request(session: aiohttp.ClientSession, url: str, body: dict) -> RequestTiming:
    start = time.perf_counter()
    first = None
    tokens = None
    async with session.post(url, json=body) as response:
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")[:300]
            raise RuntimeError(f"{url} answered {response.status}: {detail}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            # A key cannot occur inside a JSON string unescaped, so this skips only chunks without usage.
            if first is not None and b'"usage":' not in line:
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens is None:
        raise RuntimeError(f"{url}: the stream ended without a usage chunk")
    return RequestTiming(tokens, end - start, (first or end) - start)


async def _closed_loop(
    base_url: str, model: str, prompts: list[str], users: int, requests: int, max_tokens: int
) -> LevelResult:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    issued = 0
    timings: list[RequestTiming] = []

    def next_body() -> dict:
        nonlocal issued
        prompt = prompts[issued % len(prompts)]
        issued += 1
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    connector = aiohttp.TCPConnector(limit=users + 4)
    timeout = aiohttp.ClientTimeout(total=600.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def user() -> None:
            while issued < requests:
                timings.append(await _one_request(session, url, next_body()))

        start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(min(users, requests))))
        seconds = time.perf_counter() - start
    tokens = sum(t.output_tokens for t in timings)
    return LevelResult(
        users=users,
        requests=len(timings),
        output_tokens=tokens,
        seconds=round(seconds, 3),
        aggregate_tokens_per_s=round(tokens / seconds, 2),
        per_user_p50=round(statistics.median(t.output_tokens / t.latency_s for t in timings), 2),
        ttft_p50_s=round(statistics.median(t.ttft_s for t in timings), 4),
    )


def run_level(
    base_url: str, model: str, prompts: list[str], users: int, requests: int, max_tokens: int
) -> LevelResult:
    """Keep `users` streamed requests in flight until `requests` have finished."""
    return asyncio.run(_closed_loop(base_url, model, prompts, users, requests, max_tokens))


_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def wait_until_serving(base_url: str, timeout_s: float, alive=lambda: True) -> None:
    """Poll /v1/models until the server answers 200; `alive()` false (its process died) stops early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server behind {base_url} exited before it served")
        try:
            with _LOOPBACK.open(base_url.rstrip("/") + "/v1/models", timeout=2.0) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base_url} did not serve within {timeout_s:.0f} s")
