"""Ring efficiency simulated on one GPU: the N steps of the slowest rank against one SDPA call.

For N ranks with T tokens each (zig-zag layout, causal), every rank r runs N ring steps: its
queries against the key/value block of every rank, through the Triton backend (forward merges
included, fused in the kernel; backward from the final LSE), skipping blocks the mask hides. The
slowest rank's time T_rank is compared with one SDPA (flash) call on the full sequence of N*T
tokens on the same GPU:

    efficiency = T_full / (N * T_rank)

the way the field reports ring efficiency (100% = the ring loses nothing against single-device
attention). Communication is not simulated: on a real ring it overlaps the kernels.
Rows go to ``benchmarks/results/bench_ring_sim.csv`` with GPU, library versions and date. Without
a GPU (and without ``--device cpu``) it says so and exits 0.

    python benchmarks/bench_ring_sim.py                        # N = 2, 4, 8; 8K tokens per rank
    python benchmarks/bench_ring_sim.py --ranks 8 --tokens 4096 8192 --head-dim 128
    python benchmarks/bench_ring_sim.py --device cpu --dtype fp32 --ranks 2 --tokens 64 \
        --head-dim 32 --q-heads 4 --kv-heads 2                # dry run in Triton's interpreter

On CPU the reference is SDPA's CPU flash kernel and the kernels run interpreted: the dry run checks
the script, its schedule and its numbers (every simulated rank's output and gradients are compared
with dense attention over the same blocks), not the efficiency.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from bench_kernel import DTYPES, add_common_args, bench_ms, finish, random_inputs, rel_err, start

FIELDS = ["date", "gpu", "torch", "triton", "cuda", "cudnn", "flash_attn", "pass", "ranks", "tokens_per_rank",
          "dtype", "batch", "q_heads", "kv_heads", "head_dim", "layout", "t_full_ms", "t_rank_ms", "slowest_rank",
          "efficiency"]  # fmt: skip


#: Largest relative error of a simulated rank against fp32 attention that still counts as correct:
#: a sanity bound per input dtype (a wrong schedule or merge gives errors of order 1).
BOUND = {"bf16": 5e-2, "fp16": 2e-2, "fp32": 1e-4}


def rank_schedule(rank, n, tokens, layout, backend, q, k, v, do, scale):
    """(fwd, fwd+bwd, buffers) of the N ring steps of ``rank`` (blocks in ring order).

    Every step uses the same ``k``/``v`` tensors with the positions of the block it stands for, so
    the work is a real rank's; ``buffers`` are the fp32 (out, dq, dk, dv) the last call left.
    """
    from hf_ring.kernels.mask import BlockMask
    from hf_ring.layout import positions

    full = n * tokens
    pos = [positions(full, rank=r, world_size=n, layout=layout) for r in range(n)]
    masks = [BlockMask(q_pos=pos[rank], k_pos=pos[(rank - s) % n], causal=True) for s in range(n)]
    masks = [m for m in masks if not m.is_empty()]
    for m in masks:
        m.device_tensors(q.device)  # warm the cache, as the ring does after its first call
    b, hq, lq, d = q.shape
    out = torch.zeros(b, hq, lq, d, device=q.device)
    lse = torch.full((b, hq, lq), -math.inf, device=q.device)
    dq = torch.zeros(q.shape, device=q.device)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)

    def fwd():
        out.zero_()
        lse.fill_(-math.inf)
        for m in masks:
            backend.forward(q, k, v, m, scale, out, lse)

    def both():
        fwd()
        delta = (do.float() * out).sum(-1)
        for g in (dq, dk, dv):
            g.zero_()
        for m in masks:
            backend.backward(do, q, k, v, lse, delta, m, scale, dq, dk, dv)

    return fwd, both, (out, dq, dk, dv)


def rank_reference(rank, n, tokens, layout, q, k, v, do, scale):
    """fp32 attention of ``rank``'s queries over the N blocks it sees (the shared k/v at each
    block's positions), with autograd, for key/value head 0 and its query heads (memory stays
    small even if SDPA falls back to its math path): (out, dq, dk, dv), dk/dv summed over the N uses.
    """
    from hf_ring.layout import positions

    full = n * tokens
    pos = [positions(full, rank=r, world_size=n, layout=layout) for r in range(n)]
    k_pos = torch.cat([pos[r] for r in range(n)]).to(q.device)
    vis = pos[rank].to(q.device)[:, None] >= k_pos[None, :]
    g = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.detach()[:, :h].float().requires_grad_() for x, h in ((q, g), (k, 1), (v, 1)))
    kk, vv = (x.repeat(1, g, n, 1) for x in (kf, vf))
    out = F.scaled_dot_product_attention(qf, kk, vv, attn_mask=vis, scale=scale)
    out.backward(do[:, :g].float())
    return out.detach(), qf.grad, kf.grad, vf.grad


def full_sdpa_ms(b, hq, hkv, seqlen, d, dtype, scale, device) -> dict:
    """Milliseconds of one causal SDPA-flash call (GQA) on the full sequence: ``{"fwd": ..., "fwd+bwd": ...}``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, hq, seqlen, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, seqlen, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, seqlen, d, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(b, hq, seqlen, d, device=device, dtype=dtype)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def fwd():
        with torch.no_grad():
            sdpa()

    def both():
        torch.autograd.grad(sdpa(), (q, k, v), do)

    return {"fwd": bench_ms(fwd, device), "fwd+bwd": bench_ms(both, device)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens per rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", choices=["zigzag", "striped", "contiguous"], default="zigzag")
    p.add_argument("--all-ranks", action="store_true", help="time every rank (default: ranks 0 and N-1)")
    add_common_args(p)
    args = p.parse_args(argv)
    started = start(args, "bench_ring_sim.py")
    if started is None:
        return 0
    device, env = started
    from hf_ring.kernels import triton_backend

    dtype = DTYPES[args.dtype]
    b, hq, hkv, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    rows, inaccurate = [], []
    for tokens in args.tokens:
        for n in args.ranks:
            full = n * tokens
            t_full = full_sdpa_ms(b, hq, hkv, full, d, dtype, scale, device)
            q, k, v, do = random_inputs(args, tokens, d, device, seed=1000 * n + tokens)
            ranks = range(n) if args.all_ranks else sorted({0, n - 1})
            t_rank = {"fwd": (0.0, 0), "fwd+bwd": (0.0, 0)}
            for r in ranks:
                fwd, both, buffers = rank_schedule(r, n, tokens, args.layout, triton_backend, q, k, v, do, scale)
                both()
                reference = rank_reference(r, n, tokens, args.layout, q, k, v, do, scale)
                g = hq // hkv
                out, dq, dk, dv = buffers
                err = rel_err((out[:, :g], dq[:, :g], dk[:, :1], dv[:, :1]), reference)
                del reference
                print(
                    f"N={n} T={tokens:6d} rank {r}: out/dq/dk/dv rel_err {err:.1e} against fp32 attention (kv head 0)"
                )
                if not err <= BOUND[args.dtype]:
                    inaccurate.append(f"N={n} T={tokens} rank {r}: rel_err {err:.2e} > {BOUND[args.dtype]:.0e}")
                for name, fn in (("fwd", fwd), ("fwd+bwd", both)):
                    t_rank[name] = max(t_rank[name], (bench_ms(fn, device), r))
            for name in ("fwd", "fwd+bwd"):
                tr, slowest = t_rank[name]
                eff = t_full[name] / (n * tr)
                print(f"N={n} T={tokens:6d} {name:8s} T_full={t_full[name]:9.3f} ms  T_rank={tr:9.3f} ms "
                      f"(rank {slowest})  efficiency={100 * eff:6.1f}%")  # fmt: skip
                rows.append({**env, "pass": name, "ranks": n, "tokens_per_rank": tokens, "dtype": args.dtype,
                             "batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "layout": args.layout,
                             "t_full_ms": f"{t_full[name]:.6g}", "t_rank_ms": f"{tr:.6g}", "slowest_rank": slowest,
                             "efficiency": f"{eff:.5g}"})  # fmt: skip
            del q, k, v, do
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return finish("bench_ring_sim", FIELDS, rows, args.results_dir, inaccurate, "simulated rank")


if __name__ == "__main__":
    sys.exit(main())
