"""Test session setup: without a GPU, Triton kernels run in the Triton interpreter
(TRITON_INTERPRET must be set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
