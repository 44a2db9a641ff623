"""Programmatic dependent launch of the decode path's kernels (``PAGODA_CUDA_PDL``): on unless set to 0, never
under the interpreter, and on a Hopper GPU the same results with it as without, launched eagerly and from a
CUDA graph."""

import pytest
import torch

GPU = pytest.mark.gpu


@pytest.mark.parametrize("raw,want", [(None, True), ("", True), ("0", False), ("false", False), ("1", True),
                                      ("true", True)])
def test_the_setting_is_read_from_the_environment(monkeypatch, raw, want):
    from pagoda_cuda import switches

    if raw is None:
        monkeypatch.delenv("PAGODA_CUDA_PDL", raising=False)
    else:
        monkeypatch.setenv("PAGODA_CUDA_PDL", raw)
    assert switches.pdl_requested() is want


def test_a_bad_setting_stops_the_engine_at_start_naming_the_variable(monkeypatch):
    # not at the kernels' import, where the registry would fall back to the torch reference with a warning
    from pagoda.errors import ConfigError
    from pagoda_cuda import switches
    from pagoda_cuda.platform import CudaPlatform

    monkeypatch.setenv("PAGODA_CUDA_PDL", "yes please")
    assert switches.lenient(switches.pdl_requested, False) is False
    with pytest.raises(ConfigError, match="PAGODA_CUDA_PDL"):
        CudaPlatform().set_device(0)


def test_never_on_a_cpu_tensor_nor_unless_asked(monkeypatch):
    from pagoda_cuda import _triton

    monkeypatch.setattr(_triton, "PDL_REQUESTED", True)
    assert not _triton.pdl(torch.device("cpu"))  # the interpreter's tensors
    monkeypatch.setattr(_triton, "PDL_REQUESTED", False)
    assert not _triton.pdl(torch.device("cuda", 0))


def _decode_layer_inputs(seed: int) -> dict:
    """Qwen3-0.6B's shapes at batch 4, bf16, context 700 (made outside any graph capture)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, nq, nk, hs, page, ctx = 4, 16, 8, 128, 16, 700
    blocks = -(-ctx // page)

    def r(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    tables = torch.arange(b * blocks, device="cuda", dtype=torch.int32).view(b, blocks)
    return dict(x=r(b, 1024), res=r(b, 1024), w=r(1024), q=r(b, nq * hs), k=r(b, nk * hs), v=r(b, nk, hs),
                wq=r(hs), wk=r(hs), cache=torch.randn(4096, hs, device="cuda", generator=gen),
                positions=torch.full((b,), ctx - 1, device="cuda", dtype=torch.int64),
                kv=r(2, b * blocks, page, nk, hs),
                tables=tables, slots=tables[:, -1].long() * page + (ctx - 1) % page,
                seq_lens=torch.full((b,), ctx, device="cuda", dtype=torch.int32), gate_up=r(b, 2 * 3072),
                down=r(1024, 3072), out=torch.empty(b, nq, hs, device="cuda", dtype=torch.bfloat16))


def _decode_layer_ops(t: dict) -> list[torch.Tensor]:
    """One decode layer's Triton ops: norm, q/k norm + rotary, KV store, paged decode attention in splits
    (and their merge), gated activation, the product of a few rows."""
    from pagoda_cuda.attention.decode import paged_decode
    from pagoda_cuda.ops.activation import silu_and_mul
    from pagoda_cuda.ops.kv_store import store_kv_cache
    from pagoda_cuda.ops.linear import skinny_linear
    from pagoda_cuda.ops.norm import fused_add_rms_norm
    from pagoda_cuda.ops.rotary import qk_norm_rotary

    normed, summed = fused_add_rms_norm(t["x"], t["res"], t["w"], 1e-6)
    q, k = qk_norm_rotary(t["positions"], t["q"], t["k"], t["wq"], t["wk"], 1e-6, 128, t["cache"], True)
    kv = t["kv"].clone()
    store_kv_cache(k.view(-1, 8, 128), t["v"], kv, t["slots"])
    out = t["out"].clone()
    paged_decode(q.view(-1, 16, 128), kv[0], kv[1], t["tables"], t["seq_lens"], out, 128 ** -0.5, num_splits=4)
    act = silu_and_mul(t["gate_up"])
    return [normed, summed, q, k, kv, out, act, skinny_linear(act, t["down"])]


@GPU
def test_the_decode_path_gives_the_same_results_with_pdl(monkeypatch):
    from pagoda_cuda import _triton

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    inputs = _decode_layer_inputs(0)
    monkeypatch.setattr(_triton, "PDL_REQUESTED", False)
    want = _decode_layer_ops(inputs)
    monkeypatch.setattr(_triton, "PDL_REQUESTED", True)
    monkeypatch.setattr(_triton, "_PDL", {})
    assert _triton.pdl(torch.device("cuda"))
    for got, ref in zip(_decode_layer_ops(inputs), want):  # eagerly
        assert torch.equal(got, ref)
    _decode_layer_ops(inputs)  # (compiled before the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # from a graph: the dependencies become programmatic edges
        captured = _decode_layer_ops(inputs)
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(captured, want):
        assert torch.equal(got, ref)
