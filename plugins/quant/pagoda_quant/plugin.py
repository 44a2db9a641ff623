"""Entry point of pagoda-quant: quantizers and their kernel ops (lazy strings, no torch here)."""

from pagoda import hookimpl

from pagoda_quant.quantizers import QUANTIZERS

OPS = ("fp8_linear", "fp8_block_linear", "int4_linear", "fused_moe_quant")
# GPU implementations: Triton kernels (and cuBLASLt fp8 through torch._scaled_mm where it runs).
CUDA_PRIORITY = 10


@hookimpl
def register_quantizers(register):
    for cls in QUANTIZERS:
        register(cls())


@hookimpl
def register_kernels(register):
    for op in OPS:
        register(op, "*", f"pagoda_quant.kernels.reference:{op}", priority=0)
    for op in OPS:
        register(op, "cuda", f"pagoda_quant.kernels.cuda:{op}", priority=CUDA_PRIORITY)
