"""AsyncEngine on its own: one engine thread serving asyncio callers, with aborts, timeouts,
shutdown and a failing engine loop (requests fail cleanly, new ones are refused)."""

import asyncio

import pytest
from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.request_stream import (
    EngineStoppedError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
)
from pagoda.errors import RequestError
from pagoda.testing import make_tiny_checkpoint

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("async"), seed=5, vocab_size=260, hidden_size=32,
                                intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, max_position_embeddings=256)
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
                                  max_num_seqs=2))


def idle(engine: LLMEngine) -> bool:
    s = engine.get_stats()
    engine.block_manager.check_invariants()
    return s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0 and not engine.requests


def run(engine, scenario, **kw):
    async def main():
        ae = AsyncEngine(engine, **kw)
        ae.start()
        try:
            return await scenario(ae)
        finally:
            await ae.shutdown()

    return asyncio.run(main())


def test_outputs_match_the_offline_engine_and_bad_requests_are_refused(engine):
    async def scenario(ae):
        with pytest.raises(RequestError) as info:
            await ae.add_request([1, 500], SamplingParams(max_tokens=3))  # token outside the vocabulary
        assert info.value.field == "prompt"
        outs = await asyncio.gather(*[collect(ae, [5, 6, 7 + i]) for i in range(4)])
        return outs, await ae.get_stats()

    async def collect(ae, prompt):
        last = None
        async for out in ae.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)):
            last = out
        return last.outputs[0].token_ids

    outs, stats = run(engine, scenario)
    assert stats["kv_blocks_used"] == 0 and idle(engine)
    engine.add_request("ref", [5, 6, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == outs[2]


def test_closing_a_stream_aborts_and_a_timeout_aborts(engine):
    async def scenario(ae):
        stream = await ae.add_request([3, 4], LONG)
        first = await stream.__anext__()
        assert not first.finished
        stream.close()  # the client went away
        timed = await ae.add_request([3, 4], LONG, timeout=0.02)
        with pytest.raises(RequestTimeoutError):
            async for _ in timed:
                pass
        await asyncio.sleep(0.05)
        return await ae.get_stats(), ae.num_unfinished()

    stats, unfinished = run(engine, scenario)
    assert unfinished == 0
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and idle(engine)


def test_a_deadline_ends_only_the_stream_still_running_at_it(engine):
    """One timer per request: a request that finished before its deadline is not timed out, even when
    its outputs are read after the deadline; one still running at its deadline is aborted."""
    async def scenario(ae):
        warm = await ae.add_request([3, 4], SamplingParams(temperature=0, max_tokens=2))
        [o async for o in warm]  # (the engine's first step is slow: compiled ops, caches)
        short = await ae.add_request([3, 4], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                     timeout=0.5)
        while ae.num_unfinished():  # finished in the engine, nothing read yet
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)  # past its deadline
        outs = [o async for o in short]
        await asyncio.sleep(0.01)  # (a timer left running would have fired by now)
        running = await ae.add_request([3, 5], LONG, timeout=0.05)
        with pytest.raises(RequestTimeoutError):
            async for _ in running:
                pass
        await asyncio.sleep(0.05)  # (the abort reaches the engine thread)
        return outs, short.queue.empty(), ae.num_unfinished()

    outs, nothing_left, unfinished = run(engine, scenario)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert nothing_left and unfinished == 0


def test_queue_limit(engine):
    async def scenario(ae):
        streams = [await ae.add_request([3, i + 4], LONG) for i in range(3)]  # 2 running (max_num_seqs), 1 waiting
        await streams[0].__anext__()
        with pytest.raises(QueueFullError):
            await ae.add_request([3], LONG)
        for s in streams:
            s.close()

    run(engine, scenario, max_queued_requests=1)
    assert idle(engine)


def test_shutdown_aborts_in_flight_requests_and_refuses_new_ones(engine):
    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add_request([7, 8], LONG)
        await stream.__anext__()
        await ae.shutdown(drain_timeout=0.05)
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            await ae.add_request([7], LONG)

    asyncio.run(main())
    assert idle(engine)


def test_a_failing_engine_step_fails_requests_instead_of_hanging(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        monkeypatch.setattr(engine, "step", broken_step)
        stream = await ae.add_request([7, 8], LONG)
        with pytest.raises(RequestAbortedError, match="device lost"):
            async for _ in stream:
                pass
        assert not ae.is_running and "device lost" in str(ae.error)
        with pytest.raises(EngineStoppedError, match="device lost"):
            await ae.add_request([7], LONG)
        await ae.shutdown()

    asyncio.run(main())
    monkeypatch.undo()
    assert idle(engine)
