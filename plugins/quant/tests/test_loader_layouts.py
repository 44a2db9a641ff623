"""Packed and block-scaled layouts through the core linear layers' weight loaders: fused
q/k/v and gate/up pieces and tensor-parallel slices land where the full dequantized weight
says, for every checkpoint format."""

import pytest
import torch
from pagoda.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda_quant.formats import writers
from pagoda_quant.quantizers import AwqQuantizer, Fp8Quantizer, GptqQuantizer

FORMATS = {
    "gptq-actorder": (GptqQuantizer(), "gptq", dict(group_size=32, desc_act=True)),
    "gptq-v2-asym": (GptqQuantizer(), "gptq", dict(group_size=32, symmetric=False, v2=True)),
    "awq": (AwqQuantizer(), "awq", dict(group_size=32)),
    "fp8-block": (Fp8Quantizer(), "fp8-block", dict(block=(32, 32))),
    "fp8-tensor": (Fp8Quantizer(), "fp8", dict()),
}
HIDDEN, HEAD, HEADS, KV_HEADS, INTER = 128, 32, 4, 2, 192


def _tensors(fmt, w, opts, seed):
    if fmt == "fp8-block":
        return writers.fp8_block_tensors(w, opts["block"])
    if fmt == "fp8":
        return writers.fp8_tensor_tensors(w)
    if fmt == "gptq":
        return writers.gptq_tensors(w, opts["group_size"], opts.get("symmetric", True), opts.get("desc_act", False),
                                    opts.get("v2", False), seed=seed)
    return writers.awq_tensors(w, opts["group_size"])


def _set_tp(monkeypatch, rank, size):
    import pagoda.layers.linear as linear

    monkeypatch.setattr(linear, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(linear, "get_tp_size", lambda: size)


def _load(layer, pieces):
    """pieces: [(shard_id, {name: tensor})] -> load every tensor through its parameter."""
    params = dict(layer.named_parameters())
    for shard, tensors in pieces:
        for name, tensor in tensors.items():
            param = params[name]
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("tp", [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("name", list(FORMATS))
def test_fused_and_sharded_layers_load_their_slice(monkeypatch, name, tp):
    quantizer, fmt, opts = FORMATS[name]
    rank, size = tp
    if name == "gptq-actorder" and size > 1:
        pytest.skip("act order is refused for row-parallel layers at tp > 1 (tested below)")
    config = quantizer.from_checkpoint(writers.quantization_config(fmt, **opts))
    torch.manual_seed(0)
    _set_tp(monkeypatch, rank, size)

    # column parallel, three fused pieces: rank r holds rows r/size of each piece
    q = torch.randn(HEADS * HEAD, HIDDEN)
    k, v = torch.randn(KV_HEADS * HEAD, HIDDEN), torch.randn(KV_HEADS * HEAD, HIDDEN)
    qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, quant_config=config, prefix="layers.0.self_attn.qkv_proj")
    # pieces with one input share GPTQ's act order (it comes from that input's statistics)
    parts = [(s, *_tensors(fmt, w, opts, 0)) for s, w in zip("qkv", (q, k, v))]
    _load(qkv, [(s, t) for s, t, _ in parts])
    want = torch.cat([deq.chunk(size, dim=0)[rank] for _, _, deq in parts])
    torch.testing.assert_close(qkv.quant_method.dequantize(qkv), want, rtol=0, atol=1e-6)

    # merged gate/up
    gate, up = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN)
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], quant_config=config,
                                         prefix="layers.0.mlp.gate_up_proj")
    parts = [(i, *_tensors(fmt, w, opts, 10)) for i, w in enumerate((gate, up))]
    _load(gate_up, [(s, t) for s, t, _ in parts])
    want = torch.cat([deq.chunk(size, dim=0)[rank] for _, _, deq in parts])
    torch.testing.assert_close(gate_up.quant_method.dequantize(gate_up), want, rtol=0, atol=1e-6)

    # row parallel: rank r holds input columns r/size
    down = RowParallelLinear(INTER, HIDDEN, quant_config=config, prefix="layers.0.mlp.down_proj")
    tensors, deq = _tensors(fmt, torch.randn(HIDDEN, INTER), opts, 20)
    _load(down, [(None, tensors)])
    torch.testing.assert_close(down.quant_method.dequantize(down), deq.chunk(size, dim=1)[rank], rtol=0, atol=1e-6)
    # the forward pass (act-order permutation, kernels) computes with that weight; FP8 also
    # quantizes the activations, within a few percent
    x = torch.randn(3, INTER // size)
    want = x @ deq.chunk(size, dim=1)[rank].t()
    assert float((down(x) - want).norm() / want.norm()) < (0.06 if fmt.startswith("fp8") else 1e-5)


def test_act_order_refuses_row_parallel_split(monkeypatch):
    from pagoda.errors import ModelLoadError

    config = GptqQuantizer().from_checkpoint(writers.quantization_config("gptq", group_size=32, desc_act=True))
    _set_tp(monkeypatch, 0, 2)
    with pytest.raises(ModelLoadError, match="tensor_parallel_size=2 ranks, which act-order"):
        RowParallelLinear(INTER, HIDDEN, quant_config=config, prefix="layers.0.mlp.down_proj")
