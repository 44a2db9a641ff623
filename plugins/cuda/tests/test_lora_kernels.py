"""Triton LoRA shrink/expand and the fused one-launch update against the core's torch reference
(pagoda.lora.ops): a batch that mixes slots and base rows (-1), ranks padded in the stack, widths that
are not block multiples, tokens taken given their work list (tokens in slot order, tiles of one adapter,
padded with empty tiles as the decode graphs pass them) or working it out, K split into partial sums
(the kernels' own choice) or not; the fused kernel's column groups (one or many per tile, inside the
pieces of a fused q/k/v or gate/up layer whose B is block-diagonal) and its bf16 path (upcast in the
interpreter)."""

import pytest
import torch
from pagoda.lora import ops as ref

GPU = pytest.mark.gpu


def _case(device, dtype, t, k, n, r, s, seed=0, segments=0, ordered=True):
    from pagoda_cuda.ops.lora import lora_expand, lora_fused, lora_shrink

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(device, dtype)
    y = torch.randn(t, n, generator=gen).to(device, dtype)
    a = (0.1 * torch.randn(s, r, k, generator=gen)).to(device, dtype)
    b = (0.1 * torch.randn(s, n, r, generator=gen)).to(device, dtype)
    slots = torch.randint(-1, s, (t,), generator=gen)
    if segments:  # prefill-like: runs of one adapter, as the chunks of sequences lie in the batch
        slots = slots.repeat_interleave(segments)[:t]
    order = tiles = None
    if ordered:  # as the engine passes them: built on the host, padded to a fixed number of tiles
        host_order = torch.argsort(slots, stable=True)
        tiles = torch.from_numpy(ref.token_tiles(slots[host_order].numpy(), pad_to=ref.max_tiles(t, s))).to(device)
        order = host_order.to(device)
    slots = slots.to(device)
    h = lora_shrink(x, a, slots, order, tiles)
    want_h = ref.lora_shrink(x, a, slots)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert h.dim() == 3 and h.shape[1:] == want_h.shape[1:]
    adapted = slots >= 0  # (a base token's h is never written nor read)
    torch.testing.assert_close(h.sum(0)[adapted], want_h.sum(0)[adapted], **tol)
    got = lora_expand(y.clone(), h, b, slots, order, tiles)
    want = ref.lora_expand(y.clone(), want_h, b, slots)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    base_rows = slots < 0
    assert torch.equal(got[base_rows], y[base_rows])  # base rows are untouched
    fused = lora_fused(x, y.clone(), a, b, slots, order, tiles)
    torch.testing.assert_close(fused.float(), want.float(), **tol)
    assert torch.equal(fused[base_rows], y[base_rows])


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("t, k, n, r, s, segments", [(5, 40, 24, 6, 3, 0), (37, 130, 70, 24, 4, 0),
                                                     (1, 16, 8, 1, 1, 0), (50, 72, 40, 8, 3, 11)])
def test_lora_kernels_match_reference(device, t, k, n, r, s, segments, ordered):
    _case(device, torch.float32, t, k, n, r, s, seed=t, segments=segments, ordered=ordered)


def test_small_batches_split_k_into_partial_sums(device):
    """A decode-sized batch splits K over programs (P > 1 partial sums), a long one does not."""
    from pagoda_cuda.ops.lora import lora_shrink

    a = torch.zeros(2, 16, 256, device=device)
    small = lora_shrink(torch.ones(4, 256, device=device), a, torch.zeros(4, dtype=torch.long, device=device))
    assert small.shape[0] > 1
    _case(device, torch.float32, 4, 256, 40, 16, 2, seed=3)


