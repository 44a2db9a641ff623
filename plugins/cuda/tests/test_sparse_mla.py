"""DeepSeek sparse attention (DeepSeek-V3.2): the Triton indexer-logits and sparse-MLA kernels and
the ``triton_mla_sparse`` backend against the core's torch reference, on mixed batches over a
shuffled paged cache of [latent | k_pe | index_k] entries (interpreter on CPU, real shapes on GPU)."""

import time

import pytest
import torch
from pagoda.attention.torch_mla_sparse import TorchSparseMLAAttention, sparse_latent_attention
from pagoda.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from pagoda.interfaces import AttentionSpec
from pagoda.layers.sparse_mla import index_scores, select_topk

GPU = pytest.mark.gpu


class FakeSparseLayer:
    def __init__(self, heads, nope, rope, v, lora, index_dim, topk, device, dtype, gen):
        self.spec = AttentionSpec("mla_sparse", heads, 1, lora + rope + index_dim, (nope + rope) ** -0.5,
                                  kv_lora_rank=lora, qk_rope_head_dim=rope,
                                  extra={"qk_nope_head_dim": nope, "v_head_dim": v, "index_head_dim": index_dim,
                                         "index_topk": topk})
        w = (torch.randn(heads, nope + v, lora, generator=gen) / lora ** 0.5).to(device, dtype)
        self.weights = (w[:, :nope], w[:, nope:])
        self.kv_scales = None

    def absorbed_weights(self):
        return self.weights


def make_case(device, dtype, seqs, heads=4, nope=16, rope=16, v=16, lora=32, index_heads=8, index_dim=32, topk=12,
              block_size=8, seed=0, for_graph=False):
    gen = torch.Generator().manual_seed(seed)
    layer = FakeSparseLayer(heads, nope, rope, v, lora, index_dim, topk, device, dtype, gen)
    nblocks = [-(-(c + n) // block_size) for c, n in seqs]
    perm = torch.randperm(sum(nblocks) + 2, generator=gen).tolist()
    cache = torch.randn(sum(nblocks) + 2, block_size, lora + rope + index_dim, generator=gen).to(device, dtype)
    width, taken = max(nblocks) + (2 if for_graph else 0), 0
    tables, slots, starts, lens = [], [], [0], []
    for (ctx, new), nb in zip(seqs, nblocks):
        row = perm[taken:taken + nb]
        taken += nb
        tables.append(row + [0] * (width - nb))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
        starts.append(starts[-1] + new)
        lens.append(ctx + new)
    t = starts[-1]
    inputs = dict(q_nope=torch.randn(t, heads, nope, generator=gen), q_pe=torch.randn(t, heads, rope, generator=gen),
                  kv_c_normed=torch.randn(t, lora, generator=gen), k_pe=torch.randn(t, rope, generator=gen),
                  index_q=torch.randn(t, index_heads, index_dim, generator=gen),
                  index_k=torch.randn(t, index_dim, generator=gen))
    inputs = {k: x.to(device, dtype) for k, x in inputs.items()}
    inputs["index_weights"] = torch.randn(t, index_heads, generator=gen).to(device)
    meta = AttentionMetadata(
        num_tokens=t, num_seqs=len(seqs), num_decodes=next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs)),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens), block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, device=device), query_start_loc_cpu=starts, seq_lens_cpu=lens,
        for_graph=for_graph)
    return layer, inputs, cache, meta


def run_both(device, dtype, seqs, **kw):
    from pagoda_cuda.attention.sparse_mla_backend import TritonSparseMLAAttention

    layer, inputs, cache, meta = make_case(device, dtype, seqs, **kw)
    ours_cache, ref_cache = cache.clone(), cache.clone()
    backend = TritonSparseMLAAttention()
    meta.backend_data = backend.prepare(meta)
    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        ours = backend.forward_sparse_mla(layer, **inputs, kv_cache=ours_cache, meta=meta)
        meta.backend_data = None
        want = TorchSparseMLAAttention().forward_sparse_mla(layer, **inputs, kv_cache=ref_cache, meta=meta)
    assert torch.equal(ours_cache, ref_cache)
    return ours, want


MIXED = [(5, 1), (30, 1), (40, 1), (0, 11), (9, 14)]  # top-12: some queries see fewer tokens, some more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_reference(device, dtype):
    ours, want = run_both(device, dtype, MIXED, seed=1)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.float(), want.float(), atol=tol, rtol=tol)


