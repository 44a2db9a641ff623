"""Tensor parallelism on CPU (gloo, 2 processes): Llama-family models against one process and
transformers, torchrun, worker failures, and the pieces (step plan and its copies, lazy slices, checks)."""

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.distributed.process_group import RankInfo, check_world
from pagoda.engine.executor.control import Kind
from pagoda.engine.executor.failures import WorkerError, describe_exit, read_failure, report_failure
from pagoda.engine.executor.step_codec import decode_plan, encode_plan
from pagoda.engine.executor.tensor_parallel import TensorParallelExecutor, _Run
from pagoda.engine.executor.worker_main import serve_rank
from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagoda.engine.sequence import Sequence
from pagoda.engine.step_plan import StepPlan, plan_step
from pagoda.errors import ConfigError
from pagoda.interfaces import Platform
from pagoda.loader.lazy_tensor import LazyTensor
from pagoda.testing import hf_greedy_tokens, hf_prompt_logits, make_tiny_checkpoint, random_prompts

pytestmark = pytest.mark.timeout(300)  # a hang in a collective fails the test instead of the run
VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256)
# Llama: GQA (2 KV heads, one per rank), biases; Qwen3: one KV head (replicated on both ranks),
# q/k norms, tied embeddings (the vocab-parallel embedding doubles as the LM head).
LLAMA = dict(TINY, num_key_value_heads=2, attention_bias=True)
QWEN3 = dict(TINY, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
# small cache and token budget: chunked prefill, preemption and prefix-cache hits all happen
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=12, block_size=8, max_num_batched_tokens=24,
              max_model_len=80)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[list[int]]:
    prompts = random_prompts(5, VOCAB, 5, 40, seed=7)
    return prompts + [prompts[4][:17] + [9, 9, 9]]  # shares two cached blocks with prompt 4


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


_LIVE_TP_ENGINES: list[LLM] = []


def _tp2_engine(path) -> LLM:
    """A TP=2 engine, after shutting down the module's previous one: a process holds one tensor-parallel
    engine at a time, and module-scoped fixtures live until the module ends (so that ``-k`` may select
    tests of both fixtures)."""
    while _LIVE_TP_ENGINES:
        _LIVE_TP_ENGINES.pop().shutdown()
    llm = LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    _LIVE_TP_ENGINES.append(llm)
    return llm


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=1, tokenizer=True, **LLAMA)


@pytest.fixture(scope="module")
def llama(llama_path):
    llm = _tp2_engine(llama_path)
    yield llama_path, llm
    llm.shutdown()


def test_tp2_greedy_matches_one_process_and_transformers(llama):
    path, llm = llama
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY)
    assert _tokens(outs) == hf_greedy_tokens(path, prompts, 24)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_blocks_used"] == 0
    # seeded sampling: rank 0 samples from the gathered logits exactly as one process does
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)
    single = LLM(model=str(path), **ENGINE)
    assert _tokens(llm.generate(prompts[:3], seeded)) == _tokens(single.generate(prompts[:3], seeded))


def test_tp2_step_pipeline_generates_what_transformers_does(llama):
    """The step pipeline over two ranks (on by default where the platform queues work; switched on here):
    chunked prefills and decodes launched before the previous step's tokens are known, each rank feeding
    its own copy of them. Preemptions between pipelined stretches recompute sequences from the mirrors'
    token ids, which must hold the real tokens by then, not the pending stand-ins."""
    path, llm = llama
    before = llm.get_stats()["num_preemptions"]
    llm.engine.enable_step_pipeline()
    try:
        prompts = _prompts()
        assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy_tokens(path, prompts, 24)
        assert llm.engine.pipeline.launched_ahead > 5
        assert llm.get_stats()["num_preemptions"] > before and llm.get_stats()["kv_blocks_used"] == 0
    finally:
        llm.engine.pipeline = None


def test_tp2_prompt_logits_match_transformers(llama):
    path, llm = llama
    prompt = random_prompts(1, VOCAB, 40, 40, seed=3)[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), hf_prompt_logits(path, prompt), atol=2e-4, rtol=2e-4)


