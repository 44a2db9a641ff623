"""Entry point of pagoda-quant: quantizers and their kernel ops (lazy strings, no torch here)."""

from pagoda import hookimpl

from pagoda_quant.quantizers import QUANTIZERS

OPS = ("fp8_linear", "fp8_block_linear", "int4_linear", "fused_moe_quant")
# pagoda-quant is device-neutral: its ops' torch references here; pagoda-cuda registers their Triton
# kernels for CUDA devices (pagoda_cuda.quant), other platform plugins may register their own.


@hookimpl
def register_quantizers(register):
    for cls in QUANTIZERS:
        register(cls())


@hookimpl
def register_kernels(register):
    for op in OPS:
        register(op, "*", f"pagoda_quant.kernels.reference:{op}", priority=0)
