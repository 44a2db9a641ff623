"""Triton kernel ops against the core's torch reference (interpreter on CPU, real shapes on GPU)."""

import pytest
import torch
from pagoda.kernels import reference as ref
from pagoda.layers.rotary import get_rope

GPU = pytest.mark.gpu
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def close(a, b, dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale)


def test_rms_norm_of_a_heads_view_into_a_fused_projection(device):
    from pagoda_cuda.ops.norm import rms_norm

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen).to(device)
    k = qkv[:, 64:96].view(5, 2, 16)  # rows 64 apart, heads 16 apart
    w = (1 + 0.1 * torch.randn(16, generator=gen)).to(device)
    out = rms_norm(k, w, 1e-6)
    assert out.shape == (5, 2, 16)
    close(out, ref.rms_norm(k.contiguous(), w, 1e-6), torch.float32)


def _norm_case(device, dtype, rows, hidden, residual, offset=None):
    from pagoda_cuda.ops.norm import fused_add_rms_norm, fused_add_rms_norm_offset, rms_norm, rms_norm_offset

    gen = torch.Generator().manual_seed(rows * 7 + hidden)
    wide = torch.randn(rows, hidden + 8, generator=gen).to(device, dtype)
    x = wide[:, 3:hidden + 3]  # a strided view, as q/k slices of a fused projection are
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    if offset is not None:  # Gemma's (1 + w) with w near 0 (offset 1); float32 weights (offset 0)
        w = (0.1 * torch.randn(hidden, generator=gen)).to(device, dtype if offset else torch.float32)
    if residual:
        r = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        if offset is None:
            out, summed = fused_add_rms_norm(x, r, w, 1e-6)
            want_out, want_sum = ref.fused_add_rms_norm(x, r, w, 1e-6)
        else:
            out, summed = fused_add_rms_norm_offset(x, r, w, 1e-6, offset)
            want_out, want_sum = ref.fused_add_rms_norm_offset(x, r, w, 1e-6, offset)
        close(summed, want_sum, dtype)
    elif offset is None:
        out, want_out = rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)
    else:
        out, want_out = rms_norm_offset(x, w, 1e-6, offset), ref.rms_norm_offset(x, w, 1e-6, offset)
    assert out.dtype == want_out.dtype and out.shape == want_out.shape
    close(out, want_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(device, dtype, residual):
    _norm_case(device, dtype, 5, 48, residual)
    _norm_case(device, dtype, 37, 16, residual)  # several rows per program


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_rms_norm_offset(device, dtype, residual, offset):
    _norm_case(device, dtype, 5, 48, residual, offset)
    _norm_case(device, dtype, 37, 16, residual, offset)


def _rotary_case(device, dtype, tokens, nq, nk, head, rotary_dim, neox, rope):
    from pagoda_cuda.ops.rotary import rotary_embedding

    emb = get_rope(head, rotary_dim, 64, rope, is_neox_style=neox)
    cache = emb.cos_sin_cache.to(device)
    gen = torch.Generator().manual_seed(tokens + nq)
    qkv = torch.randn(tokens, (nq + 2 * nk) * head, generator=gen).to(device, dtype)
    q, k = qkv[:, :nq * head], qkv[:, nq * head:(nq + nk) * head]  # strided views
    pos = torch.randint(0, cache.shape[0], (tokens,), generator=gen).to(device)
    got_q, got_k = rotary_embedding(pos, q, k, head, cache, neox)
    want_q, want_k = ref.rotary_embedding(pos, q, k, head, cache, neox)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


@pytest.mark.parametrize("neox", [True, False])
def test_rotary(device, neox):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}
    _rotary_case(device, torch.float32, 6, 4, 2, 32, 32, neox, None)
    _rotary_case(device, torch.bfloat16, 3, 3, 1, 24, 16, neox, yarn)  # partial rotary, odd heads
    _rotary_case(device, torch.float32, 5, 2, 1, 32, 24, neox, None)  # 12 pairs: padded to 16 in the kernel


