"""Multi-turn chat load: each user's conversation grows turn by turn over one shared system prompt,
the traffic prefix caching serves (every turn's prompt starts with the previous turn's prompt and
answer). Run it with `locust -f loadtest/multiturn_locustfile.py`; the end of the run prints the
TTFT percentiles per turn (and writes them to --multiturn-report as JSON).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time

import numpy as np
from dspark.prompts.builtin import BUILTIN_PROMPTS
from locust import events, task
from locust.contrib.fasthttp import FastHttpUser

log = logging.getLogger("dspark_loadtest.multiturn")

SYSTEM_PROMPT = (
    "You are the support assistant of a software company. Follow these rules in every answer. "
    "Be accurate: when you are not sure, say so and explain what would settle the question. "
    "Be brief: lead with the answer, then the reasoning, then an example when one helps. "
    "Write code in fenced blocks with the language named, and keep examples small enough to run. "
    "Prefer the standard library over third-party packages unless the user names one. "
    "When a question is ambiguous, state the reading you chose before answering it. "
    "Never invent APIs, flags, file names or version numbers; point to the documentation instead. "
    "For arithmetic, show the steps and check the result a second way. "
    "For questions about people, places or events, stick to well-established facts. "
    "Keep a friendly, plain tone, avoid jargon that the user did not use, and do not repeat the "
    "question back. If the user asks for a change to an earlier answer, give the whole new answer."
)
FOLLOW_UPS = (
    "Can you make that shorter?",
    "Give me one more example.",
    "Why is that the case?",
    "What would change if the input were twice as large?",
    "Summarise your answer in one sentence.",
)


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    g = parser.add_argument_group("DSpark multi-turn chat")
    g.add_argument("--turns", type=int, default=4, help="Turns per conversation before a new one starts")
    g.add_argument("--chat-max-tokens", type=int, default=32, help="max_tokens of each answer")
    g.add_argument("--chat-model", default="", help="Model name (default: the server's first model)")
    g.add_argument("--multiturn-report", default="", help="Write the TTFT figures here (JSON)")
    g.add_argument(
        "--system-words",
        type=int,
        default=600,
        help="Lengthen the shared system prompt to at least this many words with reference material",
    )
    g.add_argument("--chat-seed", type=int, default=0, help="Seed of the questions each user asks")
    # The API key, if any, comes from DSPARK_API_KEY (kept off the command line).


def system_prompt(min_words: int) -> str:
    """The rules, then earlier user questions as reference material up to `min_words` words: the
    same text for every user (a deployment's system prompt)."""
    pool = [q for domain in ("chat", "code", "math") for q in BUILTIN_PROMPTS[domain]]
    parts, words = [SYSTEM_PROMPT, "Questions users asked before, for reference:"], len(SYSTEM_PROMPT.split())
    for i in range(len(pool) * 4):
        if words >= min_words:
            break
        parts.append(f"- {pool[i % len(pool)]}")
        words += len(pool[i % len(pool)].split()) + 1
    return "\n".join(parts) if words > len(SYSTEM_PROMPT.split()) else SYSTEM_PROMPT


@events.test_start.add_listener
def _on_start(environment, **_kw) -> None:
    environment.multiturn_ttft = {}  # turn -> [seconds]


@events.test_stop.add_listener
def _on_stop(environment, **_kw) -> None:
    samples: dict[int, list[float]] = getattr(environment, "multiturn_ttft", {})
    report = {"turns": {}, "all": _percentiles([t for ttfts in samples.values() for t in ttfts])}
    for turn in sorted(samples):
        report["turns"][turn] = _percentiles(samples[turn])
    print("multi-turn TTFT (s): " + json.dumps(report), flush=True)
    o = environment.parsed_options
    if o is not None and o.multiturn_report:
        with open(o.multiturn_report, "w") as f:
            json.dump(report, f, indent=2)


def _percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    p50, p95 = np.percentile(values, [50, 95])
    return {"n": len(values), "p50": float(p50), "p95": float(p95), "mean": float(np.mean(values))}


class MultiTurnChatUser(FastHttpUser):
    """One conversation at a time: ask, read the streamed answer, append both, ask a follow-up."""

    network_timeout = 300.0
    connection_timeout = 10.0
    _next_id = 0

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.turns = o.turns if o is not None else 4
        self.max_tokens = o.chat_max_tokens if o is not None else 32
        seed = o.chat_seed if o is not None else 0
        self.system = system_prompt(o.system_words if o is not None else 600)
        MultiTurnChatUser._next_id += 1
        self.rng = random.Random(seed * 1000 + MultiTurnChatUser._next_id)
        key = os.environ.get("DSPARK_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = (o.chat_model if o is not None else "") or self._discover_model()
        self._new_conversation()

    def _discover_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, catch_response=True) as resp:
            return resp.json()["data"][0]["id"]

    def _new_conversation(self) -> None:
        question = self.rng.choice(BUILTIN_PROMPTS["chat"] + BUILTIN_PROMPTS["code"])
        self.messages = [{"role": "system", "content": self.system}, {"role": "user", "content": question}]
        self.turn = 0

    @task
    def ask(self) -> None:
        body = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        sent = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=self.headers,
            stream=True,
            catch_response=True,
            name=f"turn-{self.turn}",
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.content or b'')[:200]!r}")
                self._new_conversation()
                return
            ttft, answer = read_chat_stream(resp._response, sent)
            if ttft is None:
                resp.failure("no content streamed")
                self._new_conversation()
                return
        self._record_ttft(ttft)
        self._next_turn(answer)

    def _record_ttft(self, ttft: float) -> None:
        """The turn's TTFT, kept per turn and reported to Locust as a request type of its own."""
        self.environment.multiturn_ttft.setdefault(self.turn, []).append(ttft)
        self.environment.events.request.fire(
            request_type="TTFT",
            name=f"turn-{self.turn}",
            response_time=ttft * 1000,
            response_length=0,
            exception=None,
            context={},
        )

    def _next_turn(self, answer: str) -> None:
        """The answer and a follow-up question join the conversation, or a new one starts after the last turn."""
        self.turn += 1
        if self.turn >= self.turns:
            self._new_conversation()
            return
        self.messages.append({"role": "assistant", "content": answer})
        self.messages.append({"role": "user", "content": self.rng.choice(FOLLOW_UPS)})


def read_chat_stream(raw, sent: float) -> tuple[float | None, str]:
    """Seconds from `sent` to the first content of a streamed chat completion (None if none came),
    and the whole content. Lines are read on LF: SSE events end in LF, not CRLF."""
    ttft, parts = None, []
    while line := raw.readline(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        choices = json.loads(line[5:]).get("choices") or [{}]
        content = (choices[0].get("delta") or {}).get("content")
        if content:
            ttft = ttft if ttft is not None else time.perf_counter() - sent
            parts.append(content)
    return ttft, "".join(parts)
