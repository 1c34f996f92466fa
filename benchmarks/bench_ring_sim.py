"""Ring efficiency simulated on one GPU: the N steps of the slowest rank against one SDPA call.

For N ranks with T tokens each (zig-zag layout, causal), every rank r runs N ring steps: its
queries against the key/value block of every rank, through the Triton backend (forward merges
included, fused in the kernel; backward from the final LSE), skipping blocks the mask hides. The
slowest rank's time T_rank is compared with one SDPA (flash) call on the full sequence of N*T
tokens on the same GPU:

    efficiency = T_full / (N * T_rank)

the way the field reports ring efficiency (100% = the ring loses nothing against single-device
attention). Communication is not simulated: on a real ring it overlaps the kernels.
Rows go to ``benchmarks/results/bench_ring_sim.csv`` with GPU, library versions and date. Needs a
CUDA GPU; on CPU it says so and exits 0.

    python benchmarks/bench_ring_sim.py                        # N = 2, 4, 8; 8K tokens per rank
    python benchmarks/bench_ring_sim.py --ranks 8 --tokens 4096 8192 --head-dim 128
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from bench_kernel import bench_ms, env_info, write_rows

FIELDS = ["date", "gpu", "torch", "triton", "cuda", "cudnn", "flash_attn", "pass", "ranks", "tokens_per_rank",
          "dtype", "batch", "q_heads", "kv_heads", "head_dim", "layout", "t_full_ms", "t_rank_ms", "slowest_rank",
          "efficiency"]  # fmt: skip


def rank_schedule(rank, n, tokens, layout, backend, q, k, v, do, scale):
    """(fwd, fwd+bwd) callables running the N ring steps of ``rank`` (blocks in ring order)."""
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
        for m in masks:
            backend.backward(do, q, k, v, lse, delta, m, scale, dq, dk, dv)

    return fwd, both


def full_sdpa_ms(b, hq, hkv, seqlen, d, dtype, scale) -> dict:
    """Milliseconds of one causal SDPA-flash call (GQA) on the full sequence: ``{"fwd": ..., "fwd+bwd": ...}``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, hq, seqlen, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, seqlen, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, seqlen, d, device="cuda", dtype=dtype, requires_grad=True)
    do = torch.randn(b, hq, seqlen, d, device="cuda", dtype=dtype)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def fwd():
        with torch.no_grad():
            sdpa()

    def both():
        torch.autograd.grad(sdpa(), (q, k, v), do)

    return {"fwd": bench_ms(fwd), "fwd+bwd": bench_ms(both)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens per rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--layout", choices=["zigzag", "striped", "contiguous"], default="zigzag")
    p.add_argument("--all-ranks", action="store_true", help="time every rank (default: ranks 0 and N-1)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ring_sim.py needs a CUDA GPU (none found); nothing measured.")
        return 0
    from hf_ring.kernels import triton_backend

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    env = env_info()
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']}")
    b, hq, hkv, d = args.batch, args.q_heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    rows = []
    for tokens in args.tokens:
        for n in args.ranks:
            full = n * tokens
            t_full = full_sdpa_ms(b, hq, hkv, full, d, dtype, scale)
            q = torch.randn(b, hq, tokens, d, device="cuda", dtype=dtype)
            k = torch.randn(b, hkv, tokens, d, device="cuda", dtype=dtype)
            v = torch.randn(b, hkv, tokens, d, device="cuda", dtype=dtype)
            do = torch.randn(b, hq, tokens, d, device="cuda", dtype=dtype)
            ranks = range(n) if args.all_ranks else sorted({0, n - 1})
            t_rank = {"fwd": (0.0, 0), "fwd+bwd": (0.0, 0)}
            for r in ranks:
                fwd, both = rank_schedule(r, n, tokens, args.layout, triton_backend, q, k, v, do, scale)
                for name, fn in (("fwd", fwd), ("fwd+bwd", both)):
                    t_rank[name] = max(t_rank[name], (bench_ms(fn), r))
            for name in ("fwd", "fwd+bwd"):
                tr, slowest = t_rank[name]
                eff = t_full[name] / (n * tr)
                print(f"N={n} T={tokens:6d} {name:8s} T_full={t_full[name]:9.3f} ms  T_rank={tr:9.3f} ms "
                      f"(rank {slowest})  efficiency={100 * eff:6.1f}%")  # fmt: skip
                rows.append({**env, "pass": name, "ranks": n, "tokens_per_rank": tokens, "dtype": args.dtype,
                             "batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "layout": args.layout,
                             "t_full_ms": f"{t_full[name]:.4f}", "t_rank_ms": f"{tr:.4f}", "slowest_rank": slowest,
                             "efficiency": f"{eff:.4f}"})  # fmt: skip
            del q, k, v, do
            torch.cuda.empty_cache()
    print(f"wrote {len(rows)} rows to {write_rows('bench_ring_sim', FIELDS, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
