"""Run a function on a real multi-process gloo group on CPU and collect what every rank returns.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and returns the list of results in
rank order. An exception on any rank is re-raised in the parent with that rank's traceback; a rank
that does not finish within ``timeout`` seconds fails the test (a hang is a failure, never a wait).
``fn`` must be a module-level function (it is pickled by name); results must be picklable
(tensors are fine).

``GlooPool(world_size)`` keeps such a group alive across calls (``pool.run(fn, *args)``), for tests that run
many small cases, such as the property-based ones: one launch, not one per case.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["GlooPool", "run_distributed", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world_size, port):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _worker(rank, world_size, port, fn, args, results):
    try:
        _init(rank, world_size, port)
        try:
            out = fn(rank, world_size, *args)
            # plain pickle copies tensor data: the result stays valid after this process exits
            results.put((rank, True, pickle.dumps(out)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]`` on a gloo group."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(results, world_size, timeout)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(results, world_size: int, timeout: float) -> list:
    """Every rank's result from ``results``, in rank order; RuntimeError with the failing ranks' tracebacks."""
    outs, errors = {}, []
    for _ in range(world_size):
        try:
            rank, ok, value = results.get(timeout=timeout)
        except queue.Empty:
            missing = sorted(set(range(world_size)) - set(outs) - {e[0] for e in errors})
            errors.append((missing, f"did not finish within {timeout}s (a hang)"))
            break
        if ok:
            outs[rank] = pickle.loads(value)
        else:
            errors.append((rank, value))
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors)
        raise RuntimeError(f"{len(errors)} rank(s) failed:\n{msg}")
    return [outs[r] for r in range(world_size)]


def _serve(rank, world_size, port, inbox, results):
    try:
        _init(rank, world_size, port)
    except BaseException:  # noqa: BLE001
        results.put((rank, False, traceback.format_exc()))
        return
    while (job := inbox.get()) is not None:
        fn, args = job
        try:
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class GlooPool:
    """``world_size`` gloo processes kept alive across calls; ``run(fn, *args)`` is ``run_distributed`` on them."""

    def __init__(self, world_size: int, timeout: float = 120.0):
        ctx = mp.get_context("spawn")
        self.world_size, self.timeout = world_size, timeout
        self.results = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world_size, port, self.inboxes[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        for inbox in self.inboxes:
            inbox.put((fn, args))
        return _collect(self.results, self.world_size, self.timeout)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
