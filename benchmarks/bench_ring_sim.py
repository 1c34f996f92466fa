"""Ring efficiency on one device: N virtual ranks, each running the real ``ring_attention``, against one call.

For N ranks with T tokens each (causal; zig-zag by default), every virtual rank r runs its forward
(and forward + backward) through ``hf_ring.ring_attention`` itself, with a ``LoopbackComm`` in place
of P2P: at every step it is handed the key/value block another rank would have sent (each rank's
own, distinct K/V, not one block reused), so planning, plan checks, merges, buffers and any host
sync are inside the time; only the wire is not (on a real ring it overlaps the kernels). Each
timed call starts a new batch on its ``PlanCache`` (as a model's first layer does).

    efficiency = T_full / (N * T_rank)

where T_rank is the slowest rank and T_full one ``ring_attention`` call of the same backend on the
full sequence of N*T tokens (one rank), the way the field reports ring efficiency (100% = the ring
loses nothing against single-device attention). ``vs_sdpa`` = T_sdpa / (N * T_rank) compares with
the fastest of PyTorch's SDPA backends on the full sequence instead.

Before timing, every rank's output and gradients are checked against fp32 SDPA on the full
sequence (dK/dV: the loopback records each rank's share of every block's gradient, summed here);
the script exits 1 when a rank is wrong. ``op`` names the fused op that ran the ring's steps (as in
``bench_kernel.py``). Rows go to ``benchmarks/results/bench_ring_sim.csv`` with
device, library versions and date. Without a GPU (and without ``--device cpu``) it says so and exits 0.

    python benchmarks/bench_ring_sim.py                        # N = 2, 4, 8; 8K tokens per rank
    python benchmarks/bench_ring_sim.py --ranks 8 --tokens 8192 --backends sdpa triton
    python benchmarks/bench_ring_sim.py --device cpu --dtype fp32 --ranks 2 --tokens 64 \
        --head-dim 32 --q-heads 4 --kv-heads 2                # dry run (triton in its interpreter)
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_kernel import DTYPES, Rows, add_common_args, bench_ms, finish, op_ran, rel_err, start

FIELDS = ["date", "gpu", "torch", "triton", "cuda", "cudnn", "flash_attn", "backend", "op", "through", "pass", "ranks",
          "tokens_per_rank", "dtype", "batch", "q_heads", "kv_heads", "head_dim", "layout", "t_full_ms", "t_rank_ms",
          "slowest_rank", "efficiency", "t_sdpa_ms", "vs_sdpa", "rel_err"]  # fmt: skip

#: Largest relative error of a virtual rank against fp32 attention that still counts as correct:
#: a sanity bound per input dtype (a wrong schedule or merge gives errors of order 1).
BOUND = {"bf16": 5e-2, "fp16": 2e-2, "fp32": 1e-4}


def full_inputs(args, seqlen, head_dim, device, seed):
    """Seeded full-sequence q, k, v, dO in the benchmark's dtype."""
    g = torch.Generator(device=device).manual_seed(seed)
    heads = (args.q_heads, args.kv_heads, args.kv_heads, args.q_heads)
    return [torch.randn(args.batch, h, seqlen, head_dim, device=device, generator=g).to(DTYPES[args.dtype])
            for h in heads]  # fmt: skip


def virtual_rank(rank, n, layout, backend, shards, blocks, record=False):
    """(fwd, fwd+bwd, run) for virtual rank ``rank``: callables through ``ring_attention`` with a
    ``LoopbackComm``; ``run()`` returns (out, dq, loopback) of one forward + backward."""
    import hf_ring

    q, k, v, do = shards[rank]
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    plans = hf_ring.PlanCache()

    def call(comm):
        plans.new_batch()
        return hf_ring.ring_attention(q, k, v, layout=layout, backend=backend, comm=comm, plans=plans)

    def fwd():
        with torch.no_grad():
            call(hf_ring.LoopbackComm(rank, n, blocks))

    def both():
        torch.autograd.grad(call(hf_ring.LoopbackComm(rank, n, blocks)), (q, k, v), do)

    def run():
        comm = hf_ring.LoopbackComm(rank, n, blocks, record=True)
        out = call(comm)
        dq, _, _ = torch.autograd.grad(out, (q, k, v), do)
        return out.detach(), dq, comm

    return fwd, both, run


def full_call_ms(backend, q, k, v, do, device) -> dict:
    """Milliseconds of one ``ring_attention`` call (one rank) on the full sequence: fwd and fwd+bwd."""
    import hf_ring

    qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
    plans = hf_ring.PlanCache()

    def call():
        plans.new_batch()
        return hf_ring.ring_attention(qr, kr, vr, backend=backend, plans=plans)

    def fwd():
        with torch.no_grad():
            call()

    def both():
        torch.autograd.grad(call(), (qr, kr, vr), do)

    return {"fwd": bench_ms(fwd, device), "fwd+bwd": bench_ms(both, device)}


