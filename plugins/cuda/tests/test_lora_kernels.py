"""Triton LoRA shrink/expand against the core's torch reference (pagoda.lora.ops): a batch that mixes
slots and base rows (-1), ranks padded in the stack, widths that are not block multiples, tokens taken
given their work list (tokens in slot order, tiles of one adapter, padded with empty tiles as the decode
graphs pass them) or working it out, K split into partial sums (the kernels' own choice) or not."""

import pytest
import torch
from pagoda.lora import ops as ref

GPU = pytest.mark.gpu


def _case(device, dtype, t, k, n, r, s, seed=0, segments=0, ordered=True):
    from pagoda_cuda.ops.lora import lora_expand, lora_shrink

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


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_kernels_real_shapes(device, dtype):
    _case(device, dtype, 256, 4096, 3 * 4096, 48, 16)  # decode-like: 16 adapters mixed
    _case(device, dtype, 2048, 4096, 4096, 16, 4, segments=512)  # prefill-like: runs of one adapter
