"""Test setup: Triton runs in its interpreter on CPU-only machines (set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One thread in each of pytest-xdist's processes (make test runs 4 on CI's 2 cores): threads of processes that share
# cores wait for each other (measured: a module's tests took twice the CPU time with 2 threads each beside 3 busy
# processes, 73 s against 34 s); 2 for a run in one process.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