def test_second_tensor_parallel_engine_is_refused_and_the_first_keeps_working(llama):
    path, llm = llama
    with pytest.raises(ConfigError, match="one tensor-parallel engine per process"):
        LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_tp2_rank0_holds_half_of_each_sharded_weight(llama):
    _, llm = llama
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert model.model.embed_tokens.weight.shape == (VOCAB // 2, 64)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 64)
    assert llm.engine.runner.spec_summary()[0].num_kv_heads == 1


def test_torchrun_generate_matches_one_process(llama_path, tmp_path):
    path = llama_path
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    assert torchrun, "torchrun ships with torch"
    prompts = ["hello there", "tensor parallel"]
    cmd = [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "-m", "pagoda.cli.main", "generate",
           "--model", str(path), "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2",
           "--num-kv-blocks", "16", "--max-tokens", "12", "--ignore-eos", "--json"]
    for p in prompts:
        cmd += ["--prompt", p]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.loads(line)["outputs"][0]["token_ids"] for line in done.stdout.splitlines() if line.startswith("{")]
    single = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16)
    assert got == _tokens(single.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))


def test_killed_worker_stops_the_engine_with_a_clear_error(llama):
    """Last user of the shared engine: it leaves it broken."""
    _, llm = llama
    pid = llm.engine.runner.worker_pid(1)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL") as err:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert err.value.ranks == [1]
    with pytest.raises(WorkerError, match="rank 1"):  # and it stays stopped
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert not _gloo_threads()  # the stopped run freed its group (the error kept no frame holding it)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), seed=4, tokenizer=True, **QWEN3)
    llm = _tp2_engine(path)
    yield path, llm
    llm.shutdown()


def test_tp2_replicated_kv_head_and_tied_embeddings(qwen3):
    path, llm = qwen3
    prompts = _prompts()
    assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy_tokens(path, prompts, 24)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.qkv_proj.kv_replicas) == (2, 1, 2)


def test_serve_over_tp2(qwen3):
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.server import ServerConfig, ServerThread
    from pagoda.server.app import create_app

    _, llm = qwen3
    request = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0}
    with ServerThread(create_app(AsyncEngine(llm.engine), ServerConfig(served_model_name="tiny"))) as srv:
        reply = httpx.post(srv.url + "/v1/completions", json=request, timeout=60)
    assert reply.status_code == 200, reply.text
    expected = llm.generate("hello", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert reply.json()["choices"][0]["text"] == expected


def test_worker_exception_names_rank_and_exception(qwen3):
    _, llm = qwen3
    executor = llm.engine.runner
    executor.driver.only_on_rank0 = lambda: 1  # rank 1's runner has no such method: AttributeError there
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) raised AttributeError: .*only_on_rank0"):
        executor.call("only_on_rank0")
    with pytest.raises(WorkerError):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert not _gloo_threads()  # the stopped run freed its group (the error kept no frame holding it)


# ---------------------------------------------------------------------------- pieces, no processes
class _LoopbackChannel:
    """Rank 0's and rank 1's ends of the control channel in one process (queues, no group)."""

    world_size = 2

    def __init__(self):
        self.messages, self.results = queue.Queue(), queue.Queue()

    def send(self, kind, payload=None, mode=0, arg=0):
        self.messages.put((kind, mode, arg, payload))

    def send_words(self, words, mode, arg=0):
        self.messages.put((Kind.STEP, mode, arg, words.copy()))

    def send_call(self, name, args, kwargs):
        self.messages.put((Kind.CALL, 0, 0, (name, args, kwargs)))

    def gather_results(self, own):
        return [own, self.results.get(timeout=10)]

    def receive(self):
        return self.messages.get(timeout=10)

    def send_result(self, result):
        self.results.put(result)

    def close(self):
        pass


class _RecordingRunner:
    """Stands for a rank's ModelRunner: records what it is asked to run; a launched decode
    step's tokens are its input ids + 1 (as a model's argmax would be, identical on all ranks)."""

    def __init__(self):
        self.log, self.sampler = [], None

    def launch(self, plan, feed=None, how="host"):
        if how == "host":
            self.log.append(("execute", [(r.seq_id, r.tokens[-1]) for r in plan.rows]))
            return None
        ids = torch.tensor([r.tokens[-1] for r in plan.rows])
        if feed is not None:
            ids.index_copy_(0, feed.rows, feed.tokens.index_select(0, feed.indices))
        self.log.append(("launch", [r.num_computed_tokens for r in plan.rows], ids.tolist()))
        return SimpleNamespace(tokens=ids + 1)

    def collect(self, pending):
        return SimpleNamespace(tokens=pending.tokens.tolist())

    def forget(self, seq_id):
        self.log.append(("forget", seq_id))

    def available_kv_blocks(self):
        return 7

    def allocate_kv_cache(self, num_blocks):
        self.log.append(("allocate", num_blocks))


