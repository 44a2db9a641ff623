"""Tensor-parallel sharding of LoRA weights (pagoda.lora.layers): each rank's layer, built as
that rank builds it, adds its slice of the update, and the slices put together (concatenated
for column-parallel layers, summed before the all-reduce for row-parallel ones) equal the
unsharded update, through the separate update and the stacked GEMM alike. Ranks are simulated in one process
(the layers' rank and size patched)."""

import pytest
import torch
from pagoda.forward_context import ForwardContext, set_forward_context
from pagoda.layers import linear
from pagoda.lora import ops as lora_ops
from pagoda.lora.layers import LoRALinearMethod, shard_lora_piece
from pagoda.lora.manager import LoRAMapping

HIDDEN, HEAD, HEADS = 16, 4, 4


def build(cls, rank: int, size: int, monkeypatch, *args, stacked: bool = False):
    """``stacked``: the layer's weight and the slots' A in one tensor, the update through the reference
    ``lora_expand_stacked`` (what pagoda-cuda's kernel does for small steps)."""
    monkeypatch.setattr(linear, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(linear, "get_tp_size", lambda: size)
    layer = cls(*args, params_dtype=torch.float32)
    layer.weight.data.zero_()  # only the LoRA update is compared
    layer.quant_method = LoRALinearMethod(layer.quant_method, 2, len(layer.output_sizes), 4,
                                          layer.input_size_per_partition, sum(layer.output_partition_sizes),
                                          torch.float32, torch.device("cpu"))
    if stacked:
        def expand_stacked(*op_args):
            return lora_ops.lora_expand_stacked(*op_args)

        expand_stacked.max_tokens = 64
        assert layer.quant_method.stack_weights(layer, expand_stacked)
    return layer


def update(layer, pieces, x):
    for piece, (a, b) in enumerate(pieces):
        a_local, b_local, offset = shard_lora_piece(layer, piece, a, b)
        layer.quant_method.write_piece(1, piece, a_local, b_local, offset)
    mapping = LoRAMapping(torch.ones(x.shape[0], dtype=torch.long), True)
    with set_forward_context(ForwardContext(attn_metadata=None, backends={}, lora=mapping)):
        return layer.quant_method.apply(layer, x, None)


@pytest.mark.parametrize("kv_heads, tp", [(2, 2), (1, 2), (2, 4)])  # (1, 2), (2, 4): KV heads replicated
def test_qkv_column_parallel_splits_b(monkeypatch, kv_heads, tp):
    gen = torch.Generator().manual_seed(tp * 10 + kv_heads)
    sizes = [HEADS * HEAD, kv_heads * HEAD, kv_heads * HEAD]
    pieces = [(torch.randn(3, HIDDEN, generator=gen), torch.randn(n, 3, generator=gen)) for n in sizes]
    x = torch.randn(5, HIDDEN, generator=gen)
    full = update(build(linear.QKVParallelLinear, 0, 1, monkeypatch, HIDDEN, HEAD, HEADS, kv_heads), pieces, x)
    q, k, v = full.split(sizes, dim=1)
    outs = []
    for rank in range(tp):
        layer = build(linear.QKVParallelLinear, rank, tp, monkeypatch, HIDDEN, HEAD, HEADS, kv_heads)
        outs.append(update(layer, pieces, x).split(layer.output_partition_sizes, dim=1))
    torch.testing.assert_close(torch.cat([o[0] for o in outs], 1), q)
    replicas = max(1, tp // kv_heads)
    torch.testing.assert_close(torch.cat([o[1] for o in outs[::replicas]], 1), k)
    torch.testing.assert_close(torch.cat([o[2] for o in outs[::replicas]], 1), v)


@pytest.mark.parametrize("stacked", [False, True])
def test_row_parallel_splits_a_and_sums(monkeypatch, stacked):
    gen = torch.Generator().manual_seed(1)
    tp, inner = 2, 12
    a, b = torch.randn(4, inner, generator=gen), torch.randn(HIDDEN, 4, generator=gen)
    x = torch.randn(5, inner, generator=gen)
    full = update(build(linear.RowParallelLinear, 0, 1, monkeypatch, inner, HIDDEN, stacked=stacked), [(a, b)], x)
    partial = [update(build(linear.RowParallelLinear, r, tp, monkeypatch, inner, HIDDEN, stacked=stacked), [(a, b)],
                      x.chunk(tp, dim=1)[r]) for r in range(tp)]
    # (the stacked GEMM's output is a strided view: a row-parallel shard hands the all-reduce a contiguous one)
    assert all(p.is_contiguous() for p in partial)
    torch.testing.assert_close(sum(partial), full)  # what the all-reduce of the layer's output adds up
    torch.testing.assert_close(full, x @ a.T @ b.T)


def test_merged_column_parallel_splits_each_piece(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    tp, inter = 2, 8
    pieces = [(torch.randn(2, HIDDEN, generator=gen), torch.randn(inter, 2, generator=gen)) for _ in range(2)]
    x = torch.randn(3, HIDDEN, generator=gen)
    full = update(build(linear.MergedColumnParallelLinear, 0, 1, monkeypatch, HIDDEN, [inter] * 2), pieces, x)
    outs = [update(build(linear.MergedColumnParallelLinear, r, tp, monkeypatch, HIDDEN, [inter] * 2), pieces, x)
            .split(inter // tp, dim=1) for r in range(tp)]
    gate, up = full.split(inter, dim=1)
    torch.testing.assert_close(torch.cat([o[0] for o in outs], 1), gate)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], 1), up)
