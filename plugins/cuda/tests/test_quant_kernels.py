"""Triton kernels against the torch reference: under TRITON_INTERPRET=1 on CPU (small shapes),
on the GPU when one is present.

The interpreter rounds some fp32 -> fp8 casts wrongly: a value that rounds up across a power
of two comes out at half of it. The quantization test accepts exactly that defect and nothing
else; the GEMM tests take the reference's quantized inputs, so they compare exactly.
"""

import pytest
import torch
from pagoda_quant.formats import fp8 as f8
from pagoda_quant.formats import int4 as i4
from pagoda_quant.kernels import reference as ref

triton = pytest.importorskip("triton")
from pagoda_cuda.quant import dispatch as cuda_ops  # noqa: E402
from pagoda_cuda.quant import fp8 as triton_fp8  # noqa: E402
from pagoda_cuda.quant import int4 as triton_int4  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"


def _assert_fp8_equal_but_interpreter_carries(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    bad = got != want
    if not INTERPRETED:
        assert not bool(bad.any())
        return
    # the interpreter's only defect: a power of two (the rounded-up value) halved
    w = want[bad]
    is_pow2 = torch.frexp(w.abs())[0] == 0.5
    assert bool(is_pow2.all()) and torch.equal(got[bad], w / 2), (got[bad], w)
    assert bad.float().mean() < 0.05


@pytest.mark.parametrize("group", [None, 32])
def test_activation_quantization_matches_reference(group):
    torch.manual_seed(0)
    x = (torch.randn(6, 160) * 3).to(DEVICE)
    x[2] = 0  # an all-zero row keeps a finite scale
    q, s = triton_fp8.quantize_fp8_groups(x, group or 160)
    if group is None:
        q_ref, s_ref = f8.quantize_per_token(x)
    else:
        q_ref, s_ref = f8.quantize_per_token_group(x, group)
    torch.testing.assert_close(s, s_ref.reshape(s.shape), rtol=1e-6, atol=0)
    _assert_fp8_equal_but_interpreter_carries(q, q_ref)


@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_gemm_matches_reference(m, dtype):
    torch.manual_seed(1)
    x = torch.randn(m, 192, device=DEVICE).to(dtype)
    wq, ws = f8.quantize_per_channel(torch.randn(72, 192, device=DEVICE))
    bias = torch.randn(72, device=DEVICE).to(dtype)
    xq, xs = f8.quantize_per_token(x)
    out = triton_fp8.fp8_gemm(xq, xs, wq, ws, bias, dtype)
    want = ref.fp8_linear(x, wq, ws, None, bias)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=2e-3 if dtype == torch.float16 else 1e-4)
    # static per-tensor activation scale: one scale for all rows
    static = torch.tensor(0.05, device=DEVICE)
    out = triton_fp8.fp8_gemm(f8.cast_to_fp8(x, static), static.reshape(1, 1), wq, ws, None, dtype)
    torch.testing.assert_close(out.float(), ref.fp8_linear(x, wq, ws, static).float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("m", [5, 70])
def test_fp8_block_gemm_matches_reference(m):
    torch.manual_seed(2)
    block = (32, 64)
    x = torch.randn(m, 200, device=DEVICE)  # K=200: a partial last block
    wq, ws = f8.quantize_blockwise(torch.randn(96, 200, device=DEVICE), block)
    xq, xs = f8.quantize_per_token_group(x, block[1])
    out = triton_fp8.fp8_block_gemm(xq, xs, wq, ws, block, None, torch.float32)
    torch.testing.assert_close(out, ref.fp8_block_linear(x, wq, ws, block), rtol=1e-5, atol=1e-4)


def _int4_weight(n, k, group, dtype, seed=3):
    torch.manual_seed(seed)
    q, s, z = i4.quantize_groups(torch.randn(n, k, device=DEVICE), group)
    return i4.to_kernel_layout(q, s, z, dtype)


# (M, N, K, group, blocks (BLOCK_M, BLOCK_N, BLOCK_K) or None: the default, split_k, bias)
INT4_GEMM_CASES = {
    "one group per tile, M < 16, N % BLOCK_N != 0": (5, 80, 256, 128, None, 1, True),
    "one group per tile, split-K 2": (5, 80, 256, 128, None, 2, False),
    "group 32: four groups per tile, split-K 3 over 2 tiles": (3, 48, 256, 32, None, 3, True),
    "group 64, BLOCK_K 256, partial last K tile": (20, 64, 384, 64, (16, 32, 256), 1, True),
    "group 64, M 33 over BLOCK_M 32, split-K 2": (33, 40, 192, 64, (32, 32, 128), 2, True),
    "one group per row (group = K = 192)": (2, 32, 192, -1, None, 2, False),
}


@pytest.mark.parametrize("case", list(INT4_GEMM_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_gemm_matches_reference(case, dtype):
    """Every path of the fused kernel: one or several groups per K tile, split-K 1 and > 1 (atomics),
    M and N not multiples of the block, K not a multiple of BLOCK_K, bias or not."""
    m, n, k, group, blocks, split, with_bias = INT4_GEMM_CASES[case]
    qweight, scales, zeros = _int4_weight(n, k, group, dtype)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    want = ref.int4_linear(x, qweight, scales, zeros, bias).float()
    tol = dict(rtol=2e-3, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-4)
    got = triton_int4.int4_gemm(x, qweight, scales, zeros, bias, split_k=split, blocks=blocks)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want, **tol)


def test_split_k_leaves_its_workspace_clean_for_the_next_call():
    """The last split of each tile zeroes the workspace and the counters it used: a second call (and
    one of another shape) sums from zero again."""
    m, n, k = 5, 80, 512
    for group, split in ((128, 4), (64, 3)):
        qweight, scales, zeros = _int4_weight(n, k, group, torch.float32)
        x = torch.randn(m, k, device=DEVICE)
        want = ref.int4_linear(x, qweight, scales, zeros)
        for _ in range(2):
            got = triton_int4.int4_gemm(x, qweight, scales, zeros, None, split_k=split)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        ws, counts = triton_int4.split_workspace(x.device, m, n)
        assert not ws.any() and not counts.any()


def test_int4_gemm_default_configuration_and_odd_group():
    """The configuration a caller gets (no override), and a group of 4 (a group boundary inside a
    packed word), which falls back to dequantize + matmul."""
    for group in (64, 4):
        qweight, scales, zeros = _int4_weight(64, 128, group, torch.float32)
        x = torch.randn(7, 128, device=DEVICE)
        torch.testing.assert_close(triton_int4.int4_gemm(x, qweight, scales, zeros, None),
                                   ref.int4_linear(x, qweight, scales, zeros), rtol=1e-5, atol=1e-4)
    assert triton_int4.int4_gemm(x[:0], qweight, scales, zeros, None).shape == (0, 64)


@pytest.mark.parametrize("group,k", [(128, 256), (32, 256), (64, 192)])
def test_int4_dequantize_is_exact(group, k):
    """Bit-exact against the reference: (q - z) * s in float32, rounded once (K 192: a partial tile).
    The interpreter's own float32 -> bfloat16 cast rounds some ties wrongly: one bf16 step there."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        qweight, scales, zeros = _int4_weight(40, k, group, dtype)
        tol = 2.0 ** -7 if INTERPRETED and dtype == torch.bfloat16 else 0
        torch.testing.assert_close(triton_int4.int4_dequantize(qweight, scales, zeros),
                                   i4.dequantize_packed(qweight, scales, zeros), rtol=tol, atol=0)


def test_split_k_heuristic_fills_the_gpu():
    """Decode shapes get about PROGRAMS_PER_SM programs per SM, never more splits than K tiles allow."""
    sms = 132
    for n, k in ((9216, 3072), (3072, 3072), (16384, 3072), (3072, 8192)):
        split = triton_int4.split_for(8, n, k, 16, 64, 128, sms)
        programs = triton.cdiv(n, 64) * split
        assert split == 1 or programs <= 2 * triton_int4.PROGRAMS_PER_SM * sms
        # at least half the target (powers of two), unless K has too few tiles to split further
        assert 2 * programs >= min(triton_int4.PROGRAMS_PER_SM * sms, triton.cdiv(n, 64) * (k // 128))
        assert split <= max(1, k // 128 // 2)
    assert triton_int4.split_for(256, 9216, 3072, 128, 128, 128, sms) == 4  # 72 x 2 tiles: a little split
    assert [triton_int4.m_bucket(m) for m in (1, 8, 16, 17, 64, 100, 255)] == [16, 16, 16, 32, 64, 128, 128]


def test_autotuning_tries_the_bucket_configs_at_two_splits(monkeypatch):
    """What the GPU autotuner benchmarks for a decode batch: the M bucket's tile shapes, each at the
    heuristic SPLIT_K and twice it."""
    monkeypatch.setattr(triton_int4, "_num_sms", lambda index: 132)
    x = torch.empty(8, 3072)
    configs = triton_int4._expand_splits(triton_int4._TUNE_CONFIGS, {"M": 8, "N": 3072, "K": 3072, "x_ptr": x})
    assert {c.kwargs["BLOCK_M"] for c in configs} == {16}
    assert len(configs) == 2 * len(triton_int4._TUNE_BASES[16])
    for c in configs:
        base = triton_int4.split_for(8, 3072, 3072, 16, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], 132)
        assert c.kwargs["SPLIT_K"] in (base, 2 * base)


def test_int4_act_order_permutation_reaches_the_kernel(monkeypatch):
    """GPTQ act-order: the method permutes the input columns before the fused kernel."""
    from pagoda_quant.methods import int4 as int4_methods

    k, n = 128, 48
    torch.manual_seed(6)
    perm = torch.randperm(k, device=DEVICE)
    q, s, z = i4.quantize_groups(torch.randn(n, k, device=DEVICE)[:, perm], 32)  # groups over permuted columns
    layer = torch.nn.Module()
    for name, t in zip(("qweight", "scales", "zeros"), i4.to_kernel_layout(q, s, z, torch.float32)):
        layer.register_buffer(name, t)
    layer.register_buffer("perm", perm)
    monkeypatch.setattr(int4_methods, "op", lambda name: cuda_ops.int4_linear)
    method = int4_methods.Int4KernelLayout.__new__(int4_methods.Int4KernelLayout)
    x = torch.randn(3, k, device=DEVICE)
    torch.testing.assert_close(method.apply(layer, x, None), x @ method.dequantize(layer).t(), rtol=1e-5, atol=1e-4)


def test_gpu_ops_compose_quantization_and_gemm():
    """The ``cuda`` ops as registered: activation quantization + GEMM (+ bias), 3-D input."""
    torch.manual_seed(4)
    x = torch.randn(2, 9, 128, device=DEVICE)
    w = torch.randn(64, 128, device=DEVICE)
    bias = torch.randn(64, device=DEVICE)
    wq, ws = f8.quantize_per_channel(w)
    out = cuda_ops.fp8_linear(x, wq, ws, None, bias)
    want = ref.fp8_linear(x, wq, ws, None, bias)
    assert out.shape == (2, 9, 64)
    # the interpreter's halved casts (a few % of the activations) cost a few % here; wiring
    # mistakes (a wrong scale, a transposed weight) cost ~100%
    tol = 0.1 if INTERPRETED else 0.01
    assert float((out - want).norm() / want.norm()) < tol
    bq, bs = f8.quantize_blockwise(w, (32, 32))
    out = cuda_ops.fp8_block_linear(x, bq, bs, (32, 32), bias)
    want = ref.fp8_block_linear(x, bq, bs, (32, 32), bias)
    assert float((out - want).norm() / want.norm()) < tol
    q, s, z = i4.quantize_groups(w, 32)
    qweight, scales, zeros = i4.to_kernel_layout(q, s, z, torch.float32)
    torch.testing.assert_close(cuda_ops.int4_linear(x, qweight, scales, zeros, bias),
                               ref.int4_linear(x, qweight, scales, zeros, bias), rtol=1e-5, atol=1e-4)


def _experts(method, e=4, h=64, inter=32, dtype=torch.float32):
    from pagoda_quant.methods.moe import ExpertWeights

    class Layer(torch.nn.Module):
        num_local_experts, expert_start, activation = e, 0, "silu"

    layer = Layer()
    with torch.device(DEVICE):
        method.create_weights(layer, e, h, inter, dtype)
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    method.process_weights_after_loading(layer)
    return ExpertWeights(layer, method, "w13"), ExpertWeights(layer, method, "w2")


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_quant_matches_reference(fmt, dtype):
    from pagoda_cuda.quant import moe as triton_moe
    from pagoda_quant.methods.moe import Fp8ExpertsMethod, Int4ExpertsMethod

    torch.manual_seed(5)
    method = {"fp8": Fp8ExpertsMethod(None, online=True), "fp8-block": Fp8ExpertsMethod((16, 16), online=True),
              "int4": Int4ExpertsMethod(16, False)}[fmt]
    w13, w2 = _experts(method, dtype=dtype)
    for t in (3, 40):  # few rows per expert (BLOCK_M 16) and many (BLOCK_M 64)
        x = torch.randn(t, 64, device=DEVICE).to(dtype)
        weights, ids = torch.randn(t, 4, device=DEVICE).softmax(-1).topk(2)
        ids[0, 1] = -1  # an expert held by another expert-parallel rank: contributes nothing
        got = triton_moe.fused_moe_quant(x, w13, w2, weights, ids)
        want = ref.fused_moe_quant(x, w13, w2, weights, ids)
        tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.float16 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_fused_moe_int4_one_group_per_tile():
    """INT4 experts whose group spans the whole K tile (group 128, hidden 256, intermediate 128)."""
    from pagoda_cuda.quant import moe as triton_moe
    from pagoda_quant.methods.moe import Int4ExpertsMethod

    torch.manual_seed(7)
    w13, w2 = _experts(Int4ExpertsMethod(128, False), e=3, h=256, inter=128)
    x = torch.randn(5, 256, device=DEVICE)
    weights, ids = torch.randn(5, 3, device=DEVICE).softmax(-1).topk(2)
    torch.testing.assert_close(triton_moe.fused_moe_quant(x, w13, w2, weights, ids),
                               ref.fused_moe_quant(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_moe_alignment_pads_each_expert_to_whole_blocks():
    from pagoda_cuda.quant.moe import align

    ids = torch.tensor([[2, 0], [2, -1], [0, 2]], device=DEVICE)
    pairs, block_expert, num_pairs = align(ids, 4, 4)
    assert num_pairs == 6
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5; the -1 (pair 3) is dropped; filler = 6
    assert pairs[:8].tolist() == [1, 4, 6, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:3] == [0, 2, 4]
