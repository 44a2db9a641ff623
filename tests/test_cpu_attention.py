"""The CPU attention backend (scaled_dot_product_attention) against the reference backend."""

import pytest
import torch
from pagoda.attention.cpu_sdpa import CpuSdpaAttention
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from pagoda.interfaces import AttentionSpec


class _Layer:
    def __init__(self, spec):
        self.spec, self.kv_scales = spec, None


def _batch(seqs, block_size, num_blocks, scatter, nk, hs, gen, fill=float("nan")):
    """seqs: (context, new tokens) per sequence, decodes (new == 1, context > 0) first. Blocks of each
    sequence are consecutive unless ``scatter``. Returns metadata and a cache holding the contexts,
    ``fill`` in every slot never written (an unzeroed CPU cache holds whatever the memory held before:
    NaN, inf, or a finite value so large that a score overflows)."""
    cache = torch.full((2, num_blocks, block_size, nk, hs), fill)
    perm = torch.randperm(num_blocks, generator=gen).tolist() if scatter else list(range(num_blocks))
    tables, slots, qsl, lens, nxt = [], [], [0], [], 0
    for ctx, new in seqs:
        length = ctx + new
        nb = -(-length // block_size)
        tables.append(perm[nxt:nxt + nb])
        nxt += nb
        for p in range(ctx):
            cache[:, tables[-1][p // block_size], p % block_size] = torch.randn(2, nk, hs, generator=gen)
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(ctx, length)]
        qsl.append(qsl[-1] + new)
        lens.append(length)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    num_decodes = sum(1 for ctx, new in seqs if new == 1 and ctx > 0)
    meta = AttentionMetadata(
        num_tokens=qsl[-1], num_seqs=len(seqs), num_decodes=num_decodes, max_query_len=max(n for _, n in seqs),
        max_seq_len=max(lens), block_size=block_size, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=bt, slot_mapping=torch.tensor(slots),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    return meta, cache


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), 3e38])
@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("seqs", [
    [(37, 1)],  # one decode
    [(37, 1), (5, 1), (80, 1)],  # batched decodes of different lengths
    [(0, 70)],  # a prompt in one chunk
    [(40, 1), (0, 33), (48, 21)],  # a decode, a fresh prompt, a chunk after a cached prefix
])
def test_cpu_sdpa_equals_the_reference(seqs, window, scatter, fill):
    gen = torch.Generator().manual_seed(0)
    nq, nk, hs, bs = 6, 2, 16, 8
    spec = AttentionSpec(kind="mha", num_heads=nq, num_kv_heads=nk, head_size=hs, scale=hs ** -0.5,
                         sliding_window=window)
    meta, cache = _batch(seqs, bs, 64, scatter, nk, hs, gen, fill)
    t = meta.num_tokens
    q = torch.randn(t, nq * hs, generator=gen)
    k = torch.randn(t, nk * hs, generator=gen)
    v = torch.randn(t, nk * hs, generator=gen)
    layer = _Layer(spec)
    ref_cache, cache2 = cache.clone(), cache.clone()
    backend = CpuSdpaAttention()
    with set_forward_context(ForwardContext(meta, {"mha": backend})):
        want = TorchPagedAttention().forward(layer, q, k, v, ref_cache, meta)
        meta.backend_data = backend.prepare(meta)
        got = backend.forward(layer, q, k, v, cache2, meta)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cache2, ref_cache, equal_nan=True)  # the new keys and values were stored


def test_long_prompt_prefill_equals_the_reference_attention():
    """A 1,500-token prompt in one chunk and the same prompt's last 300 tokens after a cached prefix."""
    gen = torch.Generator().manual_seed(1)
    nq, nk, hs, bs = 4, 2, 32, 16
    spec = AttentionSpec(kind="mha", num_heads=nq, num_kv_heads=nk, head_size=hs, scale=hs ** -0.5)
    for seqs in ([(0, 1500)], [(1200, 300)]):
        meta, cache = _batch(seqs, bs, 100, False, nk, hs, gen)
        t = meta.num_tokens
        q, k, v = (torch.randn(t, n * hs, generator=gen) for n in (nq, nk, nk))
        backend = CpuSdpaAttention()
        c1, c2 = cache.clone(), cache.clone()
        with set_forward_context(ForwardContext(meta, {"mha": backend})):
            want = TorchPagedAttention().forward(_Layer(spec), q, k, v, c1, meta)
            meta.backend_data = backend.prepare(meta)
            got = backend.forward(_Layer(spec), q, k, v, c2, meta)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_cpu_sdpa_is_chosen_on_the_cpu():
    from pagoda.plugins import get_registry
    from pagoda.selection import select_attention_backend

    cpu = get_registry().platforms.get("cpu")
    spec = AttentionSpec(kind="mha", num_heads=4, num_kv_heads=2, head_size=16, scale=0.25)
    assert select_attention_backend("auto", cpu, "float32", spec).name == "cpu_sdpa"
    assert select_attention_backend("torch", cpu, "float32", spec).name == "torch"


def test_generation_does_not_depend_on_what_the_cache_memory_held(tmp_path):
    """The CPU cache is not zeroed, so in a long-lived process it starts with whatever the memory held
    (it once made CI flaky: a huge finite key in a padding slot overflowed a score to inf, and the mask
    turned it into NaN). Greedy outputs of batched decodes of different lengths stay the same when every
    cache slot starts as NaN, inf or 3e38."""
    from pagoda import LLM, SamplingParams
    from pagoda.testing import make_tiny_checkpoint, random_prompts

    path = make_tiny_checkpoint("llama", tmp_path, seed=3, vocab_size=260, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=256)
    prompts = random_prompts(3, 260, 6, 20, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
              enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    for fill in (float("nan"), float("inf"), 3e38):
        for cache in llm.engine.runner.kv_caches:
            cache.fill_(fill)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want, fill
