"""The triton paged-attention backend against the core's torch reference backend, on mixed
prefill + decode batches over a shuffled paged cache."""

from dataclasses import dataclass

import pytest
import torch
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from pagoda.interfaces import AttentionSpec

GPU = pytest.mark.gpu


@dataclass
class FakeLayer:
    spec: AttentionSpec
    kv_scales: dict | None = None
    sinks: torch.Tensor | None = None


def make_batch(device, dtype, seqs, nq, nk, hs, block_size, seed=0, pad_to=None):
    """seqs: [(cached tokens, new tokens)], decodes (new == 1) first. Returns q, k, v, the
    cache (context already filled) and the metadata; pad_to adds graph padding rows."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.randn(2, num_blocks, block_size, nk, hs, generator=gen).to(device, dtype)
    width = max(blocks_per_seq)
    tables, slots, starts, lens = [], [], [0], []
    taken = 0
    for (ctx, new), nb in zip(seqs, blocks_per_seq):
        row = perm[taken:taken + nb]
        taken += nb
        tables.append(row + [0] * (width - nb))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
        starts.append(starts[-1] + new)
        lens.append(ctx + new)
    num_decodes = next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs))
    for_graph = pad_to is not None
    if for_graph:  # padding rows: seq_len 1, slot -1, table row of zeros
        extra = pad_to - len(seqs)
        tables += [[0] * width] * extra
        slots += [-1] * extra
        starts += [starts[-1] + i + 1 for i in range(extra)]
        lens += [1] * extra
        num_decodes = pad_to
    t = starts[-1]
    q = torch.randn(t, nq * hs, generator=gen).to(device, dtype)
    kv = torch.randn(t, 2 * nk * hs, generator=gen).to(device, dtype)
    k, v = kv[:, :nk * hs], kv[:, nk * hs:]  # strided views, as a fused projection gives
    meta = AttentionMetadata(
        num_tokens=t, num_seqs=len(lens), num_decodes=num_decodes, max_query_len=max(n for _, n in seqs),
        max_seq_len=max(lens), block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=starts, seq_lens_cpu=lens, for_graph=for_graph)
    return q, k, v, cache, meta


def run_both(q, k, v, cache, meta, spec, rows=None, kv_scales=None, sinks=None):
    from pagoda_cuda.attention.backend import TritonPagedAttention

    layer = FakeLayer(spec, kv_scales, sinks)
    backend = TritonPagedAttention()
    # the backend keeps head-major pages: [2, blocks, nk, block, hs] in memory
    stored = cache.transpose(2, 3).contiguous()
    assert stored.shape == backend.kv_cache_shape(spec, cache.shape[1], cache.shape[2])
    ours_cache, ref_cache = stored.transpose(2, 3), cache.clone()
    meta.backend_data = backend.prepare(meta)
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        ours = backend.forward(layer, q, k, v, stored, meta)
        meta.backend_data = None
        want = TorchPagedAttention().forward(layer, q, k, v, ref_cache, meta)
    rows = slice(None) if rows is None else rows
    return ours[rows], want[rows], ours_cache, ref_cache


def check(device, dtype, seqs, nq, nk, hs, block_size, window=None, cap=None, pad_to=None, seed=0, sinks=False):
    q, k, v, cache, meta = make_batch(device, dtype, seqs, nq, nk, hs, block_size, seed, pad_to)
    spec = AttentionSpec("mha", nq, nk, hs, hs ** -0.5, sliding_window=window, logits_soft_cap=cap, sinks=sinks)
    sink_logits = (2 * torch.randn(nq, generator=torch.Generator().manual_seed(seed))).to(device) if sinks else None
    real = sum(n for _, n in seqs)
    ours, want, ours_cache, ref_cache = run_both(q, k, v, cache, meta, spec, rows=slice(0, real), sinks=sink_logits)
    assert torch.equal(ours_cache, ref_cache)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), want.float(), atol=tol, rtol=tol)


MIXED = [(5, 1), (17, 1), (40, 1), (0, 13), (9, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_gqa(device, dtype):
    check(device, dtype, MIXED, 4, 2, 32, 8)


def test_head_size_96_no_gqa_and_odd_block(device):
    check(device, torch.float32, [(30, 1), (3, 7)], 2, 2, 96, 16)


def test_sliding_window_and_soft_cap(device):
    check(device, torch.float32, MIXED, 4, 1, 16, 8, window=11, cap=5.0)


@pytest.mark.parametrize("window", [None, 11])
def test_attention_sinks(device, window):
    """GPT-OSS's per-head sink logits in the denominator: decodes, prefill chunks, a window."""
    check(device, torch.float32, MIXED, 4, 2, 16, 8, window=window, sinks=True)


