"""pagoda-mlu: Cambricon MLU support for pagoda.

Registers, through the ``pagoda`` entry point ``mlu``:

- the ``mlu`` platform (``MluPlatform``), backed by Cambricon's ``torch_mlu`` extension,
  imported only when the platform is asked about;
- the ``mlu-pool`` KV allocator, which reserves the whole KV cache as one MLU allocation;
- the ``mlu_chunked`` attention backend: paged attention over K/V tiles in plain torch
  operations (it runs on the MLU through torch_mlu, and on the CPU where it is tested);
- where ``torch_mlu_ops`` is importable, its fused kernels for the MLU (the ``mlu_fused``
  attention backend, RMSNorm, rotary, paged cache writes and fused MoE).

Nothing here imports torch_mlu or torch_mlu_ops at import time.
"""

__version__ = "0.1.0"
