"""Decode batches through ``pagoda.engine.graphs`` (static buffers, padded buckets, block
tables updated incrementally) with the triton backend, on CPU: a stand-in platform whose
"replay" reruns the captured step into the static output. Greedy tokens must equal
transformers', through chunked prefill, preemption and batches that shrink and grow."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.interfaces import CapturedGraph
from pagoda.platforms.cpu import CpuPlatform
from pagoda.plugins import get_registry
from pagoda.testing import cut_at_stops, hf_greedy_tokens, make_tiny_checkpoint, random_prompts, set_eos_token

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


class Replay(CapturedGraph):
    replays = 0

    def __init__(self, fn):
        self.fn = fn
        self.output = fn()

    def replay(self):
        Replay.replays += 1
        self.output.copy_(self.fn())


class ReplayPlatform(CpuPlatform):
    supports_graphs = True

    def capture_graph(self, fn, pool=None):
        return Replay(fn)


@pytest.fixture
def replay_cpu(device):
    if device.type != "cpu":
        pytest.skip("the stand-in replaces the cpu platform")
    entry = get_registry().platforms.entries["cpu"]
    original, entry.obj = entry.obj, ReplayPlatform()
    yield
    entry.obj = original


GEMMA3 = dict(TINY, head_dim=32, sliding_window=10, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_graph_decode_matches_transformers(tmp_path, replay_cpu, model_type):
    """gemma3_text: window layers with their own block tables (KV cache groups) in the graphs'
    buffers, released entries never rewritten."""
    path = make_tiny_checkpoint(model_type, tmp_path, seed=2, **(GEMMA3 if model_type == "gemma3_text" else TINY))
    prompts = random_prompts(6, 320, 4, 40, seed=11)
    want = hf_greedy_tokens(path, prompts, 16)
    # 12 blocks of 8 tokens cannot hold six sequences of up to 56 tokens: preemption happens,
    # and batches of 1-6 decodes use the 1/2/4/8 buckets with padding rows.
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="triton", num_kv_blocks=12,
              block_size=8, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
              enable_prefix_caching=False)
    assert llm.engine.runner.graphs is not None
    llm.engine.enable_step_pipeline()  # as on a CUDA device
    before = Replay.replays
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert Replay.replays - before > 10
    assert llm.engine.pipeline.launched_ahead > 0
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["mixed_steps_replayed"] > 3  # steps with prefill chunks (pagoda.engine.mixed_graphs)


def test_mixed_steps_replayed_with_prefix_hits_and_arrivals(tmp_path, replay_cpu):
    """Requests join running batches (more prompts than seats): the steps that hold their chunks replay the
    mixed graphs, also where a prompt's chunk starts after cached blocks (prefix caching: attention over a
    cached prefix) and where its decode rows are fed from the step before (the step pipeline); the padded
    kernels' results equal transformers'."""
    path = make_tiny_checkpoint("qwen3", tmp_path, seed=4, **TINY)
    shared = random_prompts(1, 320, 20, 20, seed=1)[0]
    prompts = [shared + p for p in random_prompts(9, 320, 3, 12, seed=7)] + random_prompts(3, 320, 40, 50, seed=8)
    want = hf_greedy_tokens(path, prompts, 10)
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="triton", num_kv_blocks=64,
              block_size=8, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=80, enable_prefix_caching=True)
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.buckets == [48]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want  # steps one after another
    stats = llm.get_stats()
    assert stats["mixed_steps_replayed"] > 5 and stats["prefix_cache_hit_tokens"] > 0
    llm.engine.enable_step_pipeline()  # as on a CUDA device
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    assert llm.get_stats()["mixed_steps_replayed"] > stats["mixed_steps_replayed"]  # (prefixes cached now)


def test_mixed_buckets_by_size_and_by_their_timings():
    """Buckets up to ALWAYS_REPLAYED replay every step they get; a larger one the steps whose eager time
    (interpolated between the bucket below and itself) exceeds its replay; none where its own size runs
    faster eagerly."""
    from pagoda.engine.mixed_graphs import ALWAYS_REPLAYED, bucket_list, least_tokens

    assert bucket_list(48) == [48] and bucket_list(1024) == [128, 256, 512, 1024]
    assert bucket_list(5000) == [128, 256, 512, 1024, 1536, 2048, 3072, 4096, 5000]
    buckets = bucket_list(8192)
    # eager steps host-bound at 10 ms up to 2,560 tokens, device-bound above (4 ms per 1,024 tokens); replays
    # 3 ms per 1,024 tokens of their bucket
    eager = {b: max(0.010, 0.004 * b / 1024) for b in buckets if b >= ALWAYS_REPLAYED}
    replay = {b: 0.003 * b / 1024 for b in buckets if b > ALWAYS_REPLAYED}
    least = least_tokens(buckets, eager, replay)
    # 1536-3072 beat the eager step of the bucket below: every step; 4096 (12 ms) ties 3072's eager step and
    # beats eager steps from 3,073 tokens (12 -> 16 ms between 3072 and 4096); 6144 (18 ms) beats eager steps
    # over 4,608 (16 -> 24 ms); 8192 (24 ms) those over 6,144
    assert least == {128: 0, 256: 0, 512: 0, 1024: 0, 1536: 0, 2048: 0, 3072: 0, 4096: 3073, 6144: 4609,
                     8192: 6145}
    # a replay slower than its own size run eagerly: dropped
    assert least_tokens([1024, 2048], {1024: 0.010, 2048: 0.012}, {2048: 0.013}) == {1024: 0}
    assert least_tokens(buckets, {}, replay) == {128: 0, 256: 0, 512: 0, 1024: 0}  # nothing timed
    assert least_tokens([128, 256], {}, {}) == {128: 0, 256: 0}


@pytest.mark.parametrize("cap", [None, 24])
def test_mixed_steps_over_several_buckets(tmp_path, replay_cpu, monkeypatch, cap):
    """Steps of several sizes pad to their buckets; max_cudagraph_capture_size caps both kinds of graphs,
    and without it buckets above ALWAYS_REPLAYED are kept by their start-up timings (which cannot drop
    the buckets up to it); tokens equal transformers' either way."""
    from pagoda.engine import mixed_graphs

    monkeypatch.setattr(mixed_graphs, "BUCKETS", (16, 32))
    monkeypatch.setattr(mixed_graphs, "ALWAYS_REPLAYED", 16)
    path = make_tiny_checkpoint("qwen3", tmp_path, seed=5, **TINY)
    prompts = random_prompts(8, 320, 5, 30, seed=3)
    want = hf_greedy_tokens(path, prompts, 8)
    lengths = [3 + i % 6 for i in range(len(prompts))]  # requests end at different steps: others join running ones
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="triton", num_kv_blocks=64,
              block_size=8, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=64,
              max_cudagraph_capture_size=cap)
    mixed, decode = llm.engine.runner.mixed_graphs, llm.engine.runner.graphs
    if cap:
        assert mixed.buckets == [16, 24] and decode.max_bs == 4
        capped = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="triton", num_kv_blocks=64,
                     block_size=8, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=64,
                     max_cudagraph_capture_size=2)
        assert capped.engine.runner.graphs.max_bs == 2 and capped.engine.runner.mixed_graphs.buckets == [2]
    else:
        assert mixed.buckets[0] == 16 and set(mixed.graphs) == set(mixed.buckets) == set(mixed.least)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [w[:n] for w, n in zip(want, lengths)]
    assert llm.get_stats()["mixed_steps_replayed"] > 0