def best_sdpa_ms(q, k, v, do, device) -> dict:
    """Milliseconds of the fastest PyTorch SDPA backend (causal, GQA) on the full sequence: fwd and fwd+bwd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if device.type == "cpu":
        kinds = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, k, v))
    best = {"fwd": float("inf"), "fwd+bwd": float("inf")}
    for kind in kinds:

        def run(kind=kind):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)

        def fwd(run=run):
            with torch.no_grad():
                run()

        def both(run=run):
            torch.autograd.grad(run(), (qr, kr, vr), do)

        try:
            both()
        except RuntimeError:
            continue  # this SDPA backend cannot run the shape here
        best = {"fwd": min(best["fwd"], bench_ms(fwd, device)), "fwd+bwd": min(best["fwd+bwd"], bench_ms(both, device))}
    return best


def reference(full) -> tuple:
    """``(out, dq, dk, dv)`` of fp32 SDPA on the full sequence, the keys and values repeated to the query heads:
    PyTorch's fp32 CUDA kernel (memory-efficient) takes no GQA, and ``enable_gqa`` would fall to the math kernel,
    whose scores of the whole sequence do not fit (512 GiB at 32 heads and 64K tokens)."""
    q, k, v, do = (x.float().detach() for x in full)
    group = q.shape[1] // k.shape[1]
    q, kr, vr = (x.requires_grad_() for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, kr, vr), do)
    dk, dv = (g.unflatten(1, (k.shape[1], group)).sum(2) for g in (dk, dv))
    return out.detach(), dq, dk, dv


def check(n, layout, shards, runs, ref, device) -> float:
    """Largest relative error of out, dq, dk, dv of every virtual rank against ``ref`` (``reference``)."""
    import hf_ring

    results = [run() for run in runs]
    # dK/dV: with zero inflow, the accumulator rank r sent at step s is its share of block (r - s) mod N
    dkv = [torch.zeros(2, *shards[0][1].shape, device=device) for _ in range(n)]
    for r, (_, _, comm) in enumerate(results):
        for s, acc in enumerate(comm.sent):
            dkv[(r - s) % n] += acc
    worst = 0.0
    for r, (out, dq, _) in enumerate(results):

        def part(x, r=r):
            return hf_ring.shard(x, dim=2, rank=r, world_size=n, layout=layout)

        mine = (out, dq, dkv[r][0], dkv[r][1])
        refs = tuple(part(x) for x in ref)
        worst = max(worst, rel_err(mine, refs))
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens per rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", choices=["zigzag", "striped", "contiguous"], default="zigzag")
    p.add_argument("--backends", nargs="+", default=["sdpa", "triton"], choices=["sdpa", "cudnn", "triton", "torch"])
    p.add_argument("--all-ranks", action="store_true", help="time every rank (default: ranks 0 and N-1)")
    add_common_args(p)
    args = p.parse_args(argv)
    started = start(args, "bench_ring_sim.py")
    if started is None:
        return 0
    device, env = started
    import hf_ring
    from hf_ring.kernels.mask import BlockMask

    b, hq, hkv, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    rows, inaccurate = Rows("bench_ring_sim", FIELDS, args.results_dir), []
    for tokens in args.tokens:
        for n in args.ranks:
            full = full_inputs(args, n * tokens, d, device, seed=1000 * n + tokens)
            t_sdpa = best_sdpa_ms(*full, device)
            shards = [[hf_ring.shard(x, dim=2, rank=r, world_size=n, layout=args.layout) for x in full]
                      for r in range(n)]  # fmt: skip
            blocks = [torch.stack([s[1], s[2]]) for s in shards]  # what each rank sends first
            ref = reference(full)  # (once for every backend)
            pos = torch.arange(tokens)
            for backend in args.backends:
                op = op_ran(backend, shards[0][0], shards[0][2], BlockMask(q_pos=pos, k_pos=pos, causal=True))
                ranks = [virtual_rank(r, n, args.layout, backend, shards, blocks) for r in range(n)]
                err = check(n, args.layout, shards, [run for _, _, run in ranks], ref, device)
                print(f"N={n} T={tokens:6d} {backend:6s}: out/dq/dk/dv rel_err {err:.1e} against fp32 SDPA")
                if not err <= BOUND[args.dtype]:
                    inaccurate.append(f"{backend} N={n} T={tokens}: rel_err {err:.2e} > {BOUND[args.dtype]:.0e}")
                t_full = full_call_ms(backend, *full, device)
                timed = range(n) if args.all_ranks else sorted({0, n - 1})
                t_rank = {"fwd": (0.0, 0), "fwd+bwd": (0.0, 0)}
                for r in timed:
                    for name, fn in (("fwd", ranks[r][0]), ("fwd+bwd", ranks[r][1])):
                        t_rank[name] = max(t_rank[name], (bench_ms(fn, device), r))
                for name in ("fwd", "fwd+bwd"):
                    tr, slowest = t_rank[name]
                    eff, vs = t_full[name] / (n * tr), t_sdpa[name] / (n * tr)
                    print(f"N={n} T={tokens:6d} {backend:6s} {name:8s} T_full={t_full[name]:9.3f} ms  "
                          f"T_rank={tr:9.3f} ms (rank {slowest})  efficiency={100 * eff:6.1f}%  "
                          f"vs best SDPA={100 * vs:6.1f}%")  # fmt: skip
                    rows.add({**env, "backend": backend, "op": op, "through": "ring_attention", "pass": name, "ranks": n,
                                 "tokens_per_rank": tokens, "dtype": args.dtype, "batch": b, "q_heads": hq,
                                 "kv_heads": hkv, "head_dim": d, "layout": args.layout,
                                 "t_full_ms": f"{t_full[name]:.6g}", "t_rank_ms": f"{tr:.6g}", "slowest_rank": slowest,
                                 "efficiency": f"{eff:.5g}", "t_sdpa_ms": f"{t_sdpa[name]:.6g}", "vs_sdpa": f"{vs:.5g}",
                                 "rel_err": f"{err:.3e}"})  # fmt: skip
            del full, shards, blocks, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return finish(rows, inaccurate, "virtual ranks")


if __name__ == "__main__":
    sys.exit(main())