def test_tp2_gpt_oss_with_window_groups(tmp_path):
    """GPT-OSS over 2 ranks: each rank's sink logits and expert slices (biases: the down bias added
    once), and the window layers' own block tables mirrored on the other rank."""
    path = make_tiny_checkpoint("gpt_oss", tmp_path, seed=2, **dict(
        TINY, num_key_value_heads=2, intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=12, rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                truncate=False, original_max_position_embeddings=32,
                                                rope_theta=150000.0)))
    llm = _tp2_engine(path)
    try:
        assert llm.engine.runner.kv_layout.windows == (None, 12)
        prompts = _prompts()
        assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy_tokens(path, prompts, 24)
        assert llm.get_stats()["kv_blocks_used"] == 0
    finally:
        _LIVE_TP_ENGINES.remove(llm)
        llm.shutdown()
    # the process group's backend went with it, its threads too (not left for the interpreter's exit, where one
    # asking for the GIL aborts the process: destroy_parallel_state)
    assert not _gloo_threads()


def _gloo_threads() -> set[tuple[str, str]]:
    """(thread id, name) of this process's threads that belong to gloo (Linux)."""
    found = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # (a thread that ended meanwhile)
            continue
        if "gloo" in name:
            found.add((task, name))
    return found


def test_pipelined_launches_reach_every_rank_with_its_own_device_tokens():
    """The step pipeline's protocol under tensor parallelism: a launched step fed from the previous
    launch's tokens reaches the other rank with the fed rows, which it fills from its own copy of those
    tokens; a row not fed carries its real token in the plan."""
    from pagoda.engine.pipeline import StepFeed
    from pagoda.engine.scheduler import PENDING_TOKEN

    channel = _LoopbackChannel()
    driver, worker = _RecordingRunner(), _RecordingRunner()
    executor = TensorParallelExecutor(driver, _Run(channel, None, None, "gloo"))
    served = threading.Thread(target=serve_rank, args=(worker, channel))
    served.start()

    def feed(pending, rows):
        host = np.array([rows, rows], dtype=np.int64)
        return StepFeed(pending.tokens, torch.from_numpy(host[0]), torch.from_numpy(host[1]), host)

    try:
        seqs = [Sequence("r", i, [10 * (i + 1), 5], SamplingParams()) for i in range(2)]
        for s in seqs:
            s.num_computed_tokens, s.block_table = 1, [s.seq_id % 7]
        out = SchedulerOutput([ScheduledSeq(s, 1, True) for s in seqs], 2, 2)
        first = executor.launch(plan_step(out), how="argmax")
        for s in seqs:  # Scheduler.advance: the step counts as computed, its token is pending
            s.num_computed_tokens += 1
            s.token_ids.append(PENDING_TOKEN)
        second = executor.launch(plan_step(out), feed(first, [0, 1]), how="argmax")  # before first's tokens are known
        for s, token in zip(seqs, executor.collect(first).tokens):  # Scheduler.commit
            s.token_ids[-1] = token
        for s in seqs:
            s.num_computed_tokens += 1
            s.token_ids.append(PENDING_TOKEN)
        executor.launch(plan_step(out), feed(second, [1]), how="argmax")  # only row 1 fed: row 0 keeps its host id
        assert executor.allocate_kv_cache() == 7
        executor.forget(seqs[0].seq_id)
        executor.launch(plan_step(SchedulerOutput([ScheduledSeq(seqs[1], 1, True)], 1, 1)))
    finally:
        executor.shutdown()
        served.join(10)
    assert not served.is_alive()
    assert [e for e in worker.log if e[0] != "forget"] == [e for e in driver.log if e[0] != "forget"]
    assert [e[1:] for e in driver.log if e[0] == "launch"] == [([1, 1], [5, 5]), ([2, 2], [6, 6]),
                                                             ([3, 3], [PENDING_TOKEN, 7])]
    assert ("forget", seqs[0].seq_id) in driver.log  # (rank 0's: the other ranks keep nothing per sequence)
    from pagoda.engine.executor.control import StepMode

    assert [StepMode.of(how).how for how in ("argmax", "host")] == ["argmax", "host"]  # (the launch the mode names)
    with pytest.raises(KeyError):
        StepMode.of("device")  # (the other ranks cannot feed the tokens rank 0 draws)


def _sent(plan):
    """``plan`` as the other ranks receive it: through its int64 words."""
    return decode_plan(encode_plan(plan))


