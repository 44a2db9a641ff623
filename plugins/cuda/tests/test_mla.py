"""The triton_mla backend against the core's torch_mla reference on mixed batches."""

import pytest
import torch
from pagoda.attention.torch_mla import TorchMLAAttention
from pagoda.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from pagoda.interfaces import AttentionSpec

GPU = pytest.mark.gpu


class FakeMLALayer:
    def __init__(self, heads, nope, rope, v, lora, device, dtype, gen, kv_scale=None):
        self.spec = AttentionSpec("mla", heads, 1, lora + rope, (nope + rope) ** -0.5, kv_lora_rank=lora,
                                  qk_rope_head_dim=rope, extra={"qk_nope_head_dim": nope, "v_head_dim": v})
        w = torch.randn(heads, nope + v, lora, generator=gen) / lora ** 0.5
        w = w.to(device, dtype)
        self.weight = w.view(heads * (nope + v), lora)
        self.weights = (w[:, :nope], w[:, nope:])
        self.kv_scales = None if kv_scale is None else {"k_scale": torch.tensor(kv_scale, device=device),
                                                        "v_scale": torch.tensor(1.0, device=device)}

    def absorbed_weights(self):
        return self.weights

    def kv_b_weight(self):
        return self.weight


def run_case(device, dtype, seqs, heads=4, nope=16, rope=16, v=16, lora=32, block_size=8, splits=None, seed=0,
             kv_scale=None):
    """``kv_scale``: an fp8 cache holding entry / kv_scale; the new tokens' values are then fp8
    values times the (power of two) scale, so that storing them is exact even where the
    interpreter's fp32 -> fp8 casts round wrongly."""
    from pagoda_cuda.attention.mla_backend import MLAStepData, TritonMLAAttention

    gen = torch.Generator().manual_seed(seed)
    layer = FakeMLALayer(heads, nope, rope, v, lora, device, dtype, gen, kv_scale)
    nblocks = [-(-(c + n) // block_size) for c, n in seqs]
    perm = torch.randperm(sum(nblocks) + 2, generator=gen).tolist()
    cache = torch.randn(sum(nblocks) + 2, block_size, lora + rope, generator=gen).to(device, dtype)
    width, taken = max(nblocks), 0
    tables, slots, starts, lens = [], [], [0], []
    for (ctx, new), nb in zip(seqs, nblocks):
        row = perm[taken:taken + nb]
        taken += nb
        tables.append(row + [0] * (width - nb))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
        starts.append(starts[-1] + new)
        lens.append(ctx + new)
    t = starts[-1]
    q_nope = torch.randn(t, heads, nope, generator=gen).to(device, dtype)
    q_pe = torch.randn(t, heads, rope, generator=gen).to(device, dtype)
    kv_c = torch.randn(t, lora, generator=gen).to(device, dtype)
    k_pe = torch.randn(t, rope, generator=gen).to(device, dtype)
    if kv_scale is not None:
        cache = cache.to(torch.float8_e4m3fn)
        kv_c, k_pe = ((x.to(torch.float8_e4m3fn).float() * kv_scale).to(dtype) for x in (kv_c, k_pe))
    meta = AttentionMetadata(
        num_tokens=t, num_seqs=len(seqs), num_decodes=next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs)),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens), block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, device=device), query_start_loc_cpu=starts, seq_lens_cpu=lens)
    ours_cache, ref_cache = cache.clone(), cache.clone()
    backend = TritonMLAAttention()
    data = MLAStepData()
    if splits:
        data.num_splits[heads] = splits
    meta.backend_data = data
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        ours = backend.forward_mla(layer, q_nope, q_pe, kv_c, k_pe, ours_cache, meta)
        meta.backend_data = None
        want = TorchMLAAttention().forward_mla(layer, q_nope, q_pe, kv_c, k_pe, ref_cache, meta)
    assert torch.equal(ours_cache.view(torch.uint8), ref_cache.view(torch.uint8)) if kv_scale is not None \
        else torch.equal(ours_cache, ref_cache)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_mixed_batch(device, dtype):
    run_case(device, dtype, [(5, 1), (30, 1), (0, 11), (9, 14)])


def test_mla_decode_splits(device):
    run_case(device, torch.float32, [(70, 1), (3, 1)], heads=20, splits=4, seed=1)  # 2 head blocks


@pytest.mark.parametrize("config", [(32, 16, 4, 2), (64, 32, 8, 2)])
def test_mla_decode_head_blocks(device, config, monkeypatch):
    """Wider head blocks (the tiles ``kernel_bench`` sweeps): 40 heads in a full and a partial
    block of 32 or one partial block of 64, with and without context splits."""
    import pagoda_cuda.attention.mla_decode as mla

    monkeypatch.setattr(mla, "mla_config", lambda lora: config)
    run_case(device, torch.float32, [(70, 1), (3, 1), (40, 1)], heads=40, seed=2)
    run_case(device, torch.float32, [(70, 1), (3, 1)], heads=40, splits=3, seed=3)


def test_mla_prefill_wide_keys(device):
    """Keys over 128 wide with values up to 128 (DeepSeek's 192 and 128) take MLA's 64 x 64 tiles
    of ``prefill_config``; a chunk of 70 new tokens spans one query tile and a part of a second."""
    from pagoda_cuda.attention.prefill import prefill_config

    assert prefill_config(120 + 16, 64)[:2] == (64, 64)
    run_case(device, torch.float32, [(5, 1), (0, 70), (9, 30)], heads=2, nope=120, rope=16, v=64, lora=32)


def test_mla_fp8_cache_with_scale(device):
    """Stored as entry / k_scale, read back times it by the decode kernel and the prefill expansion."""
    run_case(device, torch.float32, [(5, 1), (30, 1), (0, 11), (9, 14)], kv_scale=0.25)


@GPU
def test_mla_real_shapes(device):
    seqs = [(600 + 7 * i, 1) for i in range(32)] + [(0, 300), (200, 100)]
    run_case(device, torch.bfloat16, seqs, heads=128, nope=128, rope=64, v=128, lora=512, block_size=16)
    run_case(device, torch.bfloat16, [(5000, 1), (9, 1)], heads=128, nope=128, rope=64, v=128, lora=512,
             block_size=16)


def test_prefill_index_lands_on_the_step_device():
    """The per-step prefill index is built on the host and uploaded to the device the step
    runs on (the meta device stands in for a GPU here)."""
    from types import SimpleNamespace

    from pagoda_cuda.attention.mla_backend import MLAStepData, TritonMLAAttention

    meta = SimpleNamespace(num_decodes=1, seq_lens_cpu=[5, 9, 4], query_start_loc_cpu=[0, 1, 4, 8])
    index = TritonMLAAttention()._prefill_index(meta, MLAStepData(), torch.device("meta"))
    tensors = {k: v for k, v in index.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == {"seq_of", "pos", "tables", "seq_lens", "qsl"}
    assert {t.device.type for t in tensors.values()} == {"meta"}
    assert index["total"] == 13 and tensors["tables"].dtype == torch.int32
