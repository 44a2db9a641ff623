"""Multi-LoRA serving (pagoda.lora): PEFT adapters give transformers+peft's greedy tokens, mixed
with other adapters and the base model in one batch, under chunked prefill, preemption and prefix
caching; eviction and reload keep results; bad adapters are refused by name."""

import json

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.errors import RequestError
from pagoda.lora import LoRARequest
from pagoda.lora.ops import lora_expand, lora_fused, lora_shrink, two_kernel_update
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda.testing.lora import make_peft_adapter, peft_greedy_tokens

pytest.importorskip("peft")

VOCAB = 260
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint("llama", root / "base", seed=3, tokenizer=True, **TINY)
    # two ranks, all seven projections vs. a subset of the fused pieces, plain vs. rsLoRA scaling
    a1 = make_peft_adapter(base, root / "a1", r=4, lora_alpha=8, seed=1)
    a2 = make_peft_adapter(base, root / "a2", r=8, lora_alpha=16, target_modules=("q_proj", "v_proj", "up_proj",
                                                                                  "down_proj"),
                           use_rslora=True, seed=2)
    return base, a1, a2


@pytest.fixture(scope="module")
def prompts():
    # a shared 16-token prefix (two blocks of 8) so prefix caching has something to share; one long
    # prompt that the 24-token step budget chunks
    prefix = random_prompts(1, VOCAB, 16, 16, seed=7)[0]
    tails = random_prompts(3, VOCAB, 3, 9, seed=8)
    return [prefix + t for t in tails] + random_prompts(1, VOCAB, 40, 40, seed=9)


@pytest.fixture(scope="module")
def expected(models, prompts):
    base, a1, a2 = models
    return {name: peft_greedy_tokens(base, adapter, prompts, MAX_TOKENS)
            for name, adapter in (("base", None), ("a1", a1), ("a2", a2))}


def requests(models):
    _, a1, a2 = models
    return {"base": None, "a1": LoRARequest("a1", 1, str(a1)), "a2": LoRARequest("a2", 2, str(a2))}


def test_mixed_batch_matches_peft_under_chunking_preemption_and_prefix_caching(models, prompts, expected):
    base = models[0]
    by_name = requests(models)
    names = [n for n in ("a1", "base", "a2") for _ in prompts]
    # a cache of 14 blocks of 8 holds about two sequences: chunked (24-token steps) and preempted
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=8, num_kv_blocks=14, max_num_batched_tokens=24, max_model_len=112,
              enable_prefix_caching=True)
    outs = llm.generate(prompts * 3, GREEDY, lora_request=[by_name[n] for n in names])
    got = [o.outputs[0].token_ids for o in outs]
    want = [t for n in ("a1", "base", "a2") for t in expected[n]]
    assert got == want
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    # the adapters change the outputs (the test would pass trivially otherwise)
    assert expected["a1"] != expected["base"] != expected["a2"]


