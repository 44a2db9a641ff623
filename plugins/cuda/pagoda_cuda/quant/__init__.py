"""Triton kernels of pagoda-quant's formats (FP8, INT4, quantized fused MoE) on CUDA, registered by
pagoda-cuda for the ops pagoda-quant declares (its torch references: ``pagoda_quant.kernels.reference``).
``dispatch`` chooses the path per shape; pagoda-quant itself stays device-neutral."""