def test_attention_sinks_with_decode_splits(device):
    """The sink joins the merge of the split decode, not each split."""
    from pagoda_cuda.attention.decode import paged_decode

    q, k, v, cache, meta = make_batch(device, torch.float32, [(150, 1), (1, 1), (64, 1)], 4, 2, 32, 8, seed=3)
    spec = AttentionSpec("mha", 4, 2, 32, 32 ** -0.5, sinks=True)
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0], device=device)
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        want = TorchPagedAttention().forward(FakeLayer(spec, sinks=sinks), q, k, v, cache, meta)  # stores k, v
    for splits in (1, 4):
        out = torch.empty(3, 4, 32, device=device)
        paged_decode(q.view(3, 4, 32), cache[0], cache[1], meta.block_tables, meta.seq_lens, out, 32 ** -0.5,
                     splits, sinks=sinks)
        torch.testing.assert_close(out.view(3, -1), want, atol=1e-5, rtol=1e-5)


def test_prefill_never_reads_keys_outside_every_window(device):
    """Blocks that left every window may be freed and reused: non-finite values in them must
    not reach the output (the reference gathers from the window's first block only)."""
    seqs = [(40, 1), (37, 12)]
    q, k, v, cache, meta = make_batch(device, torch.float32, seqs, 4, 2, 16, 8, seed=4)
    for i, (ctx, _) in enumerate(seqs):  # poison every block before the first one in a window
        first = max(0, ctx - 9 + 1) // 8
        for b in meta.block_tables[i, :first].tolist():
            cache[:, b] = float("nan")
    spec = AttentionSpec("mha", 4, 2, 16, 0.25, sliding_window=9)
    ours, want, _, _ = run_both(q, k, v, cache, meta, spec)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_graph_metadata_with_padding_rows(device):
    check(device, torch.float32, [(20, 1), (3, 1), (70, 1)], 8, 2, 32, 8, pad_to=8)


@pytest.mark.parametrize("config", [(16, 16, 4, 2), (16, 32, 4, 2), (32, 16, 4, 2)])
@pytest.mark.parametrize("window, cap", [(None, None), (19, None), (55, 5.0)])
def test_prefill_key_phase_boundaries(device, config, window, cap):
    """Small tiles so that the boundary between unmasked and masked key tiles falls everywhere:
    several query tiles per sequence, cached prefixes that are and are not multiples of BLOCK_N,
    lengths that are not multiples of the tiles; head 24 (padded to 32), GQA."""
    from pagoda_cuda.attention.prefill import build_tile_map, paged_prefill

    nq, nk, hs = 4, 2, 24
    seqs = [(0, 37), (16, 40), (21, 35), (30, 18), (46, 20), (64, 17)]
    q, k, v, cache, meta = make_batch(device, torch.float32, seqs, nq, nk, hs, 8, seed=5)
    spec = AttentionSpec("mha", nq, nk, hs, hs ** -0.5, sliding_window=window, logits_soft_cap=cap)
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        want = TorchPagedAttention().forward(FakeLayer(spec), q, k, v, cache, meta)  # stores k, v too
    tiles = torch.from_numpy(build_tile_map(meta.query_start_loc_cpu, 0, config[0])).to(device)
    out = torch.empty(q.shape[0], nq, hs, device=device)
    paged_prefill(q.view(-1, nq, hs), cache[0], cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                  tiles, out, spec.scale, window, cap, config=config)
    torch.testing.assert_close(out.view(q.shape[0], -1), want, atol=1e-4, rtol=1e-4)


