"""Run a function on a real multi-process gloo group on CPU and collect what every rank returns.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and returns the list of results in
rank order. An exception on any rank is re-raised in the parent with that rank's traceback; a rank
that does not finish within ``timeout`` seconds fails the test (a hang is a failure, never a wait).
``fn`` must be a module-level function (it is pickled by name); results must be picklable
(tensors are fine).

``GlooPool(world_size)`` keeps such a group alive across calls (``pool.run(fn, *args)``), for tests that run
many small cases, such as the property-based ones: one launch, not one per case.

The ranks start from a fork server that imported torch, Transformers and hf_ring once (``PRELOAD``): a 2-rank
launch then takes about 1.5 s where a spawned one takes 6.5 s (measured: a tiny Llama built on each rank, 2-core
AMD EPYC). Each rank gets the parent's environment of the moment, as a spawned process would.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["GlooPool", "run_distributed", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ("torch", "torch.distributed", "transformers", "hf_ring", "hf_ring.patches", "tests.hf_models")
"""What the fork server imports once for every rank it starts."""


@functools.cache
def _context():
    """The ranks' start method: a fork server with ``PRELOAD`` imported, or spawn where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _init(rank, world_size, port, env):
    os.environ.clear()
    os.environ.update(env)  # (the parent's, at the launch: not the fork server's, from its start)
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


def _worker(rank, world_size, port, env, fn, args, results):
    try:
        _init(rank, world_size, port, env)
        try:
            out = fn(rank, world_size, *args)
            # plain pickle copies tensor data: the result stays valid after this process exits
            results.put((rank, True, pickle.dumps(out)))
        finally:
            _leave(rank, world_size)
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _leave(rank: int, world_size: int, patience: float = 60.0) -> None:
    """Rank 0 hosts the group's store: it stays until every rank is done with its function (or ``patience`` runs
    out), so that a rank still reading the store (hf_ring.guard's record of a failure) never finds it gone."""
    with contextlib.suppress(Exception):  # (no store, or a store gone: nothing to wait for)
        store = dist.distributed_c10d._get_default_store()
        done = store.add("dist_utils/done", 1)
        deadline = time.monotonic() + patience
        while rank == 0 and done < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            done = store.add("dist_utils/done", 0)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]`` on a gloo group."""
    ctx = _context()
    results = ctx.Queue()
    port, env = free_port(), dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, env, fn, args, results)) for r in range(world_size)]
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


def _serve(rank, world_size, port, env, inbox, results):
    try:
        _init(rank, world_size, port, env)
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
        ctx = _context()
        self.world_size, self.timeout = world_size, timeout
        self.results = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port, env = free_port(), dict(os.environ)
        self.procs = [
            ctx.Process(target=_serve, args=(r, world_size, port, env, self.inboxes[r], self.results), daemon=True)
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