@pytest.mark.gpu
def test_mixed_batch_matches_peft_on_the_gpu(models, prompts, expected):
    """The same mixed batch through the CUDA platform: the Triton shrink/expand kernels."""
    by_name = requests(models)
    names = [n for n in ("a2", "base", "a1") for _ in prompts]
    llm = LLM(model=str(models[0]), device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=8, num_kv_blocks=64, max_num_batched_tokens=24, max_model_len=112)
    outs = llm.generate(prompts * 3, GREEDY, lora_request=[by_name[n] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [t for n in ("a2", "base", "a1") for t in expected[n]]


def test_decode_graph_inputs_carry_each_rows_adapter_slot(models, prompts):
    """Decode graphs (CUDA) read each row's adapter slot from a static buffer row that the step fills:
    the slot of the row's adapter, -1 for base rows and for the bucket's padding rows, and the rows
    sorted by that slot (the order the LoRA kernels take them in)."""
    from pagoda.engine.graphs import DecodeGraphs
    from pagoda.engine.step_plan import plan_step

    by_name = requests(models)
    llm = LLM(model=str(models[0]), device="cpu", dtype="float32", enable_lora=True, max_loras=2, block_size=8,
              num_kv_blocks=64, max_num_seqs=8)
    engine = llm.engine
    names = ["a2", "base", "a1"]
    for i, name in enumerate(names):
        engine.add_request(f"r{i}", prompts[i], GREEDY, lora_request=by_name[name])
    engine.step()  # the prefills
    out = engine.scheduler.schedule()
    assert out.num_decodes == len(names)
    graphs = DecodeGraphs(engine.runner, 8, 112)
    graphs._fill(plan_step(out), 4)
    slots = engine.runner.lora.slots
    want = [slots[by_name[n].lora_int_id] if by_name[n] else -1 for n in names] + [-1]
    assert graphs.np64[2 + graphs.num_groups, :4].tolist() == want
    order = graphs.np64[3 + graphs.num_groups, :4].tolist()
    assert sorted(order) == [0, 1, 2, 3] and [want[i] for i in order] == sorted(want)
    tiles = graphs.host_tiles.numpy()  # one tile per adapter row here, then empty tiles
    adapted = sorted(w for w in want if w >= 0)
    assert tiles[2, :len(adapted)].tolist() == adapted and tiles[1, :len(adapted)].tolist() == [1] * len(adapted)
    assert not tiles[1, len(adapted):graphs.tile_width].any()
    engine.abort_request([f"r{i}" for i in range(len(names))])


@pytest.mark.timeout(300)
def test_tensor_parallel_mixed_batch_matches_peft(models, prompts, expected):
    """TP=2 on gloo: each rank shards A and B with its weights; steps carry each sequence's adapter."""
    by_name = requests(models)
    names = [n for n in ("base", "a2", "a1") for _ in prompts]
    llm = LLM(model=str(models[0]), device="cpu", dtype="float32", tensor_parallel_size=2, enable_lora=True,
              max_loras=2, max_lora_rank=8, block_size=8, num_kv_blocks=14, max_num_batched_tokens=24,
              max_model_len=112)
    try:
        outs = llm.generate(prompts * 3, GREEDY, lora_request=[by_name[n] for n in names])
        assert [o.outputs[0].token_ids for o in outs] == [t for n in ("base", "a2", "a1") for t in expected[n]]
        assert llm.get_stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()


def test_adapter_id_enters_the_prefix_cache(models, prompts):
    base = models[0]
    by_name = requests(models)
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, block_size=8,
              num_kv_blocks=64)
    prompt = prompts[0]
    llm.generate([prompt], GREEDY, lora_request=by_name["a1"])
    before = llm.get_stats()["prefix_cache_hit_tokens"]
    llm.generate([prompt], GREEDY, lora_request=by_name["a2"])  # same tokens, other adapter: no hit
    assert llm.get_stats()["prefix_cache_hit_tokens"] == before
    llm.generate([prompt], GREEDY, lora_request=by_name["a1"])  # same adapter: hit
    assert llm.get_stats()["prefix_cache_hit_tokens"] > before


def test_eviction_and_reload_keep_results(models, prompts, expected):
    base = models[0]
    by_name = requests(models)
    # one slot and one CPU copy: every switch evicts the other adapter and reads it from disk again
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              block_size=8, num_kv_blocks=64, enable_prefix_caching=False)
    order = ["a1", "a2", "a1", "a2"]
    for name in order:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=by_name[name])]
        assert got == expected[name], name
    assert llm.engine.runner.lora.loads == len(order)
    # both adapters in one call with one slot: the scheduler runs one adapter at a time
    outs = llm.generate(prompts[:2] * 2, GREEDY, lora_request=[by_name["a1"]] * 2 + [by_name["a2"]] * 2)
    assert [o.outputs[0].token_ids for o in outs] == expected["a1"][:2] + expected["a2"][:2]


