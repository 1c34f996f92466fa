"""TFLOP/s of one ring step: the Triton backend against PyTorch SDPA (flash and cuDNN backends).

Three kinds of ring step, all with GQA (default 32 query heads : 8 key/value heads):

- ``full``: every key visible (a step whose block lies entirely before the queries);
- ``causal``: the diagonal block (queries and keys at the same positions);
- ``zigzag-half``: a zig-zag step whose first key chunk is visible and second hidden. SDPA gets
  only the visible half of the keys (what a ring over flash-attn does); the Triton kernel gets the
  whole block and skips the hidden tiles from the positions.

FLOPs count only visible (query, key) pairs: forward 4*d per pair, backward 2.5x forward.
Each result is appended to ``benchmarks/results/bench_kernel.csv`` with the GPU, library versions
and date. Needs a CUDA GPU; on CPU it says so and exits 0.

    python benchmarks/bench_kernel.py                      # bf16, head_dim 64 and 128, L 2K..32K
    python benchmarks/bench_kernel.py --seqlens 4096 8192 --head-dims 128 --passes fwd+bwd
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("full", "causal", "zigzag-half")
PASSES = ("fwd", "bwd", "fwd+bwd")
FIELDS = ["date", "gpu", "torch", "triton", "cuda", "cudnn", "flash_attn", "impl", "kind", "pass", "dtype",
          "batch", "q_heads", "kv_heads", "head_dim", "seqlen", "ms", "tflops"]  # fmt: skip


def env_info() -> dict:
    """GPU name and library versions, recorded with every row."""
    versions = {}
    for name in ("triton", "flash_attn"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = ""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "cudnn": str(torch.backends.cudnn.version() or ""),
        **versions,
    }


def write_rows(name: str, fields: list[str], rows: list[dict]) -> Path:
    """Append ``rows`` to ``benchmarks/results/<name>.csv`` (header written once)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn`` (CUDA-synchronised, L2 flushed between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def step_positions(kind: str, seqlen: int):
    """(q_pos, k_pos, visible pairs, SDPA key slice, SDPA is_causal) of one ring step of ``kind``."""
    if kind == "full":
        q_pos, k_pos = torch.arange(seqlen) + seqlen, torch.arange(seqlen)
        return q_pos, k_pos, seqlen * seqlen, slice(None), False
    if kind == "causal":
        pos = torch.arange(seqlen)
        return pos, pos, seqlen * (seqlen + 1) // 2, slice(None), True
    c = seqlen // 2  # N = 2, rank 1 holding chunks 1 and 2, block of rank 0 (chunks 0 and 3)
    q_pos = torch.arange(c, 3 * c)
    k_pos = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)])
    return q_pos, k_pos, seqlen * c, slice(0, c), False


def triton_step(q, k, v, do, mask, scale):
    """(fwd, bwd, fwd+bwd) callables of one ring step with the Triton backend.

    The forward merges into the same accumulators on every call: the same work as a fresh step.
    """
    from hf_ring.kernels import triton_backend

    b, hq, lq, d = q.shape
    out = torch.zeros(b, hq, lq, d, device=q.device)
    lse = torch.full((b, hq, lq), -math.inf, device=q.device)
    triton_backend.forward(q, k, v, mask, scale, out, lse)
    delta = (do.float() * out).sum(-1)
    dq = torch.zeros(q.shape, device=q.device)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)

    def fwd():
        triton_backend.forward(q, k, v, mask, scale, out, lse)

    def bwd():
        triton_backend.backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv)

    def both():
        fwd()
        bwd()

    return fwd, bwd, both


def sdpa_step(q, k, v, do, ks, causal, scale, backend):
    """(fwd, bwd, fwd+bwd) callables of SDPA with one backend, or None if it cannot run this shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    g = q.shape[1] // k.shape[1]
    kk, vv = k[:, :, ks].detach(), v[:, :, ks].detach()
    try:  # native GQA where the backend supports it, else K/V expanded outside the timed region
        with sdpa_kernel(sdp):
            F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, scale=scale, enable_gqa=True)
        gqa = True
    except RuntimeError:
        kk, vv, gqa = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1), False
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, kk, vv))

    def run():
        with sdpa_kernel(sdp):
            kw = {"enable_gqa": True} if gqa else {}
            return F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale, **kw)

    try:
        out = run()
        torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
    except RuntimeError as e:
        print(f"  {backend} cannot run this shape: {str(e).splitlines()[0][:120]}")
        return None

    def fwd():
        with torch.no_grad():
            run()

    def bwd():
        torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)

    def both():
        torch.autograd.grad(run(), (qr, kr, vr), do)

    return fwd, bwd, both


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--impls", nargs="+", default=["triton", "sdpa-flash", "sdpa-cudnn"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernel.py needs a CUDA GPU (none found); nothing measured.")
        return 0
    from hf_ring.kernels.mask import BlockMask

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    env = env_info()
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']}")
    rows = []
    for d in args.head_dims:
        for seqlen in args.seqlens:
            b, hq, hkv = args.batch, args.q_heads, args.kv_heads
            q = torch.randn(b, hq, seqlen, d, device="cuda", dtype=dtype)
            k = torch.randn(b, hkv, seqlen, d, device="cuda", dtype=dtype)
            v = torch.randn(b, hkv, seqlen, d, device="cuda", dtype=dtype)
            do = torch.randn(b, hq, seqlen, d, device="cuda", dtype=dtype)
            scale = d**-0.5
            for kind in args.kinds:
                q_pos, k_pos, pairs, ks, causal = step_positions(kind, seqlen)
                mask = BlockMask(q_pos=q_pos, k_pos=k_pos, causal=True)
                fwd_flops = 4.0 * b * hq * d * pairs
                flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
                for impl in args.impls:
                    fns = triton_step(q, k, v, do, mask, scale) if impl == "triton" else (
                        sdpa_step(q, k, v, do, ks, causal, scale, impl))  # fmt: skip
                    if fns is None:
                        continue
                    for name, fn in zip(PASSES, fns):
                        if name not in args.passes:
                            continue
                        ms = bench_ms(fn)
                        tflops = flops[name] / ms / 1e9
                        print(
                            f"d={d:3d} L={seqlen:6d} {kind:12s} {impl:11s} {name:8s} {ms:9.3f} ms {tflops:7.1f} TFLOP/s"
                        )
                        rows.append({**env, "impl": impl, "kind": kind, "pass": name, "dtype": args.dtype,
                                     "batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "seqlen": seqlen,
                                     "ms": f"{ms:.4f}", "tflops": f"{tflops:.2f}"})  # fmt: skip
            del q, k, v, do
            torch.cuda.empty_cache()
    print(f"wrote {len(rows)} rows to {write_rows('bench_kernel', FIELDS, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
