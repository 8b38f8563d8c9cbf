"""Per-request measurements taken from the raw SSE stream of an OpenAI-compatible server.

Tokens per chunk come from the chunk's logprobs (the load test asks for them with no alternatives),
so a speculative step that delivers k tokens in one chunk counts k tokens. The gap before such a
chunk is split into k inter-token gaps of gap/k: the same convention as the server's
`vllm:inter_token_latency_seconds`, so both sides can be compared.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class RequestSample:
    """One request as the client saw it. Times in seconds; `start` is wall-clock (epoch)."""

    api: str
    domain: str
    start: float
    ok: bool = False
    cut: bool = False  # still streaming when the run ended: TTFT known, neither success nor failure
    status: int = 0
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    chunks: int = 0  # chunks that carried tokens
    chunk_gaps: list[tuple[float, int]] = field(
        default_factory=list
    )  # (seconds since previous chunk, tokens)
    decode_s: float | None = None  # first token to last token

    @property
    def itl_s(self) -> list[float]:
        """Inter-token gaps, a k-token chunk's gap counted as k gaps of gap/k."""
        return [gap / n for gap, n in self.chunk_gaps for _ in range(n)]

    @property
    def tpot_s(self) -> float | None:
        if self.decode_s is None or self.output_tokens < 2:
            return None
        return self.decode_s / (self.output_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Per-user decode speed, (tokens - 1) / (last token - first token): 1 / TPOT."""
        tpot = self.tpot_s
        return 1.0 / tpot if tpot else None

    @property
    def tokens_per_chunk(self) -> float | None:
        """Tokens per streamed chunk: with speculative decoding, accepted draft tokens + 1 per step."""
        return self.output_tokens / self.chunks if self.chunks else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(tpot_s=self.tpot_s, tokens_per_s=self.tokens_per_s, tokens_per_chunk=self.tokens_per_chunk)
        return d


class StreamError(Exception):
    """The server reported an error inside the stream, or the stream was malformed."""


class StreamMeter:
    """Feed it the stream's lines with their arrival times (perf_counter); it fills a RequestSample."""

    def __init__(self, sample: RequestSample, sent_at: float):
        self.sample = sample
        self.sent_at = sent_at
        self.first: float | None = None
        self.last: float | None = None
        self.counted_tokens = 0
        self.done = False

    def feed(self, line: bytes | str, t: float) -> None:
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as e:
            raise StreamError(f"malformed stream chunk {data[:80]!r}: {e}") from None
        if "error" in chunk:
            err = chunk["error"]
            raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if usage := chunk.get("usage"):
            self.sample.prompt_tokens = usage.get("prompt_tokens")
            self.sample.output_tokens = usage.get("completion_tokens", self.counted_tokens)
        for choice in chunk.get("choices") or ():
            n = _tokens_in(choice)
            if n:
                self._tokens(n, t)

    def _tokens(self, n: int, t: float) -> None:
        if self.first is None:
            self.first = t
            self.sample.ttft_s = t - self.sent_at
        else:
            self.sample.chunk_gaps.append((t - self.last, n))
        self.last = t
        self.counted_tokens += n
        self.sample.chunks += 1

    def finish(self, t: float) -> RequestSample:
        if not self.done:
            raise StreamError("stream ended without [DONE]")
        self._close(t)
        self.sample.ok = True
        return self.sample

    def cut(self, t: float) -> RequestSample:
        """The run ended mid-stream: keep the tokens and timings seen so far."""
        self._close(t)
        self.sample.cut = True
        return self.sample

    def _close(self, t: float) -> None:
        s = self.sample
        s.e2e_s = t - self.sent_at
        if not s.output_tokens:
            s.output_tokens = self.counted_tokens
        if self.first is not None and self.last is not None:
            s.decode_s = self.last - self.first


def _tokens_in(choice: dict) -> int:
    """Tokens in one streamed choice: from its logprobs when present, else 1 if it carries text."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        if isinstance(lp.get("content"), list):  # chat
            return len(lp["content"])
        if isinstance(lp.get("tokens"), list):  # completions
            return len(lp["tokens"])
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return 1 if text else 0
