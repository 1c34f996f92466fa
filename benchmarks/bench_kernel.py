"""TFLOP/s of one ring step: hf_ring's backends (``triton``, ``sdpa``, ``torch``) against PyTorch SDPA.

Three kinds of ring step, all with GQA (default 32 query heads : 8 key/value heads):

- ``full``: every key visible (a step whose block lies entirely before the queries);
- ``causal``: the diagonal block (queries and keys at the same positions);
- ``zigzag-half``: a zig-zag step whose first key chunk is visible and second hidden. SDPA gets
  only the visible half of the keys (what a ring over flash-attn does); the Triton kernel gets the
  whole block and skips the hidden tiles from the positions.

FLOPs count only visible (query, key) pairs: forward 4*d per pair, backward 2.5x forward.
Implementations: ``triton``, ``sdpa``, ``cudnn`` (GPU only) and ``torch`` are hf_ring's backends running one
ring step (``forward`` merging into the accumulators, ``backward`` from the final LSE); ``sdpa-flash`` and
``sdpa-cudnn`` are PyTorch's public SDPA with that backend forced (GPU only). Each row's ``op`` says what
ran: the fused op an hf_ring backend chose (``flash``, ``efficient``, ``cudnn``, ``flash_for_cpu``, or the
fallback backend), or ``+repeat_kv`` where a forced SDPA backend needed the key/value heads repeated.
Before timing a step, every implementation's output and gradients are compared with an fp32 SDPA
reference on the same inputs (``rel_err``, the largest relative error of out, dq, dk, dv); the
script exits 1 when one of hf_ring's backends is less accurate than 2x SDPA-flash (plus 1e-3) in
the same dtype, so a speed is never reported for wrong numbers. Each result is appended to
``benchmarks/results/bench_kernel.csv`` with the GPU, library versions and date.

    python benchmarks/bench_kernel.py                      # bf16, head_dim 64 and 128, L 2K..32K
    python benchmarks/bench_kernel.py --seqlens 4096 8192 --head-dims 128 --passes fwd+bwd
    python benchmarks/bench_kernel.py --device cpu --dtype fp32 --seqlens 128 --head-dims 64 \
        --q-heads 4 --kv-heads 2                           # dry run in Triton's interpreter

    python benchmarks/bench_kernel.py --device cpu --impls torch sdpa --dtype fp32 --seqlens 2048 \
        --head-dims 64 --q-heads 8 --kv-heads 2        # the CPU backends (what "auto" picks on CPU)

Without a GPU (and without ``--device cpu``) it says so and exits 0. On CPU the triton backend runs
in the interpreter (its timings mean nothing; the dry run checks the script and the numbers), while
the torch and sdpa backends run their real CPU kernels.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _cpu import append_rows, cpu_name

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("full", "causal", "zigzag-half")
PASSES = ("fwd", "bwd", "fwd+bwd")
FIELDS = ["date", "gpu", "torch", "triton", "cuda", "cudnn", "flash_attn", "impl", "op", "kind", "pass", "dtype",
          "batch", "q_heads", "kv_heads", "head_dim", "seqlen", "ms", "tflops", "rel_err"]  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "cudnn": str(torch.backends.cudnn.version() or ""),
        **versions,
    }


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The options both GPU benchmarks share: the attention shape and dtype, the device (``cpu`` is a
    dry run) and the results folder."""
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: dry run with the kernels in Triton's interpreter (checks, not timings)",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="folder of the CSV files")  # fmt: skip


