"""``quantization: gguf``: a GGUF checkpoint's Q4_1 linear weights computed as INT4 instead of
being dequantized at load.

A Q4_1 block holds 32 weights of one row: a float16 scale d, a float16 minimum m and 16
bytes of 4-bit codes (low nibbles: weights 0-15, high nibbles: 16-31), each weight d * q + m.
That is pagoda's INT4 layout (``pagoda_quant.formats.int4``) with group size 32, scale d and
zero point -m / d, a float zero point as the kernels take it, so the weights are the file's
own, up to the rounding of -m / d to the activation dtype (exact in float32). The GGUF loader
hands these layers their raw block rows (``gguf_keeps_raw``); other tensor types (Q8_0
embeddings, norms in F32) are dequantized as without this setting, and so are the embedding
and LM head.
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError

from pagoda_quant.formats import int4 as i4
from pagoda_quant.methods.base import PolicyConfig, add_param, layer_name, replace_param
from pagoda_quant.methods.int4 import Int4KernelLayout

BLOCK = 32  # weights per Q4_1 block
BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of codes
RAW_TYPES = ("Q4_1",)
FULL_PRECISION = ("embed_tokens", "lm_head")


def decode_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block rows uint8 [N, K/32 * 20] -> (codes uint8 [N, K], scales float32 [N, K/32], zero points
    float32 [N, K/32]) with weight = (code - zero) * scale. A block whose scale is 0 (every weight m)
    gets codes 0, scale 1 and zero point -m."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = blocks[..., 4:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [N, K/32, 32]: weights 0-15, then 16-31
    flat = d == 0
    codes = torch.where(flat[..., None], torch.zeros_like(codes), codes)
    scales = torch.where(flat, torch.ones_like(d), d)
    zeros = -m / scales
    return codes.reshape(n, -1), scales, zeros


class GgufQ4_1Method(Int4KernelLayout):
    """Loads a linear layer's Q4_1 block rows, then installs them in the INT4 kernel layout."""

    method_name = "gguf-q4_1"

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        if input_size % BLOCK:
            raise ModelLoadError(f"quantization gguf: layer {layer_name(layer)} has {input_size} inputs per rank, "
                                 f"not a multiple of the Q4_1 block of {BLOCK} (tensor_parallel_size splits "
                                 f"them)")
        self.dtype = params_dtype
        # [rows, bytes]: the layer's own loader slices output rows for fused pieces and column
        # parallelism, and bytes for row parallelism (a rank's inputs are whole blocks)
        add_param(layer, "weight", (sum(output_sizes), input_size // BLOCK * BLOCK_BYTES), torch.uint8,
                  output_dim=0, input_dim=1, weight_loader=self._weight_loader(layer))

    @staticmethod
    def _weight_loader(layer):
        def load(param, loaded, shard_id=None):
            if loaded.dtype != torch.uint8:
                raise ModelLoadError(f"quantization gguf: layer {layer_name(layer)} received a {loaded.dtype} weight, "
                                     f"not Q4_1 blocks: this setting applies to .gguf files whose linear weights "
                                     f"are all Q4_1; leave quantization unset for this model")
            layer.weight_loader(param, loaded, shard_id)

        return load

    def process_weights_after_loading(self, layer):
        codes, scales, zeros = decode_q4_1(layer.weight.data)
        qweight, scales, zeros = i4.to_kernel_layout(codes, scales, zeros, self.dtype)
        replace_param(layer, "weight", None)
        self.install(layer, qweight, scales, zeros)


class GgufConfig(PolicyConfig):
    """``quantization: gguf``."""

    name = "gguf"

    def gguf_keeps_raw(self, name: str, ggml_type: str) -> bool:
        """Whether the GGUF loader passes tensor ``name`` (HF naming) as raw blocks."""
        if ggml_type not in RAW_TYPES or not name.endswith(".weight"):
            return False
        module = name[: -len(".weight")]
        return not any(part in module for part in FULL_PRECISION) and not self.keeps_full_precision(module)

    def linear_method(self, layer, prefix):
        return GgufQ4_1Method()

    def describe(self) -> str:
        return "gguf: Q4_1 linear weights of a GGUF file computed as INT4 (group 32), not dequantized"
