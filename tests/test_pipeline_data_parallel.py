"""Pipeline and data parallelism on CPU (gloo): PP=2, PP=2 x TP=2 and DP=2 against one process
and transformers (Llama and Qwen2-MoE, with chunked prefill and preemption), a killed stage or
replica, and the pieces (layer split, replica choice)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from pagoda import LLM, SamplingParams
from pagoda.distributed.pipeline_parallel import layer_ranges
from pagoda.distributed.replicas import AFFINITY_SLACK, choose_replica
from pagoda.engine.executor.failures import WorkerError
from pagoda.errors import ConfigError
from pagoda.testing import hf_greedy_tokens, make_tiny_checkpoint, random_prompts

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]
VOCAB = 320
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, attention_bias=True, max_position_embeddings=256)
# shared expert, a dense layer in between (mlp_only_layers)
QWEN_MOE = dict(LLAMA, attention_bias=False, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                shared_expert_intermediate_size=48, mlp_only_layers=[1])
# small cache and token budget: chunked prefill and preemption happen (per replica under DP)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=12, block_size=8, max_num_batched_tokens=24,
              max_model_len=80)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts(6, VOCAB, 5, 40, seed=7)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=1, tokenizer=True, **LLAMA)
    return path, hf_greedy_tokens(path, PROMPTS, 16)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = make_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"), seed=2, tokenizer=True,
                                **QWEN_MOE)
    return path, hf_greedy_tokens(path, PROMPTS, 16)


def test_pp2_llama_matches_one_process_and_transformers_then_a_killed_stage_is_named(llama):
    path, expected = llama
    llm = LLM(model=str(path), pipeline_parallel_size=2, **ENGINE)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0
        runner = llm.engine.runner
        # an even split of 3 layers: stage 0 (embedding, LM head) holds 1, stage 1 (final norm) 2
        assert len(runner.attn_layers) == 1 and len(runner.call("spec_summary")[1]) == 2
        assert not hasattr(runner.model.model.layers[1], "self_attn")
        single = LLM(model=str(path), **ENGINE)  # next to it in this process: a whole model
        assert _tokens(single.generate(PROMPTS[:2], GREEDY)) == expected[:2]
        pid = runner.worker_pid(1)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"pipeline-parallel worker failed .*rank 1 \(pid {pid}; "
                                              rf"pipeline stage 1 of 2, tensor rank 0\) was killed by SIGKILL") as err:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        assert err.value.ranks == [1]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_torchrun_two_nodes_by_rendezvous_pp2_matches_one_process(llama, tmp_path):
    """Two torchrun agents on this machine, one process each, joined by c10d rendezvous: stage 0 on
    "node" 0, stage 1 on "node" 1 (whichever agent the rendezvous makes rank 0 prints)."""
    path, expected = llama
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    port = 29400 + os.getpid() % 500
    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", f"pp-{os.getpid()}", "-m", "pagoda.cli.main", "generate",
           "--model", str(path), "--device", "cpu", "--dtype", "float32", "--pipeline-parallel-size", "2",
           "--num-kv-blocks", "16", "--max-tokens", "16", "--ignore-eos", "--json",
           "--prompt", ",".join(map(str, PROMPTS[0]))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for _ in range(2)]
    results = [node.communicate(timeout=240) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    lines = [json.loads(line) for out, _ in results for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    single = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16)
    text = ",".join(map(str, PROMPTS[0]))
    assert lines[0]["outputs"][0]["token_ids"] == _tokens(single.generate(text, GREEDY))[0]


@pytest.mark.slow
def test_pp2_tp2_moe_matches_transformers(moe):
    """Four ranks: two stages (the partition gives stage 0 two layers) of two tensor-parallel ranks."""
    path, expected = moe
    llm = LLM(model=str(path), pipeline_parallel_size=2, tensor_parallel_size=2, pp_layer_partition=[2, 1],
              **ENGINE)
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
        assert llm.get_stats()["num_preemptions"] > 0
        assert len(llm.engine.runner.attn_layers) == 2
    finally:
        llm.shutdown()


def test_dp2_moe_spreads_prompts_keeps_order_and_prefix_affinity_then_a_killed_replica_is_named(moe):
    path, expected = moe
    llm = LLM(model=str(path), data_parallel_size=2, **ENGINE)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert _tokens(outs) == expected  # outputs in prompt order
        stats = llm.get_stats()
        replicas = stats["data_parallel"]
        assert [r["replica"] for r in replicas] == [0, 1]
        assert all(r["generated_tokens"] > 0 for r in replicas)  # both replicas served prompts
        assert stats["generated_tokens"] == 16 * len(PROMPTS)
        assert stats["num_preemptions"] > 0
        engine = llm.engine
        _serve_and_scrape(engine, [o.outputs[0].text for o in outs])
        # prompts sharing their first KV block go to the replica that cached it
        shared = PROMPTS[4][:8]
        ids = [engine.add_request(f"p{i}", shared + [i + 1] * 3, GREEDY) for i in range(3)]
        homes = {engine.requests[i] for i in ids}
        assert len(homes) == 1
        assert _tokens(llm._run(ids)) == _tokens(LLM(model=str(path), **ENGINE).generate(
            [shared + [i + 1] * 3 for i in range(3)], GREEDY))
        pid = engine.replica_pid(1)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"data-parallel replica 1 \(pid {pid}\) was killed by SIGKILL"):
            llm.generate(PROMPTS, GREEDY)
        with pytest.raises(WorkerError, match="replica 1"):  # and it stays stopped
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.shutdown()


def _serve_and_scrape(engine, texts: list[str]) -> None:
    """The server over the replicas: completions stream through the front, /metrics has each replica."""
    import httpx
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.server import ServerConfig, ServerThread
    from pagoda.server.app import create_app

    engine.set_streaming(True)
    try:
        with ServerThread(create_app(AsyncEngine(engine), ServerConfig(served_model_name="tiny"))) as srv:
            replies = [httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": PROMPTS[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True})
                for i in (0, 1)]
            metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    finally:
        engine.set_streaming(False)
    for i, reply in enumerate(replies):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == texts[i]
    assert 'pagoda_dp_generated_tokens{replica="0"}' in metrics
    assert 'pagoda_dp_generated_tokens{replica="1"}' in metrics


def test_layer_split_even_and_partitioned():
    assert layer_ranges(3, 2) == [(0, 1), (1, 3)]  # the remainder goes to the later stages
    assert layer_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layer_ranges(5, 2, [4, 1]) == [(0, 4), (4, 5)]
    with pytest.raises(ConfigError, match="pp_layer_partition"):
        layer_ranges(5, 2, [4, 2])
    with pytest.raises(ConfigError, match="at least one layer per stage"):
        layer_ranges(1, 2)


def test_each_replica_gets_its_own_devices_and_too_few_is_a_config_error(monkeypatch):
    """Where a platform limits a process to some devices, replica i gets devices [i*R, (i+1)*R) of the visible
    ones; asking for more than are visible names data_parallel_size before any replica starts; the CPU's
    replicas share it."""
    from types import SimpleNamespace

    from pagoda.distributed.replicas import _device_lists

    gpu = SimpleNamespace(name="cuda", visible_devices_env="CUDA_VISIBLE_DEVICES", device_count=lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert _device_lists(gpu, 2, 2) == [["3", "5"], ["6", "7"]]
    with pytest.raises(ConfigError, match=r"data_parallel_size=3 x 2 ranks per replica needs 6 cuda devices, but 4"):
        _device_lists(gpu, 3, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _device_lists(gpu, 4, 2)[3] == ["6", "7"]  # (none set: the platform's count)
    assert _device_lists(SimpleNamespace(visible_devices_env=None), 2, 1) is None


def test_replica_choice_balances_load_and_keeps_prefix_affinity():
    assert choose_replica([3, 1, 2], None) == 1
    assert choose_replica([3, 1, 2], 0) == 0  # affinity while not much more loaded
    assert choose_replica([2 * 1 + AFFINITY_SLACK + 1, 1], 0) == 1  # much more loaded: the least loaded
