"""Ring attention on CPU: CP=N gloo ranks (one thread each) against one process with one thread.

For each full length S (causal, zig-zag), each backend (``torch`` and ``sdpa`` by default) and each
Ulysses size U (``--ulysses``, default 1: the pure ring), times forward and forward+backward of
``hf_ring.ring_attention`` in one process (world size 1) and on N gloo ranks (with a ``PlanCache``, as
a patched model has, started anew each iteration; U > 1: the Ulysses x Ring hybrid, U x N/U), and
reports: parallel efficiency T1 / (N * TN) (the field's ring efficiency), peak memory per rank (peak
RSS above the process's baseline before the inputs were made), bytes sent per rank (ring and
all-to-all), and as yardsticks PyTorch's SDPA on the full sequence in one process with one thread
(``eff vs SDPA1`` = T_SDPA1 / (N * TN)) and with N threads (the ranks' thread budget). Each configuration runs in fresh processes so peak RSS belongs to it alone.

    python benchmarks/bench_ring_cpu.py                      # S = 4K, 8K, 16K, 32K, N = 2
    python benchmarks/bench_ring_cpu.py --lengths 4096 8192 --heads 4 --kv-heads 2 --backends sdpa
    python benchmarks/bench_ring_cpu.py --lengths 8192 --heads 8 --kv-heads 2 --backends sdpa --ulysses 1 2

Prints a table and appends one CSV row per length to benchmarks/results/ring_cpu.csv with the
date, library versions and CPU model.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _cpu import append_rows, cpu_name

import hf_ring
from hf_ring.comm import ulysses_groups


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _measure(rank, world, args, port, out_q):
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    s, d = args.seq_len, args.head_dim
    local = s // world
    base = _rss_mib()
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, args.heads, local, d, generator=g, requires_grad=True)
    k = torch.randn(1, args.kv_heads, local, d, generator=g, requires_grad=True)
    v = torch.randn(1, args.kv_heads, local, d, generator=g, requires_grad=True)
    dout = torch.randn(1, args.heads, local, d, generator=g)
    fwd, fwdbwd, sent = [], [], 0
    plans = hf_ring.PlanCache()
    groups = ulysses_groups(None, args.ulysses) if world > 1 else None
    for it in range(args.warmup + args.repeats):
        comm = hf_ring.RingComm(None if groups is None else groups.ring_group)
        exchanged = 0 if groups is None else groups.exchange.bytes_sent
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        plans.new_batch()
        out = hf_ring.ring_attention(q, k, v, comm=comm, backend=args.backend, plans=plans, ulysses=groups)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        q.grad = k.grad = v.grad = None
        if it >= args.warmup:
            fwd.append(t1 - t0)
            fwdbwd.append(t2 - t0)
            sent = comm.bytes_sent  # forward + backward key/value hops of this iteration, and all-to-alls
            sent += 0 if groups is None else groups.exchange.bytes_sent - exchanged
    result = dict(fwd=statistics.median(fwd), fwdbwd=statistics.median(fwdbwd), mem=_rss_mib() - base, sent=sent)
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, result)
        dist.barrier()  # (every rank alive while the group closes: gloo can abort a process left alone)
        dist.destroy_process_group()
        result = dict(
            fwd=max(r["fwd"] for r in every),  # the ring is as slow as its slowest rank
            fwdbwd=max(r["fwdbwd"] for r in every),
            mem=max(r["mem"] for r in every),
            sent=max(r["sent"] for r in every),
        )
    if rank == 0:
        out_q.put(result)


def _sdpa_full(rank, world, args, port, out_q):
    """PyTorch's SDPA on the full sequence in one process with ``args.sdpa_threads`` threads."""
    torch.set_num_threads(args.sdpa_threads)
    s, d = args.seq_len, args.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, s, d, generator=g, requires_grad=True)
    k = torch.randn(1, args.kv_heads, s, d, generator=g, requires_grad=True)
    v = torch.randn(1, args.kv_heads, s, d, generator=g, requires_grad=True)
    dout = torch.randn(1, args.heads, s, d, generator=g)
    fwd, fwdbwd = [], []
    for it in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        if it >= args.warmup:
            fwd.append(t1 - t0)
            fwdbwd.append(t2 - t0)
    out_q.put(dict(fwd=statistics.median(fwd), fwdbwd=statistics.median(fwdbwd)))