def test_decode_batch_as_graphs_see_it(device):
    """Decodes only, with the graphs' static-width logits: each token is its sequence's row and
    sits at seq_len - 1 (both computed on the device)."""
    ours, want = run_both(device, torch.float32, [(20, 1), (3, 1), (47, 1)], seed=2, for_graph=True)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_index_logits_kernel(device):
    from pagoda_cuda.attention.sparse_mla import index_logits

    layer, inputs, cache, meta = make_case(device, torch.float32, MIXED, seed=3)
    lora_rope = layer.spec.kv_lora_rank + layer.spec.qk_rope_head_dim
    seq_of, positions = [], []
    for i, (s, e) in enumerate(zip(meta.query_start_loc_cpu, meta.query_start_loc_cpu[1:])):
        seq_of += [i] * (e - s)
        positions += list(range(meta.seq_lens_cpu[i] - (e - s), meta.seq_lens_cpu[i]))
    seq_t = torch.tensor(seq_of, dtype=torch.int32, device=device)
    pos_t = torch.tensor(positions, dtype=torch.int32, device=device)
    got = index_logits(inputs["index_q"], inputs["index_weights"], cache, meta.block_tables, seq_t, pos_t,
                       meta.max_seq_len, lora_rope, block_n=16)
    bs = meta.block_size
    for tok, (seq, pos) in enumerate(zip(seq_of, positions)):
        keys = torch.stack([cache[meta.block_tables[seq, p // bs], p % bs, lora_rope:] for p in range(pos + 1)])
        want = index_scores(inputs["index_q"][tok:tok + 1], keys, inputs["index_weights"][tok:tok + 1])[0]
        torch.testing.assert_close(got[tok, :pos + 1], want, atol=1e-4, rtol=1e-4)
        assert torch.isinf(got[tok, pos + 1:]).all()


def test_sparse_attention_kernel_given_a_selection(device):
    """The attention kernel alone, on a selection with gaps (-1) in the middle and at the end."""
    from pagoda_cuda.attention.sparse_mla import sparse_mla

    layer, inputs, cache, meta = make_case(device, torch.float32, [(33, 1), (0, 9)], seed=4)
    lora, rope = layer.spec.kv_lora_rank, layer.spec.qk_rope_head_dim
    gen = torch.Generator().manual_seed(5)
    chosen = torch.full((10, 20), -1, dtype=torch.long)
    chosen[0] = torch.randperm(34, generator=gen)[:20]  # the decode at position 33
    chosen[0, 3] = -1
    for tok in range(1, 10):  # the chunk's token at position tok - 1 sees tok tokens
        chosen[tok, :tok] = torch.randperm(tok, generator=gen)
    chosen = chosen.to(device)
    seq_of = torch.tensor([0] + [1] * 9, dtype=torch.int32, device=device)
    q_lat = torch.randn(10, 4, lora, generator=gen).to(device)
    out = torch.empty_like(q_lat)
    sparse_mla(q_lat, inputs["q_pe"], cache, meta.block_tables, seq_of, chosen, out, 0.2)
    bs = meta.block_size
    for tok in range(10):
        seq = int(seq_of[tok])
        length = 34 if seq == 0 else 9
        rows = torch.stack([cache[meta.block_tables[seq, p // bs], p % bs] for p in range(length)])
        want, _ = sparse_latent_attention(q_lat[tok:tok + 1], inputs["q_pe"][tok:tok + 1], rows[:, :lora],
                                          rows[:, lora:lora + rope], chosen[tok:tok + 1], 0.2)
        torch.testing.assert_close(out[tok:tok + 1], want, atol=1e-4, rtol=1e-4)


def test_selection_is_the_reference_top_k():
    scores = torch.tensor([[3.0, 1.0, 2.0, 9.0], [0.5, 4.0, 1.0, 7.0]])
    assert select_topk(scores, torch.tensor([2, 3]), 2).tolist() == [[0, 2], [3, 1]]
    assert select_topk(scores, torch.tensor([0, 3]), 3).tolist()[0] == [0, -1, -1]  # one visible key


# ----------------------------------------------------------------------------- real shapes (GPU)
@GPU
def test_real_shape_against_reference(device):
    """DeepSeek-V3.2's shape: 128 heads, latent 512 + 64, index key 128 of 64 heads, top-2048."""
    seqs = [(3000 + 37 * i, 1) for i in range(16)] + [(0, 700), (2500, 300)]
    ours, want = run_both(device, torch.bfloat16, seqs, heads=128, nope=128, rope=64, v=128, lora=512,
                          index_heads=64, index_dim=128, topk=2048, block_size=64)
    torch.testing.assert_close(ours.float(), want.float(), atol=3e-2, rtol=3e-2)


@GPU
@pytest.mark.parametrize("batch,context", [(64, 4096), (256, 4096), (32, 16384)])
def test_real_shape_decode_timing(device, batch, context):
    """Times one decode layer (indexer logits, top-2048, sparse MLA) at DeepSeek-V3.2's shape and
    prints it (the GPU check collects these lines)."""
    from pagoda_cuda.attention.sparse_mla_backend import TritonSparseMLAAttention

    layer, inputs, cache, meta = make_case(device, torch.bfloat16, [(context - 1, 1)] * batch, heads=128, nope=128,
                                           rope=64, v=128, lora=512, index_heads=64, index_dim=128, topk=2048,
                                           block_size=64)
    backend = TritonSparseMLAAttention()
    meta.backend_data = backend.prepare(meta)

    def step():
        return backend.forward_sparse_mla(layer, **inputs, kv_cache=cache, meta=meta)

    with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / 10 * 1e6
    print(f"sparse MLA decode layer, batch {batch}, context {context}, top-2048: {us:.0f} us")
    assert us > 0