def _piece_stacks(device, t, k, sizes, r, s, seed, segments, second):
    """Inputs of a fused layer as pagoda.lora.layers writes its stacks: x [t, k], a second tensor of
    ``second`` columns of the same draw (y, or a base weight's rows), A [s, pieces*r, k] with piece i at
    rank rows i*r.., B block-diagonal over the pieces, slots (-1: base; runs of ``segments``), the
    host's token order and tiles on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(t, k, generator=gen)
    other = torch.randn(*second, generator=gen)
    a = 0.1 * torch.randn(s, len(sizes) * r, k, generator=gen)
    b = torch.zeros(s, n, len(sizes) * r)
    offset = 0
    for i, size in enumerate(sizes):
        b[:, offset:offset + size, i * r:(i + 1) * r] = 0.1 * torch.randn(s, size, r, generator=gen)
        offset += size
    slots = torch.randint(-1, s, (t,), generator=gen)
    if segments:
        slots = slots.repeat_interleave(segments)[:t]
    host_order = torch.argsort(slots, stable=True)
    tiles = torch.from_numpy(ref.token_tiles(slots[host_order].numpy(), pad_to=ref.max_tiles(t, s))).to(device)
    return x, other, a, b, slots, host_order, tiles


def _pieces_case(device, dtype, t, k, sizes, r, s, seed=0, config=None, segments=0):
    """A fused layer's stacks as pagoda.lora.layers writes them: piece i's A at rank rows i*r.., its B
    block-diagonal; the fused kernel told the pieces against the reference (which is not)."""
    from pagoda_cuda.ops.lora import lora_fused

    n = sum(sizes)
    x, y, a, b, slots, host_order, tiles = _piece_stacks(device, t, k, sizes, r, s, seed, segments, (t, n))
    x, y, a, b = (v.to(device, dtype) for v in (x, y, a, b))
    slots = slots.to(device)
    want = ref.lora_fused(x.float(), y.float().clone(), a.float(), b.float(), slots)
    got = lora_fused(x, y.clone(), a, b, slots, host_order.to(device), tiles, piece_sizes=sizes, config=config)
    # float32: rounding only; bf16: the inputs are the same bf16 values, the result rounded to bf16 once
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    assert torch.equal(got[slots < 0], y[slots < 0])


# the default; many narrow column groups per piece; one group of several column blocks per piece
@pytest.mark.parametrize("config", [None, (32, 64, 64, 4), (32, 32, 0.01, 4)])
@pytest.mark.parametrize("t, k, sizes, r, s, segments", [(37, 130, (24, 8, 12), 6, 4, 0),  # q/k/v, odd widths
                                                         (20, 64, (48, 48), 16, 2, 7),  # gate/up, runs
                                                         (9, 40, (40,), 5, 3, 0)])  # one piece
def test_fused_kernel_column_groups_and_pieces(device, t, k, sizes, r, s, segments, config):
    _pieces_case(device, torch.float32, t, k, sizes, r, s, seed=t, config=config, segments=segments)


def test_fused_kernel_bf16(device):
    """bf16 operands (upcast after loading in the interpreter; the tensor cores on a GPU)."""
    _pieces_case(device, torch.bfloat16, 24, 96, (64, 32, 32), 8, 3, seed=5, config=(32, 32, 64, 4))


def test_column_groups_fill_the_device_or_follow_the_pieces():
    """Few tiles (a decode step): many narrow column groups; many tiles (prefill): one per piece."""
    from pagoda_cuda.ops.lora import column_groups

    assert column_groups((2048, 1024, 1024), 5, 64, 264) == (64, 64)  # 5 tiles x 64 groups
    assert column_groups((2048, 1024, 1024), 20, 64, 264) == (256, 16)
    width, groups = column_groups((2048, 1024, 1024), 260, 128, 264)
    assert groups == 3 and width >= 2048
    assert column_groups((100,), 1, 64, 8) == (64, 2)  # a partial last group


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_kernels_real_shapes(device, dtype):
    _case(device, dtype, 256, 4096, 3 * 4096, 48, 16)  # decode-like: 16 adapters mixed
    _case(device, dtype, 2048, 4096, 4096, 16, 4, segments=512)  # prefill-like: runs of one adapter
    _pieces_case(device, dtype, 64, 1024, (2048, 1024, 1024), 16, 16)  # Qwen3-0.6B's qkv, a decode batch
    _pieces_case(device, dtype, 4096, 1024, (3072, 3072), 16, 4, segments=1024)  # its gate/up, a prefill


@pytest.mark.parametrize("kv_heads, tp", [(2, 1), (2, 2), (1, 2)])  # (1, 2): the KV head replicated
def test_fused_kernel_in_sharded_qkv_layers(device, monkeypatch, kv_heads, tp):
    """The fused kernel as pagoda.lora.layers calls it (the rank's piece widths) on each rank's
    column-parallel q/k/v layer, against the reference update of the same layer."""
    from pagoda.forward_context import ForwardContext, set_forward_context
    from pagoda.layers import linear
    from pagoda.lora.layers import LoRALinearMethod, shard_lora_piece
    from pagoda.lora.manager import LoRAMapping
    from pagoda_cuda.ops.lora import lora_fused

    hidden, head, heads = 32, 8, 4
    gen = torch.Generator().manual_seed(kv_heads * 10 + tp)
    sizes = [heads * head, kv_heads * head, kv_heads * head]
    pieces = [(torch.randn(3, hidden, generator=gen), torch.randn(n, 3, generator=gen)) for n in sizes]
    x = torch.randn(20, hidden, generator=gen).to(device)
    slots = torch.randint(-1, 2, (20,), generator=gen).to(device)
    for rank in range(tp):
        monkeypatch.setattr(linear, "get_tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(linear, "get_tp_size", lambda: tp)
        layer = linear.QKVParallelLinear(hidden, head, heads, kv_heads, params_dtype=torch.float32).to(device)
        layer.weight.data.zero_()  # only the LoRA update is compared
        method = LoRALinearMethod(layer.quant_method, 2, 3, 4, hidden, sum(layer.output_partition_sizes),
                                  torch.float32, device)
        layer.quant_method = method
        for piece, (a, b) in enumerate(pieces):
            a_local, b_local, offset = shard_lora_piece(layer, piece, a, b)
            method.write_piece(1, piece, a_local.to(device), b_local.to(device), offset)
        with set_forward_context(ForwardContext(attn_metadata=None, backends={}, lora=LoRAMapping(slots, True))):
            method.update = ref.lora_fused
            want = method.apply(layer, x, None)
            method.update = lora_fused
            got = method.apply(layer, x, None)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _stacked_case(device, dtype, t, k, sizes, r, s, seed=0, segments=0):
    """The expand of a layer whose base GEMM ran over its weight stacked with every slot's A: the base
    output plus each adapted token's update, in place in the GEMM's output, against the reference."""
    from pagoda_cuda.ops.lora import lora_expand_stacked

    n = sum(sizes)
    x, w, a, b, slots, host_order, tiles = _piece_stacks(device, t, k, sizes, r, s, seed, segments, (n, k))
    w = 0.1 * w
    x, w, a, b = (v.to(device, dtype) for v in (x, w, a, b))
    slots = slots.to(device)
    stacked = torch.cat([w, a.reshape(-1, k)])  # [N + S*R, K]
    out = x @ stacked.T
    base = out[:, :n].clone()
    # the reference from the same rounded shrink the GEMM wrote (the kernel's input)
    h = out[:, n:].reshape(t, s, -1)[torch.arange(t), slots.clamp(min=0)].float()
    want = base.float() + torch.einsum("tr,tnr->tn", h, b.float()[slots.clamp(min=0)])
    pieces = sizes if len(sizes) > 1 else None
    got = lora_expand_stacked(out, n, b, slots, host_order.to(device), tiles, pieces)
    assert got.data_ptr() == out.data_ptr() and got.shape == (t, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(got[slots >= 0].float(), want[slots >= 0], **tol)
    assert torch.equal(got[slots < 0], base[slots < 0])  # base rows keep the base output


@pytest.mark.parametrize("t, k, sizes, r, s, segments", [(37, 40, (24, 8, 12), 6, 4, 0),  # q/k/v, odd widths
                                                         (20, 32, (200, 200), 16, 2, 7),  # gate/up, runs
                                                         (9, 24, (40,), 5, 3, 0), (1, 8, (8,), 1, 1, 0)])
def test_expand_from_stacked_gemm(device, t, k, sizes, r, s, segments):
    _stacked_case(device, torch.float32, t, k, sizes, r, s, seed=t, segments=segments)


def test_expand_from_stacked_gemm_bf16(device):
    _stacked_case(device, torch.bfloat16, 24, 96, (64, 32, 32), 8, 3, seed=5)


def test_expand_from_stacked_gemm_checks_the_width(device):
    from pagoda_cuda.ops.lora import lora_expand_stacked

    out = torch.zeros(4, 10 + 2 * 3, device=device)
    with pytest.raises(ValueError, match=r"not \[T, 10 \+ 2 x 4\]"):
        lora_expand_stacked(out, 10, torch.zeros(2, 10, 4, device=device), torch.zeros(4, dtype=torch.long,
                                                                                    device=device))


@GPU
def test_expand_from_stacked_gemm_real_shapes(device):
    _stacked_case(device, torch.bfloat16, 64, 1024, (2048, 1024, 1024), 16, 16)  # Qwen3-0.6B's qkv, decode
    _stacked_case(device, torch.bfloat16, 64, 3072, (1024,), 16, 16)  # its down projection