def test_bad_adapters_and_requests_are_refused_by_name(models, tmp_path):
    base, a1, _ = models
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=4,
              block_size=8, num_kv_blocks=32)
    with pytest.raises(RequestError, match="max_lora_rank=4"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=requests(models)["a2"])
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((a1 / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(RequestError, match="adapter_model.bin"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("p", 5, str(pickled)))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((a1 / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(RequestError, match="use_dora"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("d", 6, str(dora)))
    llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("a1", 1, str(a1)))
    with pytest.raises(RequestError, match="already adapter"):  # an id names one adapter
        llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("other", 1, str(dora)))
    assert not llm.engine.has_unfinished_requests()


def test_lora_request_needs_enable_lora(models):
    llm = LLM(model=str(models[0]), device="cpu", dtype="float32", block_size=8, num_kv_blocks=32)
    with pytest.raises(RequestError, match="enable_lora"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=requests(models)["a1"])


def test_reference_ops_match_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    t, k, n, r, s = 7, 12, 10, 6, 3
    x, y = torch.randn(t, k, generator=gen), torch.randn(t, n, generator=gen)
    a, b = torch.randn(s, r, k, generator=gen), torch.randn(s, n, r, generator=gen)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2])
    got = lora_expand(y.clone(), lora_shrink(x, a, slots), b, slots)
    want = y.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[i] += b[slot] @ (a[slot] @ x[i])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lora_fused(x, y.clone(), a, b, slots), want)  # the one-op update
    torch.testing.assert_close(two_kernel_update(lora_shrink, lora_expand)(x, y.clone(), a, b, slots), want)


def test_layers_make_one_update_call_per_layer(monkeypatch):
    """An adapted layer adds its update with one op, the platform's ``lora_fused``, told the pieces of a
    fused layer (its B is block-diagonal over them); where no provider registers ``lora_fused``, with
    the platform's ``lora_shrink`` then ``lora_expand``."""
    from pagoda import kernels
    from pagoda.errors import PluginError
    from pagoda.forward_context import ForwardContext, set_forward_context
    from pagoda.layers.linear import QKVParallelLinear
    from pagoda.lora import layers as lora_layers
    from pagoda.lora.manager import LoRAMapping

    gen = torch.Generator().manual_seed(4)
    layer = QKVParallelLinear(16, 4, 4, 2, params_dtype=torch.float32)  # q 16, k 8, v 8 columns
    layer.weight.data.zero_()
    method = lora_layers.LoRALinearMethod(layer.quant_method, 2, 3, 2, 16, 32, torch.float32, torch.device("cpu"))
    layer.quant_method = method
    want = torch.zeros(3, 32)
    x = torch.randn(3, 16, generator=gen)
    for piece, (offset, size) in enumerate([(0, 16), (16, 8), (24, 8)]):
        a, b = torch.randn(2, 16, generator=gen), torch.randn(size, 2, generator=gen)
        method.write_piece(1, piece, a, b, offset)
        want[:, offset:offset + size] = x @ a.T @ b.T
    want[1] = 0  # a base row
    mapping = LoRAMapping(torch.tensor([1, -1, 1]), True)
    calls = []

    def fused(*args):
        calls.append(args[-1])
        return lora_fused(*args)

    real_get_op = kernels.get_op
    monkeypatch.setattr(kernels, "get_op", lambda name: fused if name == "lora_fused" else real_get_op(name))
    with set_forward_context(ForwardContext(attn_metadata=None, backends={}, lora=mapping)):
        torch.testing.assert_close(layer.quant_method.apply(layer, x, None), want)
    assert calls == [(16, 8, 8)]

    def no_fused(name):
        if name == "lora_fused":
            raise PluginError("kernel op 'lora_fused' is unavailable")
        if name.startswith("lora_"):  # (the base layer asks for its ``linear`` too)
            calls.append(name)
        return real_get_op(name)

    monkeypatch.setattr(kernels, "get_op", no_fused)
    method.update = None
    with set_forward_context(ForwardContext(attn_metadata=None, backends={}, lora=mapping)):
        torch.testing.assert_close(layer.quant_method.apply(layer, x, None), want)
    assert calls[1:] == ["lora_shrink", "lora_expand"]


