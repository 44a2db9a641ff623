"""Without a GPU the Triton kernels run in the interpreter; set before any kernel module is
imported (triton decides at decoration time)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
