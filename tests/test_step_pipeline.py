"""The step pipeline (``pagoda.engine.pipeline``) launches each offline step before the previous
one's tokens reach the host. It runs on CUDA devices by default; here it is switched on for the
CPU engine, where it must change nothing in what is generated: chunked prefills, decodes whose
input is a pending token, EOS and length stops in the middle of the pipelined stretch, n > 1
with prefix caching, seeded sampling chosen on the device, and batches that fall back to the usual
path (memory pressure, logprobs, penalties)."""

import pytest
from pagoda import LLM, SamplingParams
from pagoda.engine.scheduler import PENDING_TOKEN
from pagoda.testing import cut_at_stops, hf_greedy_tokens, make_tiny_checkpoint, random_prompts, set_eos_token

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def _llm(path, pipelined: bool, **kw) -> LLM:
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
              **{"num_kv_blocks": 64, "max_num_batched_tokens": 24, "max_model_len": 96, **kw})
    if pipelined:
        llm.engine.enable_step_pipeline()
    return llm


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("pipeline"), seed=4, **TINY)


def test_chunked_prefill_and_decodes_match_transformers(model):
    prompts = random_prompts(6, 256, 3, 40, seed=1)  # prompts longer than the 24-token step budget
    want = hf_greedy_tokens(model, prompts, 10)
    llm = _llm(model, True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.pipeline.launched_ahead > 5
    assert llm.get_stats()["kv_blocks_used"] == 0


def test_eos_and_length_stops_inside_the_pipelined_stretch(model, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(model, path)
    prompts = random_prompts(5, 256, 4, 30, seed=2)
    full = hf_greedy_tokens(path, prompts, 12)
    eos = full[2][4]  # the 5th token of prompt 2 becomes EOS
    set_eos_token(path, eos)
    limits = [12, 3, 12, 7, 1]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in limits]
    plain = _tokens(_llm(path, False).generate(prompts, params))
    llm = _llm(path, True)
    assert _tokens(llm.generate(prompts, params)) == plain
    assert [tokens[0] for tokens in plain] == cut_at_stops(full, eos, limits)
    assert llm.engine.pipeline.launched_ahead > 3
    assert llm.get_stats()["kv_blocks_used"] == 0
    # a second batch on the same engine: a step still in flight from the first is drained
    assert _tokens(llm.generate(prompts[:2], params[:2])) == plain[:2]


def test_siblings_and_shared_prefixes_with_prefix_caching(model):
    base = random_prompts(1, 256, 20, 20, seed=3)[0]
    prompts = [base + [7, 8, 9], base + [10], base[:9]]
    params = SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True)
    plain = _tokens(_llm(model, False).generate(prompts, params))
    llm = _llm(model, True)
    assert _tokens(llm.generate(prompts, params)) == plain
    assert llm.get_stats()["prefix_cache_hit_tokens"] > 0
    assert llm.engine.pipeline.launched_ahead > 0


def test_memory_pressure_and_sampling_fall_back_to_the_usual_path(model):
    prompts = random_prompts(6, 256, 10, 30, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # 14 blocks of 4 tokens cannot hold six sequences of up to 42 tokens: preemption happens
    plain = _tokens(_llm(model, False, num_kv_blocks=14, max_model_len=48).generate(prompts, greedy))
    llm = _llm(model, True, num_kv_blocks=14, max_model_len=48)
    assert _tokens(llm.generate(prompts, greedy)) == plain
    assert llm.get_stats()["num_preemptions"] > 0
    # a seeded sampling request in the batch: its tokens are chosen on the device, a step after launch
    pipeline = llm.engine.pipeline
    mixed = [greedy] * 5 + [SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)]
    before, later = pipeline.launched_ahead, pipeline.sampled_later
    want = _tokens(_llm(model, False).generate(prompts, mixed))
    assert _tokens(llm.generate(prompts, mixed)) == want
    assert pipeline.launched_ahead > before and pipeline.sampled_later > later
    # a request that wants logprobs (or penalties) needs the host: no step is scheduled ahead while it is queued
    for special in (SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True),
                    SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True)):
        mixed = [greedy] * 5 + [special]
        before = pipeline.launched_ahead
        want = _tokens(_llm(model, False).generate(prompts, mixed))
        assert _tokens(llm.generate(prompts, mixed)) == want
        assert pipeline.launched_ahead == before


def test_no_pending_token_is_ever_visible(model):
    llm = _llm(model, True)
    seen = []
    engine = llm.engine
    prompts = random_prompts(4, 256, 5, 25, seed=6)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            seen.extend(out.outputs[0].token_ids)
    assert seen and PENDING_TOKEN not in seen


