"""pagoda-mlu's calls into torch_mlu_ops, driven through a STAND-IN torch_mlu_ops on the CPU.

The stand-in computes what torch_mlu_ops documents for each function; these tests check that the
adapters and the mlu_fused backend give the same results as pagoda's torch references when the
kernels behave as documented. They say nothing about the real kernels on an MLU.
"""

from types import SimpleNamespace

import pytest
import torch
from mlu_stand_ins import install_torch_mlu_ops
from pagoda import kernels
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.forward_context import ForwardContext, set_forward_context
from pagoda.interfaces import AttentionSpec
from pagoda.kernels import cpu_ops, get_op, reference
from pagoda.plugins import load_plugins
from pagoda_mlu import plugin, tmo_kernels
from pagoda_mlu.fused_attention import MluFusedAttention
from pagoda_mlu.paged_cache import store_kv_cache_head_major
from pagoda_mlu.synthetic import context_slots, mixed_batch


@pytest.fixture
def tmo(monkeypatch):
    return install_torch_mlu_ops(monkeypatch)


def test_kernels_registered_for_the_mlu_only_when_torch_mlu_ops_imports(monkeypatch):
    def registered():
        calls = []
        plugin.register_kernels(register=lambda op, platform, impl, priority=0: calls.append(
            (op, platform, impl, priority)))
        return calls

    monkeypatch.setitem(__import__("sys").modules, "torch_mlu_ops", None)
    assert registered() == [("store_kv_cache_head_major", "*", "pagoda_mlu.paged_cache:store_kv_cache_head_major",
                             0)]
    install_torch_mlu_ops(monkeypatch)
    fused = [c for c in registered() if c[1] == "mlu"]
    assert {c[0] for c in fused} == {"rms_norm", "fused_add_rms_norm", "rotary_embedding",
                                     "store_kv_cache_head_major", "fused_moe"}
    assert all(impl == f"pagoda_mlu.tmo_kernels:{op}" and prio == 20 for op, _, impl, prio in fused)
    reg = load_plugins()
    fn, provider = reg.kernels.select("rms_norm", "mlu")
    assert fn is tmo_kernels.rms_norm and provider == "pagoda-mlu"
    assert reg.kernels.select("rms_norm", "cpu")[0] is cpu_ops.rms_norm  # other platforms keep theirs
    assert reg.kernels.select("rms_norm", "cuda")[0] is not tmo_kernels.rms_norm


def test_rms_norms(tmo):
    gen = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(5, 32, generator=gen) for _ in range(3))
    torch.testing.assert_close(tmo_kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    got, expected = tmo_kernels.fused_add_rms_norm(x, res, w, 1e-5), reference.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert tmo.calls == ["fused_rms_norm", "fused_rms_norm"]


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # whole head, and partial rotary
def test_rotary(tmo, is_neox, rotary_dim):
    gen = torch.Generator().manual_seed(1)
    t, head, nq, nk = 6, 16, 4, 2
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.arange(64).float()[:, None] * inv[None]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # pagoda's [P, rot]: cos half | sin half
    positions = torch.tensor([0, 5, 9, 17, 33, 63])
    q, k = torch.randn(t, nq * head, generator=gen), torch.randn(t, nk * head, generator=gen)
    got = tmo_kernels.rotary_embedding(positions, q, k, head, cache, is_neox)
    expected = reference.rotary_embedding(positions, q, k, head, cache, is_neox)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    assert tmo.calls == ["apply_rotary"]


def test_paged_cache_write(tmo):
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([3, 17, -1, 40, 8])  # -1: a padding token, written nowhere
    ours, expected = torch.zeros(2, 12, 2, 4, 8), torch.zeros(2, 12, 2, 4, 8)
    tmo_kernels.store_kv_cache_head_major(k, v, ours, slots)
    store_kv_cache_head_major(k, v, expected, slots)
    torch.testing.assert_close(ours, expected)
    assert tmo.calls == ["reshape_paged_cache"]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fused_moe(tmo, activation):
    gen = torch.Generator().manual_seed(3)
    t, h, inter, experts, topk = 7, 16, 12, 5, 2
    hidden = torch.randn(t, h, generator=gen)
    w13, w2 = torch.randn(experts, 2 * inter, h, generator=gen) / 4, torch.randn(experts, h, inter, generator=gen) / 4
    ids = torch.randint(0, experts, (t, topk), generator=gen)
    ids[1, 0], ids[4, 1] = -1, -1  # experts held by other ranks (expert parallelism): contribute nothing
    weights = torch.rand(t, topk, generator=gen)
    got = tmo_kernels.fused_moe(hidden, w13, w2, weights, ids, activation)
    torch.testing.assert_close(got, reference.fused_moe(hidden, w13, w2, weights, ids, activation),
                               atol=1e-5, rtol=1e-5)
    assert tmo.calls == ["moe_gen_idx", "moe_expand_input", "group_gemm", "active", "group_gemm",
                         "moe_combine_result"]


# ---------------------------------------------------------------- the mlu_fused backend
def fused_vs_reference(spec: AttentionSpec, block_size: int, seed: int = 0):
    kernels.activate("cpu")  # the cache writes use the torch op; the attention calls go to the stand-in
    batch = mixed_batch([9, 1, 23], [(13, 6), (0, 11), (0, 4), (5, 3), (0, 1)], block_size, 64, seed)
    meta = batch.meta
    gen = torch.Generator().manual_seed(seed)
    nq, nk, hs = spec.num_heads, spec.num_kv_heads, spec.head_size
    slots = context_slots(batch)
    ctx_k, ctx_v = torch.randn(len(slots), nk, hs, generator=gen), torch.randn(len(slots), nk, hs, generator=gen)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, n * hs, generator=gen) for n in (nq, nk, nk))
    layer = SimpleNamespace(spec=spec)
    ref, fused = TorchPagedAttention(), MluFusedAttention()
    ref_cache = torch.full(ref.kv_cache_shape(spec, 64, block_size), float("nan"))
    our_cache = torch.full(fused.kv_cache_shape(spec, 64, block_size), float("nan"))
    get_op("store_kv_cache")(ctx_k, ctx_v, ref_cache, slots)
    fused.store(ctx_k, ctx_v, our_cache, slots)
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        expected = ref.forward(layer, q, k, v, ref_cache, meta)
        got = fused.forward(layer, q, k, v, our_cache, meta)
    return got, expected


