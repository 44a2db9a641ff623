"""mlu_chunked against the core's torch reference: unit batches, then whole models vs transformers."""

from types import SimpleNamespace

import pytest
import torch
from pagoda import LLM, SamplingParams, kernels
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.errors import ConfigError
from pagoda.forward_context import ForwardContext, set_forward_context
from pagoda.interfaces import AttentionSpec
from pagoda.kernels import get_op
from pagoda.testing import hf_greedy_tokens, make_tiny_checkpoint, random_prompts
from pagoda_mlu.chunked_attention import DEFAULT_TILE_SIZE, MluChunkedAttention
from pagoda_mlu.synthetic import context_slots, mixed_batch

BLOCK = 4
NUM_BLOCKS = 64


def run_both(spec: AttentionSpec, tile_size: int, seed: int = 0):
    """One mixed batch (3 decodes, a continuing chunk, two fresh prompts) through both backends."""
    kernels.activate("cpu")
    batch = mixed_batch([9, 1, 23], [(13, 6), (0, 11), (0, 1)], BLOCK, NUM_BLOCKS, seed)
    meta = batch.meta
    gen = torch.Generator().manual_seed(seed)
    nq, nk, hs = spec.num_heads, spec.num_kv_heads, spec.head_size
    ctx_slots = context_slots(batch)
    ctx_k = torch.randn(len(ctx_slots), nk, hs, generator=gen)
    ctx_v = torch.randn(len(ctx_slots), nk, hs, generator=gen)
    t = meta.num_tokens
    q = torch.randn(t, nq * hs, generator=gen)
    k = torch.randn(t, nk * hs, generator=gen)
    v = torch.randn(t, nk * hs, generator=gen)
    layer = SimpleNamespace(spec=spec)
    ref_backend, ours = TorchPagedAttention(), MluChunkedAttention().configure({"tile_size": tile_size})
    # Slots nobody wrote hold nan (like uninitialised memory): no backend may let them leak in.
    ref_cache = torch.full(ref_backend.kv_cache_shape(spec, NUM_BLOCKS, BLOCK), float("nan"))
    our_cache = torch.full(ours.kv_cache_shape(spec, NUM_BLOCKS, BLOCK), float("nan"))
    assert our_cache.shape == (2, NUM_BLOCKS, nk, BLOCK, hs)  # Cambricon's head-major paged layout
    get_op("store_kv_cache")(ctx_k, ctx_v, ref_cache, ctx_slots)
    ours.store(ctx_k, ctx_v, our_cache, ctx_slots)
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        expected = ref_backend.forward(layer, q, k, v, ref_cache, meta)
        got = ours.forward(layer, q, k, v, our_cache, meta)
    # Both caches hold the same tokens afterwards, in their own layouts.
    torch.testing.assert_close(our_cache, ref_cache.permute(0, 1, 3, 2, 4), equal_nan=True)
    return got, expected


@pytest.mark.parametrize("tile_size", [1, 3, 8, 64])
@pytest.mark.parametrize("variant", ["gqa", "mha-window", "gqa-softcap-window"])
def test_chunked_matches_torch_reference(variant, tile_size):
    spec = {
        "gqa": AttentionSpec("mha", num_heads=4, num_kv_heads=2, head_size=16, scale=0.25),
        "mha-window": AttentionSpec("mha", num_heads=3, num_kv_heads=3, head_size=8, scale=0.3,
                                    sliding_window=5),
        "gqa-softcap-window": AttentionSpec("mha", num_heads=4, num_kv_heads=1, head_size=8, scale=0.4,
                                            sliding_window=7, logits_soft_cap=3.0),
    }[variant]
    got, expected = run_both(spec, tile_size, seed=tile_size)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_tile_size_option_is_validated():
    backend = MluChunkedAttention()
    assert backend.configure({}).tile_size == DEFAULT_TILE_SIZE
    configured = backend.configure({"tile_size": 48})
    assert configured.tile_size == 48 and backend.tile_size == DEFAULT_TILE_SIZE  # a copy
    with pytest.raises(ConfigError, match=r"attention_options\.tile_size must be a positive integer"):
        backend.configure({"tile_size": 0})
    with pytest.raises(ConfigError, match=r"has no option 'tile'"):
        backend.configure({"tile": 8})


def test_torch_backend_rejects_options():
    with pytest.raises(ConfigError, match="attention backend 'torch' takes no options"):
        TorchPagedAttention().configure({"tile_size": 8})


# ---------------------------------------------------------------- whole models vs transformers
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("mlu-llama"), seed=3, **TINY)
    prompts = random_prompts(5, 320, 5, 45, seed=11)
    return path, prompts, hf_greedy_tokens(path, prompts, 20)


