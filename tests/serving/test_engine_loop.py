import asyncio
import threading

import pytest
from dspark.engine.sampling_params import SamplingParams
from dspark.serving.engine_loop import AsyncEngineClient, EngineLoop, EngineStopped, QueueFull
from dspark.serving.metrics import ServingMetrics

from tests.serving.fake_engine import FakeEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def reference(prompt: list[int], params: SamplingParams) -> list[int]:
    """What the engine produces for a request on its own."""
    engine = FakeEngine()
    engine.add_request(prompt, params, "ref")
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    return out


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def loop():
    engine = FakeEngine(max_num_seqs=4)
    lp = EngineLoop(engine, ServingMetrics("fake"), idle_poll_s=0.05)
    lp.start()
    yield lp
    lp.stop(drain_timeout_s=2)


def test_concurrent_requests_share_batches_and_match_solo_runs(loop):
    client = AsyncEngineClient(loop, max_in_flight=32)
    prompts = [[5 + i, 7, 9 + i] for i in range(10)]

    async def one(p):
        ids = []
        async with client.open(p, GREEDY) as stream:
            async for out in stream:
                ids += out.new_token_ids
                last = out
        return ids, last.finish_reason

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = run(main())
    for p, (ids, reason) in zip(prompts, results, strict=True):
        assert ids == reference(p, GREEDY) and reason == "length" and len(ids) == 12
    # 10 requests of 12 tokens at most 3 tokens per step: batching means far fewer than 10 * 4 steps
    assert loop.engine.steps < 25
    assert client.in_flight == 0


def test_admission_limit_raises_queue_full(loop):
    client = AsyncEngineClient(loop, max_in_flight=2)
    loop.engine.step_delay_s = 0.02

    async def main():
        async with client.open([1, 2], GREEDY), client.open([3, 4], GREEDY):
            with pytest.raises(QueueFull):
                async with client.open([5, 6], GREEDY):
                    pass
        assert client.in_flight == 0

    run(main())


def test_leaving_early_aborts_and_frees_the_slot(loop):
    client = AsyncEngineClient(loop, max_in_flight=8)
    loop.engine.step_delay_s = 0.02
    long = SamplingParams(max_tokens=200, temperature=0)

    async def main():
        async with client.open([1, 2, 3], long) as stream:
            await anext(stream)
        for _ in range(100):
            if loop.engine.num_running == 0 and not loop.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)

    run(main())
    assert not loop.engine.has_unfinished_requests()
    gauge = loop.metrics.num_running.labels("fake")._value.get()
    assert gauge == 0


def test_engine_value_error_reaches_the_caller(loop):
    client = AsyncEngineClient(loop, max_in_flight=8)

    async def main():
        with pytest.raises(ValueError, match="empty prompt"):
            async with client.open([], GREEDY):
                pass
        assert client.in_flight == 0

    run(main())


def test_cancelled_task_aborts_request(loop):
    client = AsyncEngineClient(loop, max_in_flight=8)
    loop.engine.step_delay_s = 0.02

    async def consume():
        async with client.open([4, 4], SamplingParams(max_tokens=200, temperature=0)) as stream:
            async for _ in stream:
                pass

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not loop.engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.02)

    run(main())
    assert not loop.engine.has_unfinished_requests() and client.in_flight == 0


def test_stop_drains_running_requests_then_refuses_new_ones():
    engine = FakeEngine(step_delay_s=0.01)
    lp = EngineLoop(engine, idle_poll_s=0.05)
    lp.start()
    finished = threading.Event()
    outs = []

    def on_output(o):
        outs.append(o)
        if o.finished:
            finished.set()

    lp.add([1, 2, 3], SamplingParams(max_tokens=30, temperature=0), "r1", on_output).result(timeout=5)
    lp.stop(drain_timeout_s=10)
    assert finished.is_set() and outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 30
    with pytest.raises(EngineStopped):
        lp.add([1], GREEDY, "r2", on_output).result(timeout=1)


def test_stop_timeout_aborts_what_is_left():
    engine = FakeEngine(step_delay_s=0.05)
    lp = EngineLoop(engine, idle_poll_s=0.05)
    lp.start()
    outs = []
    lp.add([1, 2], SamplingParams(max_tokens=250, temperature=0), "r", outs.append).result(timeout=5)
    lp.stop(drain_timeout_s=0.2)
    assert not lp._thread.is_alive()
    assert outs[-1].finished and outs[-1].finish_reason in ("abort", "error")


def test_engine_crash_fails_callers_instead_of_hanging():
    engine = FakeEngine(fail_on_step=True)
    lp = EngineLoop(engine, idle_poll_s=0.05)
    lp.start()
    client = AsyncEngineClient(lp, max_in_flight=4)

    async def main():
        async with client.open([1, 2], GREEDY) as stream:
            outs = [o async for o in stream]
        return outs

    outs = run(main())
    assert outs[-1].finish_reason == "error" and "simulated engine failure" in outs[-1].error
    assert not lp.alive and "simulated" in lp.fatal_error

    async def again():
        async with client.open([1, 2], GREEDY):
            pass

    with pytest.raises(EngineStopped):
        run(again())
    lp.stop(1)


def test_a_consumer_that_falls_behind_gets_one_merged_output():
    from dspark.engine.outputs import RequestOutput, TokenLogprob
    from dspark.serving.engine_loop import RequestStream

    async def main():
        stream = RequestStream("r", asyncio.get_running_loop())
        stream.put(RequestOutput("r", [1, 2], "ab", logprobs=[TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)]))
        stream.put(RequestOutput("r", [3], "c", logprobs=[TokenLogprob(3, -0.3)], num_output_tokens=3))
        stream.put(RequestOutput("r", [4], "d", finished=True, finish_reason="length", num_output_tokens=4))
        stream.put(RequestOutput("r", [9], "late"))  # never read: the request already finished
        return [out async for out in stream]

    (out,) = run(main())
    assert out.new_token_ids == [1, 2, 3, 4] and out.new_text == "abcd"
    assert [lp.token_id for lp in out.logprobs] == [1, 2, 3]
    assert out.finished and out.finish_reason == "length" and out.num_output_tokens == 4


def test_a_step_is_in_the_metrics_before_its_outputs_reach_the_caller(loop):
    """A caller holding its last token reads metrics that include that step (a /metrics scrape
    right after a response once saw the request still running)."""
    running: list[float] = []
    done = threading.Event()
    gauge = loop.metrics.num_running.labels("fake")

    def on_output(out) -> None:
        running.append(gauge._value.get())
        if out.finished:
            done.set()

    loop.add([1, 2, 3], GREEDY, "r", on_output).result(timeout=5)
    assert done.wait(5)
    # Each output sees its own step's count: running until the step that finished it.
    assert len(running) > 1 and running == [1] * (len(running) - 1) + [0]
