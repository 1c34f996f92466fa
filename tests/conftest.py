"""Test setup: Triton runs in its interpreter on CPU-only machines (set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