def test_a_plan_carries_what_the_step_computes():
    """A step's plan holds the ids the step computes (a prefill chunk's, a decode's last token, a pending
    token as it stands: the step pipeline feeds it from the device) and the whole block tables of every KV
    cache group, and reaches the other ranks unchanged, without rank 0's sequences."""
    from pagoda.engine.scheduler import PENDING_TOKEN
    from pagoda.lora import LoRARequest

    a = Sequence("r", 0, [1, 2, 3, 4, 5], SamplingParams())
    b = Sequence("r", 1, [7, 8], SamplingParams(), lora_request=LoRARequest("ad", 3, "/nowhere"))
    b.wants_prompt_logprobs = True
    a.block_table, a.group_block_tables = [3, 4], [[-1, 6], [7, 8]]  # a released window block: -1
    b.block_table, b.group_block_tables = [9], [[10], [11]]
    a.num_computed_tokens = 2
    b.num_computed_tokens = 2
    b.token_ids.append(PENDING_TOKEN)
    plan = plan_step(SchedulerOutput([ScheduledSeq(b, 1, True), ScheduledSeq(a, 2, False)], 1, 3))
    assert plan.sequences == (b, a) and [r.seq_id for r in plan.sampling_rows()] == [b.seq_id]
    assert plan.sampling_row(0).token_ids == [7, 8, PENDING_TOKEN]  # (prompt logprobs score its prompt)
    first, second = plan.rows
    assert first.tokens == [PENDING_TOKEN] and second.tokens == [3, 4]
    assert (first.lora_int_id, first.wants_prompt_logprobs, first.sample) == (3, True, True)
    assert second.block_tables == ([3, 4], [-1, 6], [7, 8])
    received = _sent(plan)
    assert received == StepPlan(plan.rows, 1, 3) and received.sampling_rows() == []


def test_a_plan_with_no_rows_reaches_the_other_ranks():
    assert _sent(StepPlan((), 0, 0)) == StepPlan((), 0, 0)


def test_lazy_tensor_reads_only_its_window(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = torch.arange(4 * 6 * 5, dtype=torch.float32).view(4, 6, 5)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    handle = safe_open(str(tmp_path / "w.safetensors"), framework="pt")
    reads = []

    class CountingSlice:  # records the window each read asks for
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def get_dtype(self):
            return self.inner.get_dtype()

        def __getitem__(self, key):
            reads.append(key)
            return self.inner[key]

    lazy = LazyTensor(CountingSlice(handle.get_slice("w")))
    part = lazy.narrow(1, 3, 3)[2]
    assert part.shape == (3, 5) and part.dtype == torch.float32 and not reads
    target = torch.empty(3, 5)
    target.copy_(part)
    assert torch.equal(target, full[2, 3:6]) and reads == [(slice(2, 3), slice(3, 6), slice(0, 5))]
    gate, up = lazy[1].chunk(2, dim=0)
    assert torch.equal(up.materialize(), full[1, 3:]) and torch.equal(lazy.float() * 2, full * 2)


class _FakeCuda(Platform):
    name, device_type = "fakecuda", "cuda"

    def device_count(self) -> int:
        return 1


def test_more_ranks_than_devices_and_torchrun_size_mismatch_are_clear_errors():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs 2 fakecuda devices .* but 1 is visible"):
        check_world(EngineConfig(tensor_parallel_size=2), _FakeCuda(), None)
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=4\) but tensor_parallel_size is 2.*--tensor-parallel-size 4"):
        check_world(EngineConfig(tensor_parallel_size=2), _FakeCuda(), RankInfo(0, 4, 0, 4, "torchrun"))
    with pytest.raises(ConfigError, match=r"needs 2 fakecuda devices on this machine \(torchrun --nproc-per-node\)"):
        check_world(EngineConfig(tensor_parallel_size=4), _FakeCuda(), RankInfo(0, 4, 0, 2, "torchrun"))
    check_world(EngineConfig(tensor_parallel_size=4), _FakeCuda(), RankInfo(0, 4, 0, 1, "torchrun"))


def test_failure_reports_travel_through_the_store():
    store = torch.distributed.HashStore()
    try:
        raise ValueError("bad shard\nsecond line")
    except ValueError as exc:
        report_failure(store, 3, exc)
    assert read_failure(store, 3) == "ValueError: bad shard" and read_failure(store, 2) is None
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(1) == "exited with status 1"
