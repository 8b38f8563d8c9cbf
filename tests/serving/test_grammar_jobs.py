"""Grammar compilation off the stepping thread: a structured request waits for its grammar while the
batch keeps stepping, on the engine thread and in the engine process alike.

The compile is gated on a file, not timed: it cannot finish until the test has seen other requests
run to completion, so a compile on the stepping thread would hang the plain request instead.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from pathlib import Path

import pytest
from dspark.engine.sampling_params import SamplingParams, StructuredOutput
from dspark.serving.engine_loop import AsyncEngineClient, EngineLoop
from dspark.serving.engine_process import EngineProcess
from dspark.serving.grammar_jobs import COMPILE_NICE, GrammarJobs
from dspark.serving.metrics import ServingMetrics

from tests.serving.fake_engine import FakeEngine
from tests.serving.test_engine_loop import GREEDY, reference
from tests.serving.test_engine_process import collect

STRUCTURED = SamplingParams(
    max_tokens=5, temperature=0, structured=StructuredOutput(kind="regex", value="[a-z]+")
)
INVALID = SamplingParams(max_tokens=5, temperature=0, structured=StructuredOutput(kind="regex", value="("))


class GatedGrammarEngine(FakeEngine):
    """A FakeEngine whose grammar compile waits until the file `gate` exists, and records where it
    ran; a regex of "(" is invalid."""

    def __init__(self, gate: str, **settings):
        super().__init__(**settings)
        self.gate = Path(gate)
        self.compile_threads: list[int] = []
        self.step_threads: set[int] = set()
        self.grammars_received: list[object] = []

    def compile_grammar(self, params: SamplingParams) -> object | None:
        self.compile_threads.append(threading.get_ident())
        while not self.gate.exists():
            time.sleep(0.01)
        if params.structured.value == "(":
            raise ValueError("invalid regex: unbalanced parenthesis")
        return ("grammar", params.structured.value)

    def add_request(self, prompt_token_ids, params, request_id=None, on_output=None, grammar=None):
        if params.structured is not None:
            assert grammar is not None, "a structured request reached the engine uncompiled"
            self.grammars_received.append(grammar)
        return super().add_request(prompt_token_ids, params, request_id, on_output)

    def step(self):
        self.step_threads.add(threading.get_ident())
        return super().step()


def gated_engine_factory(config: object, gate: str) -> GatedGrammarEngine:
    return GatedGrammarEngine(gate, max_num_seqs=4, step_delay_s=0.002)


@pytest.fixture(params=["thread", "process"])
def backend(request, tmp_path):
    gate = tmp_path / "compile-may-finish"
    if request.param == "thread":
        b = EngineLoop(gated_engine_factory(None, str(gate)), ServingMetrics("fake"), idle_poll_s=0.05)
    else:
        factory = functools.partial(gated_engine_factory, gate=str(gate))
        b = EngineProcess(factory, None, ServingMetrics("fake"))
    b.start()
    yield b, gate
    gate.touch()
    b.stop(drain_timeout_s=2)


def test_the_batch_steps_while_a_grammar_compiles(backend):
    engine, gate = backend
    client = AsyncEngineClient(engine, max_in_flight=8)

    async def main():
        structured = asyncio.create_task(collect(client, [3, 4], STRUCTURED))
        await asyncio.sleep(0.1)  # sent before the plain requests
        plain = await asyncio.wait_for(
            asyncio.gather(*(collect(client, [5 + i, 7], GREEDY) for i in range(3))), 30
        )
        assert not structured.done()  # still waiting for its grammar
        gate.touch()
        return plain, await asyncio.wait_for(structured, 30)

    plain, (ids, last) = asyncio.run(main())
    for i, (p_ids, p_last) in enumerate(plain):
        assert p_ids == reference([5 + i, 7], GREEDY) and p_last.finish_reason == "length"
    assert len(ids) == 5 and last.finish_reason == "length"
    if isinstance(engine, EngineLoop):
        fake = engine.engine
        assert fake.grammars_received == [("grammar", "[a-z]+")]
        assert fake.compile_threads and not set(fake.compile_threads) & fake.step_threads


def test_an_invalid_grammar_is_refused_with_its_error(backend):
    engine, gate = backend
    client = AsyncEngineClient(engine, max_in_flight=8)
    gate.touch()

    async def main():
        with pytest.raises(ValueError, match="unbalanced parenthesis"):
            await asyncio.wait_for(collect(client, [3, 4], INVALID), 30)
        return await asyncio.wait_for(collect(client, [5, 7], GREEDY), 30)

    ids, _ = asyncio.run(main())
    assert ids == reference([5, 7], GREEDY)
    assert client.in_flight == 0


def test_a_request_that_leaves_while_its_grammar_compiles_is_forgotten(backend):
    engine, gate = backend
    client = AsyncEngineClient(engine, max_in_flight=8)

    async def main():
        waiting = asyncio.create_task(collect(client, [3, 4], STRUCTURED))
        await asyncio.sleep(0.2)
        waiting.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.touch()
        return await asyncio.wait_for(collect(client, [5, 7], GREEDY), 30)

    ids, _ = asyncio.run(main())
    assert ids == reference([5, 7], GREEDY)
    if isinstance(engine, EngineLoop):
        time.sleep(0.3)
        assert engine.engine.grammars_received == []  # compiled, but never admitted


def test_grammars_compile_at_a_lower_cpu_priority():
    """A compile takes only the cores the steps leave: its thread runs at nice 10."""
    done = threading.Event()

    class Recorder:
        nice: int | None = None

        def compile_grammar(self, params):
            Recorder.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return "grammar"

    jobs = GrammarJobs(Recorder(), wake=done.set)
    try:
        jobs.submit("r1", "item", STRUCTURED)
        assert done.wait(5)
        assert jobs.take_done() == [("item", "grammar", None)]
        assert Recorder.nice == COMPILE_NICE == 10
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < COMPILE_NICE
    finally:
        jobs.shutdown()
