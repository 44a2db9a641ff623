"""Number formats: quantize/dequantize round trips within each format's error bound, and the
exact bit layouts of the packed INT4 formats."""

import pytest
import torch
from pagoda_quant.formats import fp8 as f8
from pagoda_quant.formats import int4 as i4

E4M3_REL = 2.0 ** -4  # 3 mantissa bits: half an ulp is 1/16 of the value's binade
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # subnormal spacing 2^-9, in scaled units


def _within_fp8_bound(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> None:
    bound = torch.maximum(x.abs() * E4M3_REL, scale * E4M3_SUBNORMAL_HALF_STEP) * (1 + 1e-5)
    assert bool(((deq - x).abs() <= bound).all()), float(((deq - x).abs() - bound).max())


def test_fp8_per_tensor_and_per_channel_round_trip():
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.logspace(-5, 1, 48)[:, None]  # rows of very different ranges
    q, s = f8.quantize_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ()
    _within_fp8_bound(w, q.float() * s, s)
    q, s = f8.quantize_per_channel(w)
    assert s.shape == (48,)
    _within_fp8_bound(w, q.float() * s[:, None], s[:, None])
    # each row's largest magnitude maps onto the top of the fp8 range
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((48,), 448.0))
    # per-channel keeps the small rows accurate; one scale for all rows flushes them to subnormals
    qt, st = f8.quantize_per_tensor(w)
    small = slice(0, 8)
    assert (q.float() * s[:, None] - w)[small].norm() < 0.2 * (qt.float() * st - w)[small].norm()


def test_fp8_activation_schemes_round_trip():
    torch.manual_seed(1)
    x = torch.randn(7, 300) * 5
    q, s = f8.quantize_per_token(x)
    assert s.shape == (7, 1)
    _within_fp8_bound(x, q.float() * s, s)
    q, s = f8.quantize_per_token_group(x, 128)  # 300 columns: groups of 128, 128, 44
    assert s.shape == (7, 3) and q.shape == x.shape
    deq = f8.dequantize_per_group(q, s, 128)
    _within_fp8_bound(x, deq, s.repeat_interleave(128, dim=1)[:, :300])


def test_fp8_block_round_trip_with_partial_blocks():
    torch.manual_seed(2)
    w = torch.randn(200, 136)  # 2x2 blocks of 128, the last ones partial
    q, s = f8.quantize_blockwise(w, (128, 128))
    assert q.shape == w.shape and s.shape == (2, 2) and s.dtype == torch.float32
    deq = f8.dequantize_blockwise(q, s, (128, 128))
    _within_fp8_bound(w, deq, f8.expand_block_scale(s, (200, 136), (128, 128)))
    # the scale of block (1, 1) comes from w[128:, 128:] only
    assert torch.allclose(s[1, 1], w[128:, 128:].abs().max() / 448.0)


def test_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -1e6, 3.0])
    q = f8.cast_to_fp8(x, torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 3.0]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, -1])
def test_int4_group_round_trip_within_half_a_step(symmetric, group):
    torch.manual_seed(3)
    w = torch.randn(24, 128) + 0.3  # an offset: zero points matter
    q, scales, zeros = i4.quantize_groups(w, group, symmetric)
    g = 128 if group == -1 else group
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.shape == (24, 128 // g) and zeros.shape == scales.shape
    if symmetric:
        assert bool((zeros == 8).all())
    assert bool((zeros == zeros.round()).all()) and bool((zeros >= 0).all() and (zeros <= 15).all())
    deq = i4.dequantize_groups(q, scales, zeros)
    step = scales.repeat_interleave(g, dim=1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    if not symmetric:  # asymmetric uses the whole 0..15 range of every group
        assert int(q.reshape(24, -1, g).amax(-1).min()) == 15


def test_gptq_row_packing_bit_layout():
    # eight input rows 0..7 of one output column: nibble i holds row i
    q = torch.arange(8, dtype=torch.uint8).view(8, 1)
    assert i4.pack_rows(q).item() == 0x76543210
    # a 15 in the top nibble makes the int32 negative; unpacking must not sign-extend into it
    q = torch.tensor([[15]] * 8, dtype=torch.uint8)
    packed = i4.pack_rows(q)
    assert packed.dtype == torch.int32 and packed.item() == -1
    assert i4.unpack_rows(packed).view(-1).tolist() == [15] * 8


def test_awq_column_packing_order():
    # columns 0..7 of one row: AWQ puts column AWQ_ORDER[i] in nibble i -> 0,2,4,6,1,3,5,7
    q = torch.arange(8, dtype=torch.uint8).view(1, 8)
    assert i4.pack_cols(q, i4.AWQ_ORDER).item() == 0x75316420
    assert i4.pack_cols(q).item() == 0x76543210  # GPTQ's qzeros: sequential
    torch.manual_seed(4)
    q = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    assert torch.equal(i4.unpack_cols(i4.pack_cols(q, i4.AWQ_ORDER), i4.AWQ_ORDER), q)
    assert not torch.equal(i4.unpack_cols(i4.pack_cols(q, i4.AWQ_ORDER)), q)  # the order matters


def test_kernel_layout_dequantizes_to_the_transposed_weight():
    torch.manual_seed(5)
    w = torch.randn(40, 64)
    q, scales, zeros = i4.quantize_groups(w, 16)
    qweight, s, z = i4.to_kernel_layout(q, scales, zeros, torch.float32)
    assert qweight.shape == (8, 40) and s.shape == (4, 40) and z.shape == (4, 40)
    assert torch.equal(i4.dequantize_packed(qweight, s, z), i4.dequantize_groups(q, scales, zeros).t())
