"""pagoda-cuda's ``linear`` op: the Triton kernel for a few rows against torch's linear (interpreter on CPU, real
decode shapes in bf16 on a GPU), and which sizes it takes."""

import pytest
import torch

GPU = pytest.mark.gpu


@pytest.mark.parametrize("rows,k,n,bias", [(1, 100, 37, False), (5, 256, 64, True), (16, 300, 70, True),
                                           (3, 40, 1000, False)])
def test_skinny_linear_matches_torch(device, rows, k, n, bias):
    from pagoda_cuda.ops.linear import skinny_linear

    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=gen).to(device)
    w = torch.randn(n, k, generator=gen).to(device)
    b = torch.randn(n, generator=gen).to(device) if bias else None
    torch.testing.assert_close(skinny_linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [12, 64, 100, 1030])
def test_skinny_linear_with_its_weights_prefetched_matches_torch(device, k):
    # the leading columns loaded before the wait (programmatic dependent launch): fewer than, as many as, and
    # more than K
    from pagoda_cuda.ops.linear import prefetch_columns, skinny_linear

    gen = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(3, k, generator=gen), torch.randn(40, k, generator=gen), torch.randn(40, generator=gen)
    assert prefetch_columns(16, k) == min(1024, max(16, 1 << (k.bit_length() - 1)))
    got = skinny_linear(x.to(device), w.to(device), b.to(device), config=(16, 32, 4, 2), prefetch=True)
    torch.testing.assert_close(got.cpu(), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_skinny_linear_takes_a_batch_view_and_keeps_leading_dims(device):
    from pagoda_cuda.ops.linear import skinny_linear

    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(2, 3, 96, generator=gen).to(device)
    x = fused[..., 32:96]  # rows 96 apart, as a slice of a fused projection's output
    w = torch.randn(24, 64, generator=gen).to(device)
    got = skinny_linear(x, w)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4)


def test_skinny_linear_refuses_more_rows_than_one_tile(device):
    from pagoda_cuda.ops.linear import skinny_linear
    from pagoda_cuda.switches import MAX_SKINNY_ROWS

    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_linear(torch.zeros(MAX_SKINNY_ROWS + 1, 8, device=device), torch.zeros(4, 8, device=device))


def test_the_op_takes_the_kernel_up_to_the_configured_rows(device, monkeypatch):
    from pagoda_cuda.ops import linear as mod

    calls = []
    monkeypatch.setattr(mod, "skinny_linear", lambda x, w, b=None: calls.append(x.shape[0]) or torch.zeros(1))
    x8, x9, w = torch.zeros(8, 16, device=device), torch.zeros(9, 16, device=device), torch.zeros(4, 16, device=device)
    monkeypatch.setattr(mod, "SKINNY_ROWS", 0)  # off: torch's linear at every size
    mod.linear(x8, w)
    monkeypatch.setattr(mod, "SKINNY_ROWS", 8)
    mod.linear(x8, w)
    assert mod.linear(x9, w).shape == (9, 4)  # above the setting: torch's
    assert calls == [8]
    monkeypatch.setattr(mod, "SKINNY_MAX_WEIGHT_BYTES", w.numel() * w.element_size() - 1)
    mod.linear(x8, w)  # a weight above the bound: torch's (cuBLAS streamed large weights faster)
    assert calls == [8]


@pytest.mark.parametrize("pdl,rows,want", [(None, None, 16), ("0", None, 0), ("0", "4", 4), (None, "0", 0)])
def test_the_default_rows_follow_programmatic_dependent_launch(monkeypatch, pdl, rows, want):
    # measured together: the product of a few rows gains with PDL, and without it was no faster at batch 8
    from pagoda_cuda import switches

    for var, value in (("PAGODA_CUDA_PDL", pdl), ("PAGODA_CUDA_SKINNY_ROWS", rows)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert switches.skinny_rows() == want


@pytest.mark.parametrize("raw", ["17", "-1", "many"])
def test_a_bad_row_setting_names_the_variable(monkeypatch, raw):
    from pagoda.errors import ConfigError
    from pagoda_cuda import switches

    monkeypatch.setenv("PAGODA_CUDA_SKINNY_ROWS", raw)
    with pytest.raises(ConfigError, match="PAGODA_CUDA_SKINNY_ROWS"):
        switches.check()
    assert switches.lenient(switches.skinny_rows, 0) == 0  # the kernel module reads it as off


def test_the_config_keeps_about_one_program_per_multiprocessor():
    from pagoda_cuda.ops.linear import skinny_config

    assert skinny_config(9216, 3072, 132)[0] == 64  # 144 programs
    assert skinny_config(6144, 1024, 132)[0] == 32  # 192
    assert skinny_config(1024, 2048, 132)[0] == 16  # 64: never narrower than one tensor-core tile
    assert skinny_config(1024, 100, 132)[1] == 128  # BLOCK_K: K's power of two when K is short


@GPU
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_skinny_linear_real_shapes_bf16(rows):
    from pagoda_cuda.ops.linear import skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(rows)
    for k, n in [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (3072, 9216), (8192, 3072)]:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        want = torch.nn.functional.linear(x.float(), w.float())
        # both round once from float32 sums: within a bf16 step of the float32 product
        torch.testing.assert_close(skinny_linear(x, w).float(), want, atol=2e-2, rtol=1e-2)