class OutOfMemoryAbove(ReplayPlatform):
    """Captures of more than ``limit`` rows run out of device memory."""

    limit = 32

    def capture_graph(self, fn, pool=None):
        graph = Replay(fn)
        if graph.output.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return graph


def test_a_larger_bucket_out_of_memory_is_left_out(tmp_path, replay_cpu, monkeypatch):
    """A default bucket above ALWAYS_REPLAYED whose capture runs out of memory is left out (its steps run
    eagerly) and the engine starts; with max_cudagraph_capture_size the user asked for it: an error naming
    the key."""
    from pagoda.engine import mixed_graphs
    from pagoda.errors import ConfigError

    monkeypatch.setattr(mixed_graphs, "BUCKETS", (16, 32))
    monkeypatch.setattr(mixed_graphs, "ALWAYS_REPLAYED", 16)
    entry = get_registry().platforms.entries["cpu"]
    monkeypatch.setattr(entry, "obj", OutOfMemoryAbove())
    path = make_tiny_checkpoint("qwen3", tmp_path, seed=6, **TINY)
    prompts = random_prompts(5, 320, 20, 40, seed=4)
    want = hf_greedy_tokens(path, prompts, 4)
    config = dict(model=str(path), device="cpu", dtype="float32", attention_backend="triton", num_kv_blocks=64,
                  block_size=8, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=64)
    llm = LLM(**config)
    mixed = llm.engine.runner.mixed_graphs
    assert 48 not in mixed.graphs and mixed.buckets[0] == 16 and set(mixed.least) == set(mixed.buckets)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    with pytest.raises(ConfigError, match="max_cudagraph_capture_size"):
        LLM(**config, max_cudagraph_capture_size=48)


