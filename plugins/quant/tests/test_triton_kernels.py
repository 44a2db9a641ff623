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
from pagoda_quant.kernels import cuda as cuda_ops  # noqa: E402
from pagoda_quant.kernels import triton_fp8, triton_int4  # noqa: E402

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


@pytest.mark.parametrize("m", [4, 33, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_gemm_matches_reference(m, dtype):
    torch.manual_seed(3)
    k, n = 256, 80
    q, s, z = i4.quantize_groups(torch.randn(n, k, device=DEVICE), 64)
    qweight, scales, zeros = i4.to_kernel_layout(q, s, z, dtype)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    want = ref.int4_linear(x, qweight, scales, zeros, bias).float()
    tol = dict(rtol=2e-3, atol=2e-2) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-4)
    for split in (1, 2):
        torch.testing.assert_close(triton_int4.int4_gemm(x, qweight, scales, zeros, bias, split_k=split).float(),
                                   want, **tol)
    torch.testing.assert_close(triton_int4.int4_dequantize(qweight, scales, zeros),
                               i4.dequantize_packed(qweight, scales, zeros), rtol=0, atol=0)


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
    from pagoda_quant.kernels import triton_moe
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


def test_moe_alignment_pads_each_expert_to_whole_blocks():
    from pagoda_quant.kernels.triton_moe import align

    ids = torch.tensor([[2, 0], [2, -1], [0, 2]], device=DEVICE)
    pairs, block_expert, num_pairs = align(ids, 4, 4)
    assert num_pairs == 6
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5; the -1 (pair 3) is dropped; filler = 6
    assert pairs[:8].tolist() == [1, 4, 6, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:3] == [0, 2, 4]