def test_prefill_reads_split_queries_and_keys(device):
    """q_rope / k_rope: queries [q | q_rope] and keys [k | k_rope] read from two tensors each (the
    rotary key part shared by the KV heads) give what the concatenated tensors give."""
    from pagoda_cuda.attention.prefill import build_tile_map, paged_prefill

    nq, nk, hs, rope = 4, 2, 24, 8
    seqs = [(0, 37), (21, 35), (46, 20)]
    q, k, v, cache, meta = make_batch(device, torch.float32, seqs, nq, nk, hs, 8, seed=6)
    gen = torch.Generator().manual_seed(6)
    t = q.shape[0]
    q3 = q.view(t, nq, hs)
    q_rope = torch.randn(t, nq, rope, generator=gen).to(device)
    k_rope = torch.randn(cache.shape[1], cache.shape[2], rope, generator=gen).to(device)  # [blocks, block, R]
    keys = torch.cat((cache[0], k_rope.unsqueeze(2).expand(-1, -1, nk, -1)), dim=-1)
    tiles = torch.from_numpy(build_tile_map(meta.query_start_loc_cpu, 0, 64)).to(device)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles)
    want = torch.empty(t, nq, hs, device=device)
    paged_prefill(torch.cat((q3, q_rope), dim=-1), keys, cache[1], *args, want, 0.2)
    got = torch.empty_like(want)
    paged_prefill(q3, cache[0], cache[1], *args, got, 0.2, q_rope=q_rope, k_rope=k_rope)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_decode_splits_match_single_pass(device):
    from pagoda_cuda.attention.decode import paged_decode

    q, k, v, cache, meta = make_batch(device, torch.float32, [(150, 1), (1, 1), (64, 1)], 4, 2, 32, 8, seed=3)
    from pagoda_cuda.ops.kv_store import store_kv_cache

    store_kv_cache(k.view(-1, 2, 32), v.view(-1, 2, 32), cache, meta.slot_mapping)
    outs = []
    # one pass and four splits, programs in sequence-major and in heads-adjacent order
    for splits, adjacent in ((1, False), (4, False), (1, True), (4, True)):
        out = torch.empty(3, 4, 32, device=device)
        paged_decode(q.view(3, 4, 32), cache[0], cache[1], meta.block_tables, meta.seq_lens, out, 32 ** -0.5,
                     splits, config=(16, 4, 2, adjacent))
        outs.append(out)
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=1e-5, rtol=1e-5)


def test_backend_selection_rules():
    from pagoda_cuda.attention.backend import TritonPagedAttention

    backend = TritonPagedAttention()
    spec = AttentionSpec("mha", 16, 8, 128, 0.1)
    assert backend.supports("cuda", "bfloat16", spec) is None
    assert not backend.auto_selectable("cpu")
    assert "head sizes" in backend.supports("cuda", "bfloat16", AttentionSpec("mha", 4, 4, 512, 0.1))
    assert "mla" in backend.supports("cuda", "bfloat16", AttentionSpec("mla", 4, 1, 64, 0.1))


# ----------------------------------------------------------------------------- real shapes (GPU)
@GPU
@pytest.mark.parametrize("shape", [(16, 8, 128), (32, 32, 96), (32, 4, 128), (8, 8, 256), (8, 1, 64)])
def test_real_shapes_mixed(device, shape):
    nq, nk, hs = shape
    seqs = [(600 + 13 * i, 1) for i in range(64)] + [(0, 512), (700, 300), (31, 97)]
    check(device, torch.bfloat16, seqs, nq, nk, hs, 16)


@GPU
@pytest.mark.parametrize("window", [None, 128])
def test_real_shapes_gpt_oss_sinks(device, window):
    """gpt-oss-20b's attention: 64 query heads over 8 KV heads of 64, sinks, window 128 or global."""
    seqs = [(600 + 13 * i, 1) for i in range(64)] + [(0, 512), (700, 300)]
    check(device, torch.bfloat16, seqs, 64, 8, 64, 16, window=window, sinks=True)


@GPU
def test_real_shapes_gemma3_window(device):
    """Gemma 3 1B's window layers: 4 query heads over one KV head of 256, window 512."""
    seqs = [(900 + 7 * i, 1) for i in range(64)] + [(0, 700), (1200, 300)]
    check(device, torch.bfloat16, seqs, 4, 1, 256, 16, window=512)


@GPU
def test_real_shapes_long_context_splits(device):
    check(device, torch.bfloat16, [(9000, 1), (4100, 1), (17, 1)], 16, 8, 128, 16)


@GPU
def test_real_shapes_graph_batch(device):
    check(device, torch.bfloat16, [(700, 1)] * 200, 16, 8, 128, 16, pad_to=256)


@GPU
def test_fp8_cache_with_scales(device):
    """An fp8 cache holds k / k_scale (per-layer scales): stored and read back as the torch
    backend does (GPU only: the interpreter's fp8 conversions are not exact)."""
    q, k, v, cache, meta = make_batch(device, torch.bfloat16, MIXED, 4, 2, 32, 8)
    scales = {"k_scale": torch.tensor(0.05, device=device), "v_scale": torch.tensor(0.02, device=device)}
    ours, want, ours_cache, ref_cache = run_both(q, k, v, cache.to(torch.float8_e4m3fn), meta,
                                                 AttentionSpec("mha", 4, 2, 32, 32 ** -0.5), kv_scales=scales)
    assert torch.equal(ours_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(ours.float(), want.float(), atol=3e-2, rtol=3e-2)