def start(args, script: str) -> tuple[torch.device, dict] | None:
    """The device to run on and the environment recorded with every row (printed), or None (message
    printed) when CUDA was asked for and there is none.

    ``--device cpu`` turns Triton's interpreter on; it must happen before ``triton`` is imported.
    """
    if args.device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (none found); nothing measured. --device cpu runs a dry run.")
        return None
    else:
        device = torch.device("cuda")
    env = env_info()
    print(f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']}")
    return device, env


def random_inputs(args, seqlen: int, head_dim: int, device: torch.device, seed: int):
    """Seeded q, k, v, dO of ``seqlen`` tokens in the benchmark's dtype: q/dO with the query heads,
    k/v with the key/value heads."""
    g = torch.Generator(device=device).manual_seed(seed)
    heads = (args.q_heads, args.kv_heads, args.kv_heads, args.q_heads)
    return tuple(
        torch.randn(args.batch, h, seqlen, head_dim, device=device, generator=g).to(DTYPES[args.dtype]) for h in heads
    )


class Rows(list):
    """The rows of ``<folder>/<name>.csv``, each appended to the file as it is measured (header written
    once), so a run stopped by a time limit keeps every row it finished."""

    def __init__(self, name: str, fields: list[str], folder: Path = RESULTS):
        super().__init__()
        self.path, self.fields = Path(folder) / f"{name}.csv", fields

    def add(self, row: dict) -> None:
        self.append(row)
        append_rows(self.path, self.fields, [row])


def finish(rows: Rows, inaccurate: list[str], what: str) -> int:
    """List the inaccurate results; the exit status (1 if any was inaccurate)."""
    print(f"wrote {len(rows)} rows to {rows.path}")
    for line in inaccurate:
        print(f"INACCURATE {what}: {line}")
    return 1 if inaccurate else 0


def bench_ms(fn, device: torch.device | None = None) -> float:
    """Median milliseconds of ``fn``: CUDA-synchronised with L2 flushed between runs; on CPU (a dry run: the kernels
    in Triton's interpreter, checks rather than timings) the milliseconds of one run."""
    if device is not None and device.type == "cpu":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
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


def reference_grads(q, k, v, do, ks, causal, scale):
    """fp32 SDPA on the visible keys ``ks``: ``(out, dq, dk, dv)``, dk/dv full-length (0 on hidden keys)."""
    g = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    kk, vv = kf[:, :, ks].repeat_interleave(g, 1), vf[:, :, ks].repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(qf, kk, vv, is_causal=causal, scale=scale)
    out.backward(do.float())
    return out.detach(), qf.grad, kf.grad, vf.grad


def rel_err(results, reference) -> float:
    """Largest ``||x - ref|| / ||ref||`` over (out, dq, dk, dv); inf if anything is not finite."""
    worst = 0.0
    for x, ref in zip(results, reference):
        x, ref = x.double(), ref.double()
        if not torch.isfinite(x).all():
            return math.inf
        worst = max(worst, ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item())
    return worst


OURS = ("triton", "sdpa", "cudnn", "torch")  # hf_ring's backends; the others are PyTorch's SDPA


def backend_step(name, q, k, v, do, mask, scale):
    """(fwd, bwd, fwd+bwd) callables of one ring step with hf_ring's backend ``name``, its (out, dq, dk, dv), and what
    ran it (``op_ran``); None where the backend cannot run these inputs.

    The forward merges into the same accumulators on every call: the same work as a fresh step.
    The backward includes ``delta = rowsum(dO * O)``, as SDPA's backward does.
    """
    from hf_ring.kernels import get_backend, unsupported_by

    backend = get_backend(name, q.device)
    reason = unsupported_by(backend, q, k, v)
    if reason:
        print(f"  {name} cannot run here: {reason}")
        return None
    b, hq, lq, d = q.shape
    out = torch.zeros(b, hq, lq, d, device=q.device)
    lse = torch.full((b, hq, lq), -math.inf, device=q.device)
    dq = torch.zeros(q.shape, device=q.device)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)
    backend.forward(q, k, v, mask, scale, out, lse)
    out_q = out.to(q.dtype)
    backend.backward(do, q, k, v, lse, (do.float() * out).sum(-1), mask, scale, dq, dk, dv, out=out_q)
    result = tuple(x.clone() for x in (out, dq, dk, dv))

    def fwd():
        backend.forward(q, k, v, mask, scale, out, lse)

    def bwd():
        delta = (do.float() * out).sum(-1)
        backend.backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, out=out_q)

    def both():
        fwd()
        bwd()

    return (fwd, bwd, both), result, op_ran(name, q, v, mask)


def op_ran(name: str, q, v, mask) -> str:
    """What runs a step of hf_ring's backend ``name``: for ``sdpa`` / ``cudnn`` the fused op (or the fallback
    backend) that takes it, else the backend itself."""
    if name in ("sdpa", "cudnn"):
        from hf_ring.kernels.sdpa_backend import step_op

        return step_op(q, v, mask, backend=name)
    return name