def test_steps_ahead_with_early_stops(tmp_path, replay_cpu):
    """Steps launched ahead of the host (the step pipeline, graph-replayed decodes fed from the
    previous launch's tokens): an EOS stop and per-request length limits end sequences in the
    middle of the pipelined stretch; their speculative tokens are dropped."""
    path = make_tiny_checkpoint("qwen3", tmp_path, seed=3, **TINY)
    prompts = random_prompts(5, 320, 4, 20, seed=5)
    full = hf_greedy_tokens(path, prompts, 14)
    eos = full[1][6]  # the 7th token of prompt 1 becomes EOS
    set_eos_token(path, eos)
    limits = [14, 14, 9, 3, 12]
    want = cut_at_stops(full, eos, limits)
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="triton", num_kv_blocks=40,
              block_size=4, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=128)
    llm.engine.enable_step_pipeline()
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in limits])
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.pipeline.launched_ahead > 3
    assert llm.get_stats()["kv_blocks_used"] == 0


def test_mixed_steps_with_lora_adapters_match_peft(tmp_path, replay_cpu):
    """Two adapters and the base model in one batch while requests keep joining: the steps with prefill
    chunks replay the mixed graphs with each token's adapter slot, the tokens sorted by it and the kernels'
    tiles in static buffers (padding tokens: slot -1); transformers+peft's greedy tokens."""
    pytest.importorskip("peft")
    from pagoda.lora import LoRARequest
    from pagoda.testing.lora import make_peft_adapter, peft_greedy_tokens

    base = make_tiny_checkpoint("llama", tmp_path / "base", seed=3, **dict(TINY, vocab_size=260))
    a1 = make_peft_adapter(base, tmp_path / "a1", r=4, lora_alpha=8, seed=1)
    a2 = make_peft_adapter(base, tmp_path / "a2", r=8, lora_alpha=16, use_rslora=True, seed=2)
    prompts = random_prompts(6, 260, 5, 30, seed=4)
    adapters = {"a1": a1, "base": None, "a2": a2}
    want = {name: peft_greedy_tokens(base, path, prompts, 8) for name, path in adapters.items()}
    llm = LLM(model=str(base), device="cpu", dtype="float32", attention_backend="triton", enable_lora=True,
              max_loras=2, max_lora_rank=8, block_size=8, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=40, max_model_len=64)
    assert llm.engine.runner.mixed_graphs is not None
    requests = {"a1": LoRARequest("a1", 1, str(a1)), "base": None, "a2": LoRARequest("a2", 2, str(a2))}
    names = [n for _ in prompts for n in adapters]  # the adapters interleaved, so batches mix them
    outs = llm.generate([p for p in prompts for _ in adapters], SamplingParams(temperature=0, max_tokens=8,
                                                                               ignore_eos=True),
                        lora_request=[requests[n] for n in names])
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [want[n][i // len(adapters)] for i, n in enumerate(names)]
    assert llm.get_stats()["mixed_steps_replayed"] > 5
    assert want["a1"] != want["base"] != want["a2"]  # the adapters change the tokens