def _qk_norm_rotary_case(device, dtype, tokens, nq, nk, hs, rot, neox):
    """The fused op against the reference RMSNorm of every head, then the reference rotary, on q/k views into
    a fused projection (rot < hs: the other dims pass through, normalised)."""
    from pagoda_cuda.ops.rotary import qk_norm_rotary

    gen = torch.Generator().manual_seed(tokens + rot + neox)
    qkv = (3 * torch.randn(tokens, (nq + 2 * nk) * hs, generator=gen) + 0.5).to(device, dtype)  # rms far from 1
    q, k = qkv[:, :nq * hs], qkv[:, nq * hs:(nq + nk) * hs]
    wq = (1 + 0.1 * torch.randn(hs, generator=gen)).to(device, dtype)
    wk = (1 + 0.1 * torch.randn(hs, generator=gen)).to(device, dtype)
    cache = get_rope(hs, rot, 4096, None, is_neox_style=neox).cos_sin_cache.to(device)
    pos = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    got_q, got_k = qk_norm_rotary(pos, q, k, wq, wk, 1e-6, hs, cache, neox)
    qn = ref.rms_norm(q.reshape(-1, hs), wq, 1e-6).view(tokens, -1)
    kn = ref.rms_norm(k.reshape(-1, hs), wk, 1e-6).view(tokens, -1)
    want_q, want_k = ref.rotary_embedding(pos, qn, kn, hs, cache, neox)
    assert got_q.shape == (tokens, nq * hs) and got_k.shape == (tokens, nk * hs) and got_q.dtype == dtype
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


