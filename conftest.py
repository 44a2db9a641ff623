"""Session-wide test settings, loaded before any test module of tests/ or plugins/.

Without a GPU, Triton kernels run in the interpreter. Triton decides at decoration time, so the
variable must be set before the first kernel module is imported by *any* test (a kernel decorated
outside the interpreter cannot call one decorated inside it).
"""

import os
import tempfile

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GGUF packed-weight caches (pagoda_quant.methods.gguf_cache) of the test run, not the user's ~/.cache
os.environ.setdefault("PAGODA_CACHE_DIR", tempfile.mkdtemp(prefix="pagoda-test-cache-"))
# GGUF prefill GEMMs in float32 on every machine, so that the tests comparing a GGUF file's tokens with its
# float path mean the same on CPUs with AMX or AVX-512 BF16 (where `auto` takes bfloat16); the bfloat16 path
# has its own test
os.environ.setdefault("PAGODA_CPU_PREFILL_DTYPE", "float32")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
