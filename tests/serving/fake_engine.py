"""A small deterministic stand-in for LLMEngine (same contract), for serving tests that need no model.

Tokens are characters; the "model" continues a sequence with a fixed rule (greedy) or a seeded RNG,
and every step emits up to three tokens per request with speculation statistics that add up.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from dspark.engine.outputs import RequestOutput, RequestStats, StepStats, TokenLogprob
from dspark.engine.sampling_params import SamplingParams

EOS = 0
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


class CharTokenizer:
    """Character-level tokenizer with the parts of the transformers API the server uses."""

    eos_token_id = EOS
    chat_template = "{role}: {content}"

    def __len__(self) -> int:
        return len(_CHARS) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [_CHARS.index(c) + 1 for c in text if c in _CHARS]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(_CHARS[i - 1] for i in ids if 0 < i <= len(_CHARS))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def apply_chat_template(
        self, messages, tokenize=False, add_generation_prompt=True, enable_thinking=True, **variables
    ):
        """Qwen3's switch as its template has it: `enable_thinking=False` opens the reply with an
        empty think block; other variables are refused, as a template would fail on them."""
        if variables:
            raise TypeError(f"unexpected template variables {sorted(variables)}")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>" + ("" if enable_thinking else "<think></think>")
        return text


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    on_output: object
    out: list[int] = field(default_factory=list)
    text: str = ""
    rng: random.Random | None = None
    prefilled: bool = False
    stats: RequestStats = field(default_factory=RequestStats)


class FakeEngine:
    """Same surface as LLMEngine; `step_delay_s` makes steps slow enough to observe queues."""

    def __init__(
        self,
        max_num_seqs: int = 4,
        max_model_len: int = 256,
        step_delay_s: float = 0.0,
        policy: str = "static:3",
        fail_on_step: bool = False,
    ):
        self.tokenizer = CharTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs, policy=policy, max_model_len=max_model_len)
        self.step_delay_s = step_delay_s
        self.fail_on_step = fail_on_step
        self.last_step_stats = StepStats()
        self._running: list[_Req] = []
        self._waiting: list[_Req] = []
        self._owner: int | None = None
        self.steps = 0
        self.received: list[tuple[list[int], SamplingParams]] = []  # every accepted request

    def _check_thread(self) -> None:
        # The engine is not thread-safe: everything must come from one thread.
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        assert self._owner == me, "FakeEngine used from two threads"

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def add_request(self, prompt_token_ids, params, request_id=None, on_output=None) -> str:
        self._check_thread()
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len {self.max_model_len}")
        rid = request_id or uuid.uuid4().hex
        rng = random.Random(params.seed) if params.seed is not None else random.Random()
        self._waiting.append(_Req(rid, list(prompt_token_ids), params, on_output, rng=rng))
        self.received.append((list(prompt_token_ids), params))
        return rid

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        for queue in (self._running, self._waiting):
            for r in list(queue):
                if r.rid == request_id:
                    queue.remove(r)
                    self._emit(r, [], "", True, "abort")

    def _emit(self, r: _Req, ids, text, finished, reason, logprobs=None) -> RequestOutput:
        stats = r.stats if finished else None
        out = RequestOutput(
            r.rid, ids, text, finished, reason, None, logprobs, len(r.prompt), len(r.out), stats
        )
        if r.on_output:
            r.on_output(out)
        return out

    def _next_token(self, r: _Req) -> int:
        last = (r.prompt + r.out)[-1]
        if r.params.greedy:
            return 1 + (last * 31 + len(r.out) * 7) % 94
        return r.rng.randrange(1, 95)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self.fail_on_step:
            raise RuntimeError("simulated engine failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        stats = StepStats(accepted_per_position=[0, 0, 0, 0])
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            r = self._waiting.pop(0)
            self._running.append(r)
        outputs = []
        for r in list(self._running):
            if not r.prefilled:
                r.prefilled = True
                stats.num_prefill_tokens += len(r.prompt)
            k = 1 + (self.steps + len(r.out)) % 3  # tokens this step: accepted (k-1) + bonus
            stats.num_drafts += 1
            stats.num_draft_tokens += 3
            stats.num_accepted_tokens += k - 1
            r.stats.rounds += 1
            r.stats.drafts += 1
            r.stats.draft_tokens += 3
            r.stats.accepted_tokens += k - 1
            for pos in range(k - 1):
                stats.accepted_per_position[pos] += 1
            stats.verify_budgets.append(3)
            stats.verify_batch_tokens += 4
            new: list[int] = []
            reason = None
            for _ in range(k):
                tok = self._next_token(r)
                r.out.append(tok)
                new.append(tok)
                if len(r.out) >= r.params.max_tokens:
                    reason = "length"
                    break
            text = self.tokenizer.decode(new)
            full = r.text + text
            for s in r.params.stop:
                if s in full:
                    full = full[: full.index(s)]
                    reason = "stop"
            text = full[len(r.text) :]
            r.text = full
            lps = None
            if r.params.logprobs is not None:
                lps = [
                    TokenLogprob(t, -0.25, [(t, -0.25), (1 + t % 94, -2.0)][: r.params.logprobs]) for t in new
                ]
            finished = reason is not None
            if finished:
                self._running.remove(r)
            outputs.append(self._emit(r, new, text, finished, reason, lps))
        stats.num_running, stats.num_waiting = len(self._running), len(self._waiting)
        stats.forward_time_s = 0.01
        stats.schedule_time_s = 0.0001
        stats.predicted_accepted_tokens = stats.num_accepted_tokens * 1.1  # type: ignore[attr-defined]
        self.last_step_stats = stats
        return outputs


def fake_engine_factory(
    config: object = None, build_s: float = 0.0, building_marker: str | None = None, **settings
) -> FakeEngine:
    """A FakeEngine for the engine process (`functools.partial(fake_engine_factory, ...)` sets it up);
    `build_s` stands for the minutes a real engine takes to load and compile, and the file
    `building_marker` is created when they begin."""
    if building_marker:
        Path(building_marker).touch()
    time.sleep(build_s)
    return FakeEngine(**settings)


def node_recording_factory(config: object, log: str) -> FakeEngine:
    """A FakeEngine built on a thread of a Ray replica (`engine_in_thread`), after writing to the file
    `log` one JSON line: the replica's Ray node, and the SPS profile it was given and what it holds."""
    import json

    import ray

    profile = getattr(config, "sps_profile", None)
    record = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "sps_profile": str(profile) if profile else None,
        "profile_text": Path(profile).read_text() if profile else None,
    }
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
    return FakeEngine()