def _run(world, args, target=None):
    target = target or _measure
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, args, port, out_q)) for r in range(world)]
    for p in procs:
        p.start()
    result = out_q.get()
    for p in procs:
        p.join()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["torch", "sdpa"], choices=["torch", "sdpa"])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ulysses", type=int, nargs="+", default=[1], help="Ulysses sizes U (1: the pure ring)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "ring_cpu.csv"))
    args = ap.parse_args(argv)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env = dict(date=stamp, torch=torch.__version__, hf_ring=hf_ring.__version__, python=platform.python_version(),
               cpu=cpu_name(), cores=os.cpu_count())  # fmt: skip
    rows = []
    header = f"{'S':>6} {'backend':>7} {'U':>2} {'T1 fwd s':>9} {'TN fwd s':>9} {'eff fwd':>8} {'T1 f+b s':>9} {'TN f+b s':>9} {'eff f+b':>8} {'mem1 MiB':>9} {'memN MiB':>9} {'MiB sent/rank f+b':>17} {'SDPA1 f+b s':>11} {'SDPAN f+b s':>11} {'eff vs SDPA1':>12}"
    print(
        f"hf_ring ring attention on CPU, causal zig-zag, CP={args.cp} vs 1 process; heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, fp32"
    )
    print(f"{env['cpu']} ({env['cores']} cores), torch {env['torch']}, {stamp}")
    print(header)
    sdpa = {}
    for s, backend, u in ((s, b, u) for s in args.lengths for b in args.backends for u in args.ulysses):
        args.seq_len, args.backend, args.ulysses = s, backend, u
        if s not in sdpa:  # one thread (the efficiency yardstick) and the ranks' thread budget
            args.sdpa_threads = 1
            sdpa[s] = {"one": _run(1, args, _sdpa_full)}
            args.sdpa_threads = args.cp
            sdpa[s]["budget"] = _run(1, args, _sdpa_full)
        one = _run(1, args)
        ring = _run(args.cp, args)
        row = dict(
            env, seq_len=s, backend=backend, cp=args.cp, ulysses=u, heads=args.heads, kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            t1_fwd=one["fwd"], tn_fwd=ring["fwd"], eff_fwd=one["fwd"] / (args.cp * ring["fwd"]),
            t1_fwdbwd=one["fwdbwd"], tn_fwdbwd=ring["fwdbwd"], eff_fwdbwd=one["fwdbwd"] / (args.cp * ring["fwdbwd"]),
            mem1_mib=one["mem"], memn_mib=ring["mem"], bytes_sent_per_rank=ring["sent"],
            sdpa1_fwdbwd=sdpa[s]["one"]["fwdbwd"], sdpan_fwdbwd=sdpa[s]["budget"]["fwdbwd"],
            eff_vs_sdpa1=sdpa[s]["one"]["fwdbwd"] / (args.cp * ring["fwdbwd"]),
        )  # fmt: skip
        rows.append(row)
        print(
            f"{s:>6} {backend:>7} {u:>2} {row['t1_fwd']:>9.3f} {row['tn_fwd']:>9.3f} {row['eff_fwd']:>7.1%} {row['t1_fwdbwd']:>9.3f} "
            f"{row['tn_fwdbwd']:>9.3f} {row['eff_fwdbwd']:>7.1%} {row['mem1_mib']:>9.0f} {row['memn_mib']:>9.0f} "
            f"{row['bytes_sent_per_rank'] / 2**20:>17.1f} {row['sdpa1_fwdbwd']:>11.3f} {row['sdpan_fwdbwd']:>11.3f} "
            f"{row['eff_vs_sdpa1']:>11.1%}",
            flush=True,
        )
    path = Path(args.csv)
    # older rows ran the pure ring (ulysses 1), without the SDPA yardstick (blank)
    append_rows(path, list(rows[0]), rows, missing={"ulysses": 1})
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    sys.exit(main())
