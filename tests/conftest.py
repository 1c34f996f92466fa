"""Test setup: Triton runs in its interpreter on CPU-only machines (set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


# The longest modules first (their launched runs): with the tests spread over processes by module (make test's
# pytest-xdist --dist loadfile), the last module to start is then a short one. The rest keep their order.
FIRST = ("test_grpo_cp", "test_hf_parity", "test_preference_cp", "test_deepspeed_cp", "test_generate",
         "test_accelerate_cp", "test_fsdp2_cp", "test_vision_language_cp", "test_benchmarks", "test_ring")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    module = lambda item: getattr(getattr(item, "module", None), "__name__", "").rpartition(".")[2]  # noqa: E731
    items.sort(key=lambda item: rank.get(module(item), len(FIRST)))