def test_timeline_marks_every_launch(model):
    """``pagoda bench --profile``'s device timeline: each pipelined launch is marked (host clock
    on a synchronous device), steps are split by kind, and busy plus idle time is the wall time."""
    from pagoda.engine.timeline import StepTimeline

    prompts = random_prompts(6, 256, 3, 40, seed=1)
    llm = _llm(model, True)
    timeline = llm.engine.pipeline.timeline = StepTimeline(llm.engine.platform)
    timeline.start()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    timeline.stop()
    summary = timeline.summary(top=3)
    busy = summary["busy_ms"]
    assert busy["prefill"]["tokens"] + busy["decode"]["tokens"] == sum(map(len, prompts)) + 6 * 9
    assert busy["prefill"]["steps"] + busy["decode"]["steps"] == len(timeline.steps) > 10
    assert min(b["ms"] for b in busy.values()) > 0
    total = sum(b["ms"] for b in busy.values()) + sum(summary["idle_ms"].values())
    assert total == pytest.approx(summary["wall_ms"])
    assert "start -> prefill" in summary["idle_ms"] and "decode -> end" in summary["idle_ms"]
    assert len(summary["largest_gaps_ms"]) == 3


def test_a_platform_that_queues_work_gets_the_pipeline_through_its_own_methods(model, monkeypatch):
    """The core asks the platform, never a device type: one whose ``supports_async_steps`` is set gets the
    step pipeline by default, its ``record_event`` marks each launched step's copy (and is waited on),
    and each step's inputs go through its ``pin``."""
    from pagoda.kernels import host_upload
    from pagoda.platforms.cpu import CpuPlatform

    marks, pinned = [], []

    class Mark:
        def synchronize(self):
            marks.append("waited")

    def record_event(self, timing=False):
        marks.append("recorded")
        return Mark()

    def pin(self, host):
        pinned.append(host.shape)
        return host

    monkeypatch.setattr(CpuPlatform, "supports_async_steps", True)
    monkeypatch.setattr(CpuPlatform, "record_event", record_event)
    monkeypatch.setattr(CpuPlatform, "pin", pin)
    host_upload._pin_for.cache_clear()
    try:
        prompts = random_prompts(4, 256, 3, 30, seed=2)
        llm = _llm(model, False)
        assert llm.engine.pipeline is not None
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        host_upload._pin_for.cache_clear()
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_tokens(model, prompts, 8)
    assert llm.engine.pipeline.launched_ahead > 3
    assert marks.count("recorded") >= llm.engine.pipeline.launched_ahead and "waited" in marks
    assert pinned


def test_streamed_steps_are_launched_ahead_with_async_scheduling(model):
    """``async_scheduling``: streamed steps (``step()``, as the server calls it) go through the pipeline too.
    Every request's streamed tokens only grow, never show a pending token, and end as plain decoding's; a
    request aborted mid-stream leaves the others untouched and gives its blocks back; a request added
    while a step is in flight joins later. Unset, the key means on (where a pipeline exists); false, streamed
    steps run one at a time."""
    prompts = random_prompts(5, 256, 4, 30, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(len(prompts))]
    plain = _tokens(_llm(model, False).generate(prompts, params))
    for async_scheduling in (True, None, False):
        llm = _llm(model, True, async_scheduling=async_scheduling)
        engine = llm.engine
        for i in range(4):
            engine.add_request(f"r{i}", prompts[i], params[i])
        seen: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
                assert PENDING_TOKEN not in tokens and tokens[:len(seen.get(out.request_id, []))] == \
                    seen.get(out.request_id, [])
                seen[out.request_id] = list(tokens)
            steps += 1
            if steps == 3:
                engine.abort_request("r1")
                engine.add_request("r4", prompts[4], params[4])
        assert [seen[f"r{i}"] for i in (0, 2, 3, 4)] == [plain[i][0] for i in (0, 2, 3, 4)]
        assert len(seen.get("r1", [])) < len(plain[1][0])
        assert llm.get_stats()["kv_blocks_used"] == 0
        assert (engine.pipeline.launched_ahead > 3) == (async_scheduling is not False)


def test_async_scheduling_refuses_what_it_cannot_combine_with(model, caplog):
    """Refused by name with speculative decoding and pipeline stages (before loading anything); on a
    platform that runs steps one at a time (the CPU) it is accepted with a warning saying it does nothing."""
    from pagoda.errors import ConfigError

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(ConfigError, match="async_scheduling does not combine with speculative_config"):
        LLM(model=str(model), device="cpu", async_scheduling=True, speculative_config=spec)
    with pytest.raises(ConfigError, match="pipeline_parallel_size: 1"):
        LLM(model=str(model), device="cpu", async_scheduling=True, pipeline_parallel_size=2)
    with caplog.at_level("WARNING", logger="pagoda"):
        _llm(model, False)  # unset: nothing to warn about
        assert "changes nothing" not in caplog.text
        _llm(model, False, async_scheduling=True)
    assert "changes nothing" in caplog.text
