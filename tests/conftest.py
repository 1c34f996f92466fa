"""Test setup: Triton runs in its interpreter on CPU-only machines (set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One thread in each of pytest-xdist's processes (make test runs 4 on CI's 2 cores): threads of processes that share
# cores wait for each other (measured: a module's tests took twice the CPU time with 2 threads each beside 3 busy
# processes, 73 s against 34 s); 2 for a run in one process.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))


# make test spreads the tests over processes (pytest-xdist): a module whose tests share launched runs or caches goes to
# one process whole, the longest first (measured, seconds on 2 cores with 4 processes), so that the last to start is a
# short one; the tests of SPLIT (in-process, sharing nothing) go one by one, last, to fill in.
FIRST = ("test_vision_language_cp", "test_hf_parity", "test_benchmarks", "test_grpo_cp", "test_preference_cp",
         "test_accelerate_cp", "test_deepspeed_cp", "test_ring", "test_fsdp2_cp", "test_generate", "test_triton_ring",
         "test_reliability", "test_exactness", "test_trainer_cp", "test_properties", "test_softcap_sinks")  # fmt: skip
SPLIT = ("test_triton_kernels", "test_hf_apply", "test_chunked_loss")


def _module(path: str) -> str:
    return path.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(_module(item.nodeid), len(FIRST) + (_module(item.nodeid) in SPLIT)))


def pytest_xdist_make_scheduler(config, log):
    """Units of work: a module, or a test of SPLIT; handed out in the order above (not by their number of tests)."""
    from xdist.scheduler import LoadScopeScheduling

    class Modules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if _module(nodeid) in SPLIT else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return Modules(config, log)