def test_stacked_weights_give_the_same_mixed_batch(models, prompts, expected, monkeypatch):
    """Where the platform has ``lora_expand_stacked`` (pagoda-cuda), each plain adapted layer keeps its weight
    above every slot's A in one tensor, and small steps run one GEMM over it and the op's expand: the mixed
    batch still gives transformers+peft's tokens (the reference op stands in for the kernel here; steps of
    more than 8 tokens, the prefills, take the other path)."""
    from pagoda.lora import layers as lora_layers
    from pagoda.lora import ops

    calls = []

    def expand_stacked(*args):
        calls.append(args[0].shape[0])
        return ops.lora_expand_stacked(*args)

    expand_stacked.max_tokens = 8
    monkeypatch.setattr(lora_layers, "lora_stacked_op", lambda: expand_stacked)
    by_name = requests(models)
    names = [n for n in ("a2", "a1", "base") for _ in prompts]
    llm = LLM(model=str(models[0]), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=8, num_kv_blocks=64, max_num_batched_tokens=24, max_model_len=112)
    methods = [layer.quant_method for layer, _ in llm.engine.runner.lora.layers.values()]
    assert all(m.stacked is not None for m in methods)
    for method in methods:  # the weight and the slots' A are views of the stack
        layer_weight = next(layer.weight for layer, _ in llm.engine.runner.lora.layers.values()
                            if layer.quant_method is method)
        assert layer_weight.data_ptr() == method.stacked.data_ptr()
        assert method.a_stack.data_ptr() == method.stacked[layer_weight.shape[0]:].data_ptr()
    outs = llm.generate(prompts * 3, GREEDY, lora_request=[by_name[n] for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [t for n in ("a2", "a1", "base") for t in expected[n]]
    assert calls and max(calls) <= 8


def test_stacked_layer_matches_the_separate_update(monkeypatch):
    """One layer: the stacked GEMM and expand equal the plain GEMM and ``lora_fused`` (bias included), the
    stack is refused for quantized-like or too-large stacks, and larger steps take the separate update."""
    from pagoda.forward_context import ForwardContext, set_forward_context
    from pagoda.layers.linear import QKVParallelLinear, RowParallelLinear
    from pagoda.lora import layers as lora_layers
    from pagoda.lora import ops
    from pagoda.lora.manager import LoRAMapping

    gen = torch.Generator().manual_seed(6)
    layer = QKVParallelLinear(16, 4, 4, 2, bias=True, params_dtype=torch.float32)  # q 16, k 8, v 8 columns
    layer.weight.data.normal_(generator=gen)
    layer.bias.data.normal_(generator=gen)
    weight = layer.weight.detach().clone()
    method = lora_layers.LoRALinearMethod(layer.quant_method, 2, 3, 2, 16, 32, torch.float32, torch.device("cpu"))
    layer.quant_method = method
    for piece, (offset, size) in enumerate([(0, 16), (16, 8), (24, 8)]):
        method.write_piece(1, piece, torch.randn(2, 16, generator=gen), torch.randn(size, 2, generator=gen), offset)
    x = torch.randn(5, 16, generator=gen)
    mapping = LoRAMapping(torch.tensor([1, -1, 1, 0, 1]), True)
    with set_forward_context(ForwardContext(attn_metadata=None, backends={}, lora=mapping)):
        want = layer(x)
        a_before = method.a_stack.clone()
        calls = []

        def expand_stacked(*args):
            calls.append(args[0].shape)
            return ops.lora_expand_stacked(*args)

        expand_stacked.max_tokens = 5
        assert method.stack_weights(layer, expand_stacked)
        assert torch.equal(layer.weight, weight) and torch.equal(method.a_stack, a_before)
        got = layer(x)
        torch.testing.assert_close(got, want)
        assert calls == [(5, 32 + 2 * 6)]
    double = LoRAMapping(torch.cat([mapping.token_slots, mapping.token_slots]), True)
    with set_forward_context(ForwardContext(attn_metadata=None, backends={}, lora=double)):
        torch.testing.assert_close(layer(torch.cat([x, x])), torch.cat([want, want]))  # 10 tokens: lora_fused
        assert len(calls) == 1
    # a stack with more extra rows than the weight has rows is refused (8 slots x rank 4 > 8 rows)
    small = RowParallelLinear(16, 8, params_dtype=torch.float32)
    wide = lora_layers.LoRALinearMethod(small.quant_method, 8, 1, 4, 16, 8, torch.float32, torch.device("cpu"))
    assert not wide.stack_weights(small, expand_stacked) and wide.stacked is None


def test_generate_cli_with_an_adapter(models, capsys):
    from pagoda.cli.main import main
    from transformers import AutoTokenizer

    base, a1, _ = models
    code = main(["generate", "--model", str(base), "--device", "cpu", "--dtype", "float32", "--prompt", "Hello",
                 "--max-tokens", "6", "--ignore-eos", "--json", "--lora", str(a1), "--num-kv-blocks", "32"])
    assert code == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]["token_ids"]
    prompt = AutoTokenizer.from_pretrained(str(base)).encode("Hello", add_special_tokens=True)
    assert got == peft_greedy_tokens(base, a1, [prompt], 6)[0]


def test_bench_throughput_with_adapters(models, tmp_path, capsys, monkeypatch):
    """--lora N gives the prompts N adapters round-robin, in the measured runs and in --profile's steps."""
    from pagoda.bench import profile as bench_profile
    from pagoda.cli.main import main

    profiled = []
    real = bench_profile.profile_decode
    monkeypatch.setattr(bench_profile, "profile_decode",
                        lambda *a, **kw: (profiled.append(kw.get("lora_requests")), real(*a, **kw))[1])
    out = tmp_path / "r.json"
    code = main(["bench", "throughput", "--model", str(models[0]), "--device", "cpu", "--dtype", "float32",
                 "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--ignore-eos", "--repeats", "1",
                 "--warmup-prompts", "0", "--lora", "3", "--lora-rank", "4", "--bandwidth-gbs", "10",
                 "--matmul-tflops", "0.1", "--json", str(out), "--profile"])
    assert code == 0
    assert [r.lora_int_id for r in profiled[0]] == [1, 2, 3, 1]
    assert "3 LoRA adapters of rank 4" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["engine_config"]["enable_lora"] and res["engine_config"]["max_loras"] == 3
    assert res["best"]["output_tokens"] == 16


@pytest.mark.parametrize("seed", range(6))
def test_token_tiles_cover_every_adapted_token_once(seed):
    """The kernels' work list: tiles of at most TILE_TOKENS consecutive tokens in slot order, each of
    one adapter, covering every token with an adapter exactly once and no base token; padding adds
    empty tiles up to max_tiles."""
    import numpy as np
    from pagoda.lora.ops import TILE_TOKENS, max_tiles, token_tiles

    rng = np.random.default_rng(seed)
    slots = rng.integers(-1, 5, size=int(rng.integers(0, 90)))
    if seed == 0:
        slots = np.repeat(np.array([3, -1, 0]), 40)  # long runs: several whole tiles and a partial one
    sorted_slots = slots[np.argsort(slots, kind="stable")]
    tiles = token_tiles(sorted_slots, pad_to=max_tiles(len(slots), 5))
    assert tiles.shape == (3, max_tiles(len(slots), 5))
    covered = []
    for start, length, slot in tiles.T:
        assert 0 <= length <= TILE_TOKENS
        covered += list(range(start, start + length))
        assert (sorted_slots[start:start + length] == slot).all()
    assert sorted(covered) == [i for i, s in enumerate(sorted_slots) if s >= 0]
