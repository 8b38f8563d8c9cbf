"""One load-test run's state inside the Locust process: the tier, the plan, the raw samples."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from dspark_loadtest.prompts import PromptSampler
from dspark_loadtest.server_metrics import Snapshot
from dspark_loadtest.shapes import Stage, peak_users, stages
from dspark_loadtest.stream import RequestSample
from dspark_loadtest.tiers import Tier, TierFile


def parse_mix(text: str) -> dict[str, float]:
    """`math=1,code=2` -> {"math": 1.0, "code": 2.0}; a clear error otherwise."""
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"bad mix entry {part!r}; expected domain=weight, e.g. math=1,code=2") from None
    if not mix:
        raise ValueError("empty mix; expected domain=weight, e.g. math=1,code=2")
    return mix


def resolve_tier(
    tiers: TierFile,
    name: str | None,
    *,
    concurrency: int | None = None,
    seconds: float | None = None,
    api: str | None = None,
    mix: str | None = None,
    prompt_words: int | None = None,
    max_tokens: int | None = None,
    max_requests: int | None = None,
    max_error_ratio: float | None = None,
) -> Tier:
    """The named tier (the first when unnamed) with command-line overrides, validated again."""
    tier = tiers.get(name) if name else tiers.tiers[0]
    raw = tier.model_dump(by_alias=True, exclude_none=True)
    workload = raw["workload"]
    for key, value in (("api", api), ("promptWords", prompt_words), ("maxTokens", max_tokens)):
        if value is not None:
            workload[key] = value
    if mix:
        workload["mix"] = parse_mix(mix)
    if concurrency is not None or seconds is not None:
        raw["load"] = {
            "shape": "constant",
            "users": concurrency or peak_users(stages(tier.load)),
            "duration": seconds or tier.load.duration,
        }
    if max_requests is not None:
        raw["maxRequests"] = max_requests
    if max_error_ratio is not None:
        raw["maxErrorRatio"] = max_error_ratio
    return Tier.model_validate(raw)


@dataclass
class LoadRun:
    tier: Tier
    host: str
    api_prefix: str = "/v1"
    api_key: str | None = None
    model: str | None = None
    seed: int | None = None
    report_prefix: str = "dspark-loadtest"
    plan: list[Stage] = field(init=False)
    sampler: PromptSampler = field(init=False)
    samples: list[RequestSample] = field(default_factory=list)
    metrics_before: Snapshot | None = None
    started: int = 0
    cap_reached: bool = False
    aborted: str | None = None  # why the run stopped before it could measure anything
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.plan = stages(self.tier.load)
        self.sampler = PromptSampler(self.tier.workload, self.seed)
        self._rng = random.Random(self.seed)

    @property
    def headers(self) -> dict[str, str]:
        # identity encoding: a compressed stream could not be read line by line as it arrives
        h = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    @property
    def seconds_between_requests(self) -> float:
        """Per-user pacing that spreads the tier's arrival rate over its peak users (0: back to back)."""
        rate = self.tier.load.arrival_rate
        return peak_users(self.plan) / rate if rate else 0.0

    def admit(self) -> bool:
        """Count a request against the tier's cap; False once the cap is reached."""
        with self._lock:
            if self.started >= self.tier.max_requests:
                self.cap_reached = True
                return False
            self.started += 1
            return True

    def pick_api(self) -> str:
        api = self.tier.workload.api
        return self._rng.choice(("chat", "completions")) if api == "mixed" else api

    def request_body(self, api: str, prompt: str) -> dict:
        w = self.tier.workload
        body = {
            "model": self.model,
            "max_tokens": w.max_tokens,
            "temperature": w.temperature,
            "ignore_eos": w.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if api == "chat":
            # logprobs without alternatives: one entry per token, so a multi-token chunk is counted right
            body.update(messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=0)
        else:
            body.update(prompt=prompt, logprobs=0)
        return body

    def path(self, api: str) -> str:
        return f"{self.api_prefix}/chat/completions" if api == "chat" else f"{self.api_prefix}/completions"
