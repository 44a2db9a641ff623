"""The kernel op ``apply_token_bitmask`` (xgrammar's Triton kernel, launched by pagoda-cuda) against the
core's reference (xgrammar's own function) and against the bits unpacked by hand: rows picked by an index
(one repeated, as the sampler pads it), a vocabulary past the mask's ids left alone, a mask narrower than
the logits. On a GPU only: the Triton interpreter cannot run xgrammar's kernel (its persistent loop starts
at the program id, which the interpreter holds as an array)."""

import pytest
import torch
from pagoda.structured_outputs.masking import apply_token_bitmask as reference


def _unpacked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("vocab_size, width_ids, rows", [(200, 200, [1, 3, 4, 4]), (150, 224, [0, 2, 5, 6, 7, 7]),
                                                         (4500, 4500, [2])])
def test_apply_token_bitmask_matches_xgrammar(vocab_size, width_ids, rows):
    from pagoda_cuda.ops.grammar import apply_token_bitmask

    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(8, width_ids + 37, generator=gen)  # a model's padded ids past the mask's
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, (width_ids + 31) // 32), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    index = torch.tensor(rows, dtype=torch.int32)
    got, want = logits.cuda(), logits.cuda()
    apply_token_bitmask(got, bitmask.cuda(), index.cuda(), vocab_size)
    reference(want, bitmask.cuda(), index.cuda(), vocab_size)
    torch.testing.assert_close(got, want)
    got = got.cpu()
    by_hand = logits.clone()
    for r in set(rows):
        by_hand[r, :vocab_size][~_unpacked(bitmask[r:r + 1], vocab_size)[0]] = float("-inf")
    torch.testing.assert_close(got, by_hand)  # (xgrammar's own function, above, applies the same kernel)
    untouched = [r for r in range(8) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched]) and torch.equal(got[:, vocab_size:], logits[:, vocab_size:])


def test_apply_token_bitmask_is_the_cuda_op():
    from pagoda_cuda.ops.grammar import apply_token_bitmask
    from pagoda_cuda.plugin import KERNELS

    assert KERNELS["apply_token_bitmask"] == f"{apply_token_bitmask.__module__}:apply_token_bitmask"