@pytest.mark.parametrize("neox,rot", [(True, 32), (False, 32), (True, 16), (False, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rotary_matches_norm_then_rotary(device, neox, rot, dtype):
    _qk_norm_rotary_case(device, dtype, 7, 4, 2, 32, rot, neox)


@GPU
def test_qk_norm_rotary_real_shapes(device):
    _qk_norm_rotary_case(device, torch.bfloat16, 300, 16, 8, 128, 128, True)  # Qwen3-0.6B
    _qk_norm_rotary_case(device, torch.bfloat16, 300, 32, 4, 128, 128, True)  # Qwen3-30B-A3B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations(device, dtype):
    from pagoda_cuda.ops.activation import gelu_tanh_and_mul, silu_and_mul

    x = torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(0)).to(device, dtype) * 3
    close(silu_and_mul(x), ref.silu_and_mul(x), dtype)
    close(gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache_skips_padding(device, dtype):
    from pagoda_cuda.ops.kv_store import store_kv_cache

    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, 4, 2, 24, generator=gen).to(device, dtype)
    want = cache.clone()
    kv = torch.randn(5, 3 * 2 * 24, generator=gen).to(device, dtype)
    k, v = kv[:, :48].view(5, 2, 24), kv[:, 48:96].view(5, 2, 24)
    slots = torch.tensor([3, -1, 17, 0, 23], device=device)
    store_kv_cache(k, v, cache, slots)
    ref.store_kv_cache(k, v, want, slots)
    assert torch.equal(cache, want)
    # the triton backend's head-major pages [2, blocks, nk, block, hd], seen through a transpose
    head_major = torch.zeros(2, 6, 2, 4, 24, dtype=dtype, device=device)
    store_kv_cache(k, v, head_major.transpose(2, 3), slots)
    assert torch.equal(head_major.transpose(2, 3), _stored_only(want, slots))


def _stored_only(cache, slots):
    """``cache`` [2, blocks, block, nk, hd] with every row but the stored slots zeroed."""
    flat = cache.reshape(2, -1, *cache.shape[3:])
    kept = torch.zeros_like(flat)
    rows = slots[slots >= 0]
    kept[:, rows] = flat[:, rows]
    return kept.view_as(cache)


@GPU
def test_store_kv_cache_fp8_with_scales(device):
    """An fp8 cache stores clamp(k / k_scale), bit for bit as the reference (GPU only: the
    interpreter's fp8 conversions are not exact)."""
    from pagoda_cuda.ops.kv_store import store_kv_cache

    gen = torch.Generator().manual_seed(2)
    cache = torch.zeros(2, 4, 4, 2, 16).to(device, torch.float8_e4m3fn)
    want = cache.clone()
    k = (torch.randn(5, 2, 16, generator=gen) * 8).to(device)
    v = torch.randn(5, 2, 16, generator=gen).to(device)
    slots = torch.tensor([0, 3, -1, 9, 15], device=device)
    scales = torch.tensor(0.05, device=device), torch.tensor(0.02, device=device)
    store_kv_cache(k, v, cache, slots, *scales)
    ref.store_kv_cache(k, v, want, slots, *scales)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


def _moe_case(device, dtype, tokens, hidden, inner, experts, topk, activation="silu", with_invalid=False,
              config=None, weight_tma=None, bias=False):
    from pagoda_cuda.ops.moe import fused_moe

    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inner, generator=gen) / inner ** 0.5).to(device, dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(topk, dim=-1)
    if with_invalid:  # expert parallelism maps experts held elsewhere to -1
        ids[::3, 0] = -1
    biases = {}
    if bias:
        biases = dict(w13_bias=torch.randn(experts, 2 * inner, generator=gen).to(device, dtype),
                      w2_bias=torch.randn(experts, hidden, generator=gen).to(device, dtype))
    if activation == "swigluoai" and dtype == torch.float32:  # reach both clamps (exact products only: the
        w13 = w13 * 8  # bf16 GEMMs of the kernel and the reference round differently at these magnitudes)
    got = fused_moe(x, w13, w2, weights.to(device), ids.to(device), activation, config=config,
                    weight_tma=weight_tma, **biases)
    want = ref.fused_moe(x, w13, w2, weights.to(device), ids.to(device), activation, **biases)
    close(got, want, dtype, scale=2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe(device, dtype):
    _moe_case(device, dtype, 9, 32, 24, 4, 2, with_invalid=True)


def test_fused_moe_gelu(device):
    _moe_case(device, torch.float32, 5, 16, 16, 3, 2, activation="gelu_tanh")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_swigluoai_with_biases(device, dtype):
    """GPT-OSS experts: biases on both projections, the clamped SwiGLU, experts of other ranks."""
    _moe_case(device, dtype, 9, 32, 24, 4, 2, activation="swigluoai", with_invalid=True, bias=True)


@pytest.mark.parametrize("group_m", [1, 5])
def test_fused_moe_grouped_tile_order(device, group_m):
    # 80 pairs over 4 experts: 9 row blocks (about 8 used) x 2 column tiles per projection;
    # with GROUP_M 5 the second group is short and holds used blocks
    _moe_case(device, torch.float32, 40, 32, 24, 4, 2, config=(16, 16, 16, 4, 2, group_m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_weight_descriptors(device, dtype, monkeypatch):
    from triton.tools.tensor_descriptor import TensorDescriptor

    made = []
    original = TensorDescriptor.from_tensor

    def counted(*args, **kw):
        made.append(1)
        return original(*args, **kw)

    monkeypatch.setattr(TensorDescriptor, "from_tensor", staticmethod(counted))
    # weight tiles through descriptors: I = 24 and H = 40 are not multiples of the 16-row tiles, so
    # the last tile of a run reads the next run's rows (up rows, the next expert) or past the end
    # of the weights, and those columns must be dropped at the store
    _moe_case(device, dtype, 21, 40, 24, 4, 2, with_invalid=True, config=(16, 16, 16, 4, 2, 1), weight_tma=True)
    # the same asked for by a tuned table's 7th config entry (and not, with 0)
    _moe_case(device, dtype, 21, 40, 24, 4, 2, config=(16, 16, 16, 4, 2, 1, 1))
    _moe_case(device, dtype, 21, 40, 24, 4, 2, config=(16, 16, 16, 4, 2, 1, 0))
    assert len(made) == 4  # w13 and w2, twice


# ----------------------------------------------------------------------------- real shapes (GPU)
@GPU
@pytest.mark.parametrize("hidden", [1024, 3072, 7168])
def test_norm_real_shapes(device, hidden):
    for residual in (False, True):
        _norm_case(device, torch.bfloat16, 256, hidden, residual)
    _norm_case(device, torch.bfloat16, 256 * 16, 128, False)  # q/k norm over head_dim


@GPU
def test_norm_offset_real_shapes(device):
    for residual in (False, True):
        _norm_case(device, torch.bfloat16, 256, 1152, residual, offset=1.0)  # Gemma 3 1B
        _norm_case(device, torch.bfloat16, 256, 2880, residual, offset=0.0)  # GPT-OSS-20B
    _norm_case(device, torch.bfloat16, 256 * 4, 256, False, offset=1.0)  # Gemma 3's q/k norms


@GPU
def test_rotary_real_shapes(device):
    _rotary_case(device, torch.bfloat16, 300, 16, 8, 128, 128, True, None)
    _rotary_case(device, torch.bfloat16, 300, 32, 32, 96, 96, True, None)
    yarn = {"rope_type": "deepseek_yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "rope_theta": 1e4, "mscale": 1.0, "mscale_all_dim": 1.0}
    _rotary_case(device, torch.bfloat16, 300, 128, 1, 64, 64, False, yarn)


@GPU
def test_activation_and_store_real_shapes(device):
    from pagoda_cuda.ops.activation import silu_and_mul
    from pagoda_cuda.ops.kv_store import store_kv_cache

    x = torch.randn(256, 2 * 8192, device=device, dtype=torch.bfloat16)
    close(silu_and_mul(x), ref.silu_and_mul(x), torch.bfloat16)
    cache = torch.randn(2, 64, 16, 8, 128, device=device, dtype=torch.bfloat16)
    want = cache.clone()
    k = torch.randn(300, 8, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn(300, 8, 128, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device=device)[:300]
    slots[::7] = -1
    store_kv_cache(k, v, cache, slots)
    ref.store_kv_cache(k, v, want, slots)
    assert torch.equal(cache, want)


@GPU
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_fused_moe_real_shapes(device, tokens):
    for weight_tma in (False, True):
        _moe_case(device, torch.bfloat16, tokens, 2048, 768, 128, 8, with_invalid=tokens == 256,
                  weight_tma=weight_tma)


@GPU
@pytest.mark.parametrize("tokens", [256, 2048])
def test_fused_moe_gpt_oss_real_shape(device, tokens):
    """gpt-oss-20b's experts: 32 of 2880 x 2880, top-4, biases, the clamped SwiGLU."""
    _moe_case(device, torch.bfloat16, tokens, 2880, 2880, 32, 4, activation="swigluoai", bias=True)


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,scaling", [
    (5, 8, 2, False, 1.0), (37, 60, 4, True, 1.0), (3, 128, 8, True, 2.5)])
def test_topk_softmax(device, tokens, experts, top_k, renormalize, scaling):
    from pagoda_cuda.ops.moe_routing import topk_softmax

    gen = torch.Generator().manual_seed(tokens + experts)
    wide = torch.randn(tokens, experts + 3, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        logits = wide.to(device, dtype)[:, 1:experts + 1]  # a strided view
        weights, ids = topk_softmax(logits, top_k, renormalize, scaling)
        want_w, want_ids = ref.topk_softmax(logits, top_k, renormalize, scaling)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64
        torch.testing.assert_close(weights, want_w, atol=1e-5, rtol=1e-5)
        if dtype == torch.float32:
            assert torch.equal(ids.cpu(), want_ids.cpu())
        else:  # bf16 logits tie; torch.topk breaks ties in no fixed order: the chosen values agree
            assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))


@GPU
def test_topk_softmax_real_shape(device):
    test_topk_softmax(device, 4096, 128, 8, True, 1.0)


@pytest.mark.parametrize("experts,block_m", [(4, 16), (6, 32), (128, 16)])
def test_moe_align_kernel_matches_torch_grouping(device, experts, block_m):
    from pagoda.layers.moe_grouping import group_pairs_by_expert
    from pagoda_cuda.ops.moe_align import align_triton

    gen = torch.Generator().manual_seed(experts)
    ids = torch.randint(0, experts, (37 if experts < 100 else 300, 3), generator=gen)
    ids[::4, 1] = -1  # experts held by other ranks
    ids = ids.to(device)
    pairs, block_expert, max_blocks = align_triton(ids, experts, block_m)
    want_pairs, want_expert, want_max = group_pairs_by_expert(ids, experts, block_m)
    assert max_blocks == want_max
    assert torch.equal(block_expert.cpu(), want_expert.cpu())
    # each expert's run holds the same pairs and padding (their order inside a run may differ)
    got, want = pairs.view(max_blocks, block_m).cpu(), want_pairs.view(max_blocks, block_m).cpu()
    for e in range(experts + 1):
        rows = block_expert.cpu() == e
        assert torch.equal(got[rows].flatten().sort().values, want[rows].flatten().sort().values)
