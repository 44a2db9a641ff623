"""quantization: gguf — Q4_1 blocks decoded into pagoda's INT4 layout exactly, and clear errors elsewhere."""

import numpy as np
import pytest
import torch
from pagoda import LLM
from pagoda.errors import ModelLoadError
from pagoda.testing import make_tiny_checkpoint
from pagoda_quant.formats import int4 as i4
from pagoda_quant.methods.gguf import GgufConfig, decode_q4_1


def _q4_1_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_1 block rows, uint8 [rows, cols / 32 * 20]; the first block of row 0 has scale 0."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((rows, cols // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (rows, cols // 32)).astype(np.float16)
    m = rng.uniform(-0.4, 0.1, (rows, cols // 32)).astype(np.float16)
    d[0, 0] = 0
    blocks[..., 0:2] = d.view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[..., 2:4] = m.view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[..., 4:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def test_decoded_blocks_give_the_gguf_weights():
    import gguf

    raw = _q4_1_blocks(6, 96)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    codes, scales, zeros = decode_q4_1(torch.from_numpy(raw))
    assert codes.shape == (6, 96) and int(codes.max()) <= 15
    got = i4.dequantize_groups(codes, scales, zeros)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)
    # through the kernel layout (float32 scales and zero points, as a float32 model holds them)
    qweight, s, z = i4.to_kernel_layout(codes, scales, zeros, torch.float32)
    np.testing.assert_allclose(i4.dequantize_packed(qweight, s, z).t().numpy(), want, rtol=1e-6, atol=1e-7)


def test_only_q4_1_linear_weights_are_kept_raw_off_the_cpu():
    keeps = GgufConfig(cpu=False).gguf_keeps_raw
    assert keeps("model.layers.3.self_attn.q_proj.weight", "Q4_1")
    assert not keeps("model.layers.3.self_attn.q_proj.weight", "Q6_K")
    assert not keeps("model.embed_tokens.weight", "Q4_1") and not keeps("lm_head.weight", "Q4_1")
    assert not keeps("model.layers.3.mlp.gate.weight", "Q4_1")  # a MoE router stays full precision


def test_gguf_quantization_of_a_safetensors_model_is_a_clear_error(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, seed=0, vocab_size=64, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ModelLoadError, match=r"quantization gguf: layer [a-z_.0-9]+ received a "
                                             r"torch.float32 weight, not GGUF blocks: this setting applies to .gguf"):
        LLM(model=str(path), device="cpu", dtype="float32", quantization="gguf", num_kv_blocks=8)