# 5 and 37 divide neither the block size (8) nor any prompt length; 256 is the default.
@pytest.mark.parametrize("tile_size", [5, 37, DEFAULT_TILE_SIZE])
def test_dense_llama_greedy_matches_transformers(llama, tile_size):
    path, prompts, expected = llama
    # A 24-token budget splits the longer prompts into chunks that continue a cached context,
    # and 12 blocks of 8 tokens force preemption: every path of the backend runs.
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="mlu_chunked",
              attention_options={"tile_size": tile_size}, num_kv_blocks=12, block_size=8,
              max_num_batched_tokens=24, max_model_len=72, enable_prefix_caching=False)
    assert llm.engine.runner.backends["mha"].tile_size == tile_size
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_sliding_window_mistral_greedy_matches_transformers(tmp_path):
    path = make_tiny_checkpoint("mistral", tmp_path, seed=5, **dict(TINY, sliding_window=12))
    prompts = random_prompts(3, 320, 10, 40, seed=2)
    expected = hf_greedy_tokens(path, prompts, 16)
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="mlu_chunked",
              attention_options={"tile_size": 7}, num_kv_blocks=32, block_size=4, max_num_batched_tokens=16,
              max_model_len=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_cpu_auto_keeps_the_core_cpu_backend(llama):
    path, _, _ = llama
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=8, max_model_len=64)
    assert llm.engine.runner.backends["mha"].name == "cpu_sdpa"  # mlu_chunked auto-selects on the MLU only


# ---------------------------------------------------------------- MoE and MLA models
MOE_AND_MLA = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(TINY, moe_intermediate_size=32, head_dim=16, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(TINY, moe_intermediate_size=32, num_key_value_heads=4,
                                                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                                                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                                  n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                                  norm_topk_prob=True)),
}


@pytest.mark.parametrize("model_type", list(MOE_AND_MLA))
def test_moe_and_mla_greedy_matches_transformers(model_type, tmp_path):
    from pagoda.plugins import get_registry

    architecture, config = MOE_AND_MLA[model_type]
    if architecture not in get_registry().models:
        pytest.skip(f"{architecture} is not registered (pagoda-models without it)")
    path = make_tiny_checkpoint(model_type, tmp_path, seed=1, **config)
    prompts = random_prompts(3, 320, 5, 30, seed=4)
    expected = hf_greedy_tokens(path, prompts, 12)
    llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend="mlu_chunked",
              attention_options={"tile_size": 5}, num_kv_blocks=32, block_size=4, max_model_len=64,
              max_num_batched_tokens=16)
    kinds = {kind: backend.name for kind, backend in llm.engine.runner.backends.items()}
    assert kinds == ({"mla": "mlu_chunked"} if model_type == "deepseek_v3" else {"mha": "mlu_chunked"})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("tile_size,kv_scale", [(1, None), (6, None), (64, None), (6, 0.05)])
def test_mla_matches_torch_mla_reference(tile_size, kv_scale):
    """``kv_scale``: an fp8 cache holding entry / k_scale."""
    from pagoda.attention.torch_mla import TorchMLAAttention

    kernels.activate("cpu")
    n, p, r, lora, vdim = 3, 8, 4, 12, 6
    spec = AttentionSpec("mla", num_heads=n, num_kv_heads=1, head_size=lora + r, scale=0.3, kv_lora_rank=lora,
                         qk_rope_head_dim=r, extra={"qk_nope_head_dim": p, "v_head_dim": vdim})
    gen = torch.Generator().manual_seed(tile_size)
    w_uk, w_uv = torch.randn(n, p, lora, generator=gen), torch.randn(n, vdim, lora, generator=gen)
    scales = None if kv_scale is None else {"k_scale": torch.tensor(kv_scale), "v_scale": torch.tensor(1.0)}
    layer = SimpleNamespace(spec=spec, absorbed_weights=lambda: (w_uk, w_uv), kv_scales=scales)
    batch = mixed_batch([9, 2], [(13, 6), (0, 11)], BLOCK, NUM_BLOCKS, seed=tile_size)
    meta, t = batch.meta, batch.meta.num_tokens
    ctx_slots = context_slots(batch)
    cache_shape = MluChunkedAttention().kv_cache_shape(spec, NUM_BLOCKS, BLOCK)
    assert cache_shape == TorchMLAAttention().kv_cache_shape(spec, NUM_BLOCKS, BLOCK)  # the core's latent layout
    cache_dtype = torch.float32 if kv_scale is None else torch.float8_e4m3fn
    ref_cache, our_cache = (torch.full(cache_shape, float("nan")).to(cache_dtype) for _ in range(2))
    for cache in (ref_cache, our_cache):
        gen_ctx = torch.Generator().manual_seed(99)
        get_op("store_mla_cache")(torch.randn(len(ctx_slots), lora, generator=gen_ctx),
                                  torch.randn(len(ctx_slots), r, generator=gen_ctx), cache, ctx_slots,
                                  *([] if scales is None else [scales["k_scale"]]))
    args = (torch.randn(t, n, p, generator=gen), torch.randn(t, n, r, generator=gen),
            torch.randn(t, lora, generator=gen), torch.randn(t, r, generator=gen))
    ours = MluChunkedAttention().configure({"tile_size": tile_size})
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        expected = TorchMLAAttention().forward_mla(layer, *args, ref_cache, meta)
        got = ours.forward_mla(layer, *args, our_cache, meta)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fp8_kv_cache_matches_the_torch_backend(llama):
    path, prompts, _ = llama
    tokens = {}
    for backend in ("torch", "mlu_chunked"):
        llm = LLM(model=str(path), device="cpu", dtype="float32", attention_backend=backend, kv_cache_dtype="fp8",
                  num_kv_blocks=40, block_size=8, max_model_len=72)
        assert llm.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        for layer in llm.engine.runner.attn_layers:  # per-layer scales, as an FP8 checkpoint brings
            layer.kv_scales = {"k_scale": torch.tensor(0.02), "v_scale": torch.tensor(0.05)}
        outs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["mlu_chunked"] == tokens["torch"]
