"""``quantization: gguf``: a GGUF file's quantized weights computed as they are stored, not widened at load.

On the CPU (chosen automatically there for every .gguf model, see docs/cpu.md) every linear layer, the
LM head and the embedding keep the file's blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K
are decoded once (``formats.gguf_blocks``) into the layouts of the int8 dot-product kernel
(``kernels.cpu_int8dot``, x86 with AVX2 and a C compiler), else into 4-bit digit planes packed for
torch's CPU int4 kernel (``kernels.cpu_int4pack``); prefill chunks of 128 rows or more widen each
weight once per call and run the float GEMM. The embedding reads its rows from the file's blocks (the mapped
file, no copy) and decodes only the rows a step looks up. Fused layers whose pieces have different
types (a Q4_K_M file's q/k in Q4_K and v in Q6_K) keep one segment per type. Tensors of other types
(Q2_K, Q3_K, IQ*) arrive dequantized and compute in float.

On other devices the method computes Q4_1 linear weights as pagoda's INT4 layout (group 32, scale d,
zero point -m/d, exact in float32) on the INT4 kernels; other types are dequantized at load.

This module holds the method's config (``GgufConfig``: which path, which tensors stay blocks) and the Q4_1
path; the CPU layers are ``pagoda_quant.methods.gguf_cpu``.
"""

from __future__ import annotations

import logging

import torch
from pagoda.errors import ModelLoadError

from pagoda_quant.formats import int4 as i4
from pagoda_quant.formats.gguf_blocks import SUPPORTED
from pagoda_quant.methods.base import PolicyConfig, add_param, layer_name, replace_param
from pagoda_quant.methods.gguf_cpu import GgufCpuLinear, GgufEmbedding
from pagoda_quant.methods.int4 import Int4KernelLayout

logger = logging.getLogger("pagoda")

BLOCK = 32  # weights per Q4_1 block
BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of codes
FULL_PRECISION = ("embed_tokens", "lm_head")
EMBEDDINGS = ("embed_tokens", "lm_head")


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
    """``quantization: gguf`` (chosen automatically for .gguf models on the CPU)."""

    name = "gguf"

    def __init__(self, cpu: bool | None = None):
        super().__init__()
        self._cpu = cpu
        self.packed_cache = None  # gguf_cache.PackedCache of the load in progress (CPU only)

    @property
    def cpu(self) -> bool:
        """Whether the CPU packed path applies: the active platform is the CPU, one rank, and torch has the
        CPU int4 kernels."""
        if self._cpu is None:
            from pagoda.distributed import get_tp_size
            from pagoda.kernels import active_platform

            from pagoda_quant.kernels import cpu_int8dot
            from pagoda_quant.kernels.cpu_int4pack import kernel_available

            self._cpu = active_platform() == "cpu" and get_tp_size() == 1 and (kernel_available()
                                                                              or cpu_int8dot.available())
        return self._cpu

    def gguf_keeps_raw(self, name: str, ggml_type: str) -> bool:
        """Whether the GGUF loader passes tensor ``name`` (HF naming) as raw blocks."""
        if not name.endswith(".weight"):
            return False
        module = name[: -len(".weight")]
        if self.cpu:
            if ggml_type not in SUPPORTED or ".experts" in module:
                return False
            return not self.keeps_full_precision(module) or module.rpartition(".")[2] in EMBEDDINGS
        if ggml_type != "Q4_1":
            return False
        return not any(part in module for part in FULL_PRECISION) and not self.keeps_full_precision(module)

    def linear_method(self, layer, prefix):
        return GgufCpuLinear(self) if self.cpu else GgufQ4_1Method()

    def begin_loading(self, source) -> None:
        """Before the weights load: open the packed-weight cache of this GGUF file (CPU only)."""
        from pagoda_quant.methods.gguf_cache import PackedCache, cache_dir

        directory = cache_dir()
        if not self.cpu or source is None or source.kind != "gguf" or directory is None:
            return
        try:
            self.packed_cache = PackedCache(source.path, directory)
        except OSError as exc:
            logger.warning("no packed-weight cache for %s (%s)", source.path, exc)

    def finish_loading(self, model) -> None:
        """After every layer processed its weights: write what this load packed to the cache."""
        cache, self.packed_cache = self.packed_cache, None
        if cache is not None:
            cache.save()

    def prepare_model(self, model) -> None:
        """Before loading: the embedding and LM head take the file's blocks too (CPU only)."""
        if not self.cpu:
            return
        from pagoda.layers.embedding import ParallelLMHead, VocabParallelEmbedding

        dtype = torch.get_default_dtype()
        embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
        for module in embeddings:
            if isinstance(module, ParallelLMHead):
                module.is_lm_head = True
                tied = next((e for e in embeddings if e is not module and e.weight is module.weight), None)
                if tied is not None:
                    module.tied_to = tied
            method = GgufEmbedding(dtype, self)
            module.quant_method = method
        for module in embeddings:
            tied = getattr(module, "tied_to", None)
            if tied is not None:
                continue
            placeholder = torch.nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            placeholder.weight_loader = (lambda m: lambda param, loaded, shard_id=None:
                                         m.quant_method.load(m, loaded, shard_id))(module)
            replace_param(module, "weight", None)
            module.register_parameter("weight", placeholder)
        for module in embeddings:
            tied = getattr(module, "tied_to", None)
            if tied is not None:
                replace_param(module, "weight", None)
                module.register_parameter("weight", tied.weight)

    def describe(self) -> str:
        if self.cpu:
            from pagoda_quant.kernels import cpu_int8dot

            if cpu_int8dot.available():
                prefill = "bfloat16" if cpu_int8dot.prefill_dtype() is torch.bfloat16 else "float32"
                return (f"gguf: the file's quantized blocks on the CPU's int8 dot-product kernel (not widened); "
                        f"prefill chunks widen them for a {prefill} GEMM (PAGODA_CPU_PREFILL_DTYPE)")
            return "gguf: the file's quantized blocks as packed int4 planes on torch's CPU kernel (not widened)"
        return "gguf: Q4_1 linear weights of a GGUF file computed as INT4 (group 32), not dequantized"