@pytest.mark.parametrize("window", [None, 6])
def test_fused_backend_matches_reference(tmo, window):
    spec = AttentionSpec("mha", num_heads=4, num_kv_heads=2, head_size=8, scale=0.35, sliding_window=window)
    got, expected = fused_vs_reference(spec, block_size=4)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    # decodes in one paged call; the three fresh prompts (rows not adjacent) in one packed call
    assert tmo.calls.count("single_query_cached_kv_attn") == 1 and tmo.calls.count("flash_attention") == 1


def test_fused_backend_tiles_decodes_for_block_sizes_the_kernel_lacks(tmo):
    spec = AttentionSpec("mha", num_heads=2, num_kv_heads=2, head_size=8, scale=0.35)
    got, expected = fused_vs_reference(spec, block_size=12, seed=4)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert tmo.calls == ["flash_attention"]


def test_fused_backend_supports(tmo, monkeypatch):
    spec = AttentionSpec("mha", num_heads=4, num_kv_heads=2, head_size=64, scale=0.1)
    backend = MluFusedAttention()
    assert backend.supports("mlu", "float16", spec) is None
    assert backend.supports("cpu", "float32", spec) == "runs on mlu, not cpu"
    assert "no logit soft-capping" in backend.supports("mlu", "float16", AttentionSpec(
        "mha", num_heads=4, num_kv_heads=2, head_size=64, scale=0.1, logits_soft_cap=30.0))
    assert "does not implement attention kind 'mla'" in backend.supports("mlu", "float16", AttentionSpec(
        "mla", num_heads=4, num_kv_heads=1, head_size=72, scale=0.1, kv_lora_rank=64, qk_rope_head_dim=8))
    monkeypatch.setitem(__import__("sys").modules, "torch_mlu_ops", None)
    assert "torch_mlu_ops (Cambricon's fused kernels, shipped with its SDK) is not importable" in backend.supports(
        "mlu", "float16", spec)


def test_fp8_caches_stay_on_the_torch_paths(tmo):
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    slots = torch.tensor([0, 9, -1, 30])
    ours = torch.zeros(2, 8, 2, 4, 8, dtype=torch.float8_e4m3fn)
    expected = torch.zeros_like(ours)
    tmo_kernels.store_kv_cache_head_major(k, v, ours, slots)  # reshape_paged_cache takes no fp8 caches
    store_kv_cache_head_major(k, v, expected, slots)
    torch.testing.assert_close(ours.float(), expected.float())
    assert tmo.calls == []
