"""The CPU platform's C ops (pagoda.kernels.cpu_ops) against the torch reference, and their fallbacks."""

import pytest
import torch
from pagoda.kernels import cpu_ops, native, reference

needs_native = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler (or not x86) on this machine")


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_norms_equal_the_reference(rows):
    torch.manual_seed(0)
    fused = torch.randn(rows, 3 * 576)
    x = fused[:, 576:1152]  # a strided view, as a slice of a fused projection's output
    w, residual = torch.randn(576), torch.randn(rows, 576)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    got, want = cpu_ops.fused_add_rms_norm(x.contiguous(), residual, w, 1e-6), \
        reference.fused_add_rms_norm(x.contiguous(), residual, w, 1e-6)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-6)


@needs_native
def test_silu_and_mul_equals_the_reference():
    x = torch.randn(3, 2 * 1536) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3])  # exp's far ends
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x), rtol=1e-5, atol=1e-6)
    wide = torch.randn(2, 2 * 64 + 10)[:, :128]  # a strided view
    torch.testing.assert_close(cpu_ops.silu_and_mul(wide), reference.silu_and_mul(wide), rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])  # full, and partial rotary (the rest of each head copied)
def test_rotary_equals_the_reference_exactly(neox, rot):
    torch.manual_seed(1)
    qkv = torch.randn(6, 9 * 64 + 3 * 64 + 3 * 64)
    q, k = qkv[:, :576], qkv[:, 576:768]  # views into the fused output, row stride 960
    cache = torch.randn(100, rot)
    positions = torch.tensor([0, 5, 99, 3, 3, 42])
    got, want = cpu_ops.rotary_embedding(positions, q, k, 64, cache, neox), \
        reference.rotary_embedding(positions, q, k, 64, cache, neox)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_native
def test_what_the_c_code_does_not_take_goes_to_the_reference():
    """bfloat16 rows and int32 positions take the reference; a position past the table raises as the
    reference does (never a read outside it)."""
    q, k = torch.randn(2, 128, dtype=torch.bfloat16), torch.randn(2, 64, dtype=torch.bfloat16)
    cache = torch.randn(10, 64)
    pos = torch.tensor([1, 2], dtype=torch.int32)
    got, want = cpu_ops.rotary_embedding(pos, q, k, 64, cache, True), reference.rotary_embedding(pos, q, k, 64,
                                                                                                  cache, True)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0])
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_ops.rms_norm(x, torch.ones(64), 1e-6), reference.rms_norm(x, torch.ones(64), 1e-6))
    with pytest.raises(IndexError):
        cpu_ops.rotary_embedding(torch.tensor([3, 10]), q.float(), k.float(), 64, cache, True)


def test_the_cpu_platform_selects_them_and_the_switch_turns_them_off(monkeypatch, tmp_path):
    from pagoda.kernels import describe_selection

    chosen = describe_selection("cpu")
    assert all(chosen[op].startswith("pagoda-core [cpu, priority 1]")
               for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache"))
    assert describe_selection("cuda")["rms_norm"] != chosen["rms_norm"]
    monkeypatch.setenv("PAGODA_CPU_NATIVE", "0")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load(cpu_ops.SOURCE) is None and not (tmp_path / "kernels").exists()
    finally:
        native.load.cache_clear()


@needs_native
def test_a_build_lands_in_the_cache_once_and_a_broken_compiler_is_reported(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load(cpu_ops.SOURCE) is not None
        built = list((tmp_path / "kernels").glob("cpu_ops-*.so"))
        assert len(built) == 1 and not list((tmp_path / "kernels").glob(".build-*"))
        native.load.cache_clear()
        mtime = built[0].stat().st_mtime_ns
        assert native.load(cpu_ops.SOURCE) is not None and built[0].stat().st_mtime_ns == mtime  # not rebuilt
        broken = tmp_path / "broken.c"
        broken.write_text("this is not C")
        with caplog.at_level("WARNING", logger="pagoda"):
            assert native.load(broken) is None
        assert "broken.c could not be built" in caplog.text
    finally:
        native.load.cache_clear()


@needs_native
def test_store_kv_cache_equals_the_reference():
    """Rows written to their slots (v a strided view, as out of a fused projection), padding slots (-1)
    skipped; a slot past the cache raises as the reference does."""
    torch.manual_seed(2)
    qkv = torch.randn(5, 4 * 16 + 2 * 16 + 2 * 16)
    k = qkv[:, 64:96].contiguous().view(5, 2, 16)
    v = qkv[:, 96:128].view(5, 2, 16)
    slots = torch.tensor([3, 17, -1, 0, 31])
    ours, theirs = torch.zeros(2, 4, 8, 2, 16), torch.zeros(2, 4, 8, 2, 16)
    cpu_ops.store_kv_cache(k, v, ours, slots)
    reference.store_kv_cache(k, v, theirs, slots)
    assert torch.equal(ours, theirs) and bool(ours.abs().sum() > 0)
    with pytest.raises(IndexError):
        cpu_ops.store_kv_cache(k, v, ours, torch.tensor([0, 1, 2, 3, 32]))
    half = torch.zeros(2, 4, 8, 2, 16, dtype=torch.bfloat16)  # another dtype: the reference
    cpu_ops.store_kv_cache(k, v, half, slots)
    assert torch.equal(half[0].view(-1, 2, 16)[17], k[1].bfloat16())


@needs_native
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_reads_the_paged_cache_as_the_softmax_says(window):
    """GQA (4 query heads on 2 kv heads), blocks out of order, lengths across block edges, strided q rows;
    the cache's other slots hold garbage (never read)."""
    torch.manual_seed(3)
    bs, d = 4, 16
    cache = torch.full((2, 10, bs, 2, d), float("nan"))
    tables = torch.tensor([[7, 2, 9, 0], [1, 0, 0, 0], [3, 4, 5, 6]])
    lens = torch.tensor([11, 1, 16])
    for b in range(3):
        for j in range(int(lens[b])):
            slot = tables[b, j // bs] * bs + j % bs
            cache[:, slot // bs, slot % bs] = torch.randn(2, 2, d)
    qkv = torch.randn(3, 4 * d + 64)
    q = qkv[:, :4 * d].view(3, 4, d)
    out = torch.empty(3, 4, d)
    cpu_ops.decode_attention(out, q, cache, tables, lens, window, 0.25)
    for b in range(3):
        n = int(lens[b])
        slots = [int(tables[b, j // bs]) * bs + j % bs for j in range(n)]
        keys = cache[0].view(-1, 2, d)[slots].repeat_interleave(2, dim=1)  # [n, 4, d]
        values = cache[1].view(-1, 2, d)[slots].repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], keys) * 0.25
        if window:
            scores[:, :max(0, n - window)] = float("-inf")
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-6)