def sdpa_step(q, k, v, do, ks, causal, scale, backend):
    """(fwd, bwd, fwd+bwd) callables of SDPA with one backend, its (out, dq, dk, dv), and what ran it (the kernel,
    ``+repeat_kv`` where it needed the key/value heads repeated); or None if the backend cannot run this shape or
    device."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    g = q.shape[1] // k.shape[1]
    kk, vv = k[:, :, ks].detach(), v[:, :, ks].detach()
    gqa = True  # native GQA where the backend supports it (or nothing to repeat), else K/V expanded outside the timed region
    if g > 1:
        try:
            with sdpa_kernel(sdp):
                F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, scale=scale, enable_gqa=True)
        except RuntimeError:
            kk, vv, gqa = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1), False
    qr, kr, vr = (x.detach().requires_grad_() for x in (q, kk, vv))

    def run():
        with sdpa_kernel(sdp):
            kw = {"enable_gqa": True} if gqa and g > 1 else {}
            return F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=scale, **kw)

    try:
        out = run()
        grads = torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
    except RuntimeError as e:
        print(f"  {backend} cannot run this shape: {str(e).splitlines()[0][:120]}")
        return None
    # Gradients back to the step's key/value shapes: GQA groups summed, hidden keys 0.
    dk, dv = torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)
    for full, part in ((dk, grads[1]), (dv, grads[2])):
        part = part.float()
        full[:, :, ks] = part if gqa else part.unflatten(1, (k.shape[1], g)).sum(2)
    result = (out.detach().float(), grads[0].float(), dk, dv)

    def fwd():
        with torch.no_grad():
            run()

    def bwd():
        torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)

    def both():
        torch.autograd.grad(run(), (qr, kr, vr), do)

    return (fwd, bwd, both), result, backend.removeprefix("sdpa-") + ("" if gqa else "+repeat_kv")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--impls", nargs="+", default=["triton", "sdpa", "cudnn", "sdpa-flash", "sdpa-cudnn"],
                   choices=[*OURS, "sdpa-flash", "sdpa-cudnn"])  # fmt: skip
    add_common_args(p)
    args = p.parse_args(argv)
    started = start(args, "bench_kernel.py")
    if started is None:
        return 0
    device, env = started
    from hf_ring.kernels.mask import BlockMask

    rows, inaccurate = Rows("bench_kernel", FIELDS, args.results_dir), []
    for d in args.head_dims:
        for seqlen in args.seqlens:
            b, hq, hkv = args.batch, args.q_heads, args.kv_heads
            q, k, v, do = random_inputs(args, seqlen, d, device, seed=seqlen * 1000 + d)
            scale = d**-0.5
            for kind in args.kinds:
                q_pos, k_pos, pairs, ks, causal = step_positions(kind, seqlen)
                mask = BlockMask(q_pos=q_pos, k_pos=k_pos, causal=True)
                fwd_flops = 4.0 * b * hq * d * pairs
                flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
                reference = reference_grads(q, k, v, do, ks, causal, scale)
                errors = {}
                for impl in args.impls:
                    made = backend_step(impl, q, k, v, do, mask, scale) if impl in OURS else (
                        sdpa_step(q, k, v, do, ks, causal, scale, impl))  # fmt: skip
                    if made is None:
                        continue
                    fns, result, op = made
                    errors[impl] = err = rel_err(result, reference)
                    del result
                    for name, fn in zip(PASSES, fns):
                        if name not in args.passes:
                            continue
                        ms = bench_ms(fn, device)
                        tflops = flops[name] / ms / 1e9
                        print(f"d={d:3d} L={seqlen:6d} {kind:12s} {impl:11s} {op:14s} {name:8s} {ms:9.3f} ms "
                              f"{tflops:7.1f} TFLOP/s  rel_err {err:.1e}")  # fmt: skip
                        rows.add({**env, "impl": impl, "op": op, "kind": kind, "pass": name, "dtype": args.dtype,
                                     "batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "seqlen": seqlen,
                                     "ms": f"{ms:.4f}", "tflops": f"{tflops:.2f}", "rel_err": f"{err:.3e}"})  # fmt: skip
                del reference
                # The low-precision rule of the test suite; without SDPA-flash, a plain sanity bound.
                bound = 2 * errors["sdpa-flash"] + 1e-3 if "sdpa-flash" in errors else 5e-2
                for impl in OURS:
                    if impl in errors and not errors[impl] <= bound:
                        inaccurate.append(f"{impl} d={d} L={seqlen} {kind}: rel_err {errors[impl]:.2e} > {bound:.2e}")
            del q, k, v, do
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return finish(rows, inaccurate, "ring step")


if __name__ == "__main__":
    sys.exit(main())
