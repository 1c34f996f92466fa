"""RecurrentGemma's RG-LRU recurrence, forward + backward: the model's loop over tokens against hf_ring's scan by
doubling (``hf_ring._scans.Recurrence``), side by side in one process (CPU).

``h_t = a_t * h_{t-1} + x_t`` over ``[1, seq, channels]`` fp32 (RecurrentGemma-2B's 2560 channels by default). The
model's ``_rnn_scan`` writes each state into its output in place, so its backward's work grows with the square of
the length; hf_ring's scan takes ``log2(seq)`` vectorised steps each way. Before timing, both outputs and input
gradients are compared (``rel_err``; exit 1 above 1e-5). Each length appends a row (CPU, threads, versions, date,
min / median milliseconds of each, their ratio) to ``benchmarks/results/scan_cpu.csv`` (or ``--out``).

    python benchmarks/bench_scan_cpu.py --seq-lens 256 512 1024 --channels 2560
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._cpu import append_rows, cpu_name  # noqa: E402
from hf_ring import linear_attention  # noqa: E402

FIELDS = ["date", "cpu", "threads", "torch", "transformers", "seq_len", "channels", "loop_min_ms", "loop_median_ms",
          "scan_min_ms", "scan_median_ms", "loop_vs_scan", "rel_err"]  # fmt: skip


def _loop(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The model's own recurrence (Transformers' ``RecurrentGemmaRglru._rnn_scan``), no reset."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    reset = torch.zeros(*a.shape[:2], 1, dtype=torch.bool)
    return RecurrentGemmaRglru._rnn_scan(None, x, a, reset, None)[0]


def _run(fn, a, x, grad):
    """One forward + backward: (output, da, dx)."""
    a, x = a.detach().requires_grad_(), x.detach().requires_grad_()
    out = fn(a, x)
    da, dx = torch.autograd.grad(out, (a, x), grad)
    return out.detach(), da, dx


def _ms(fn, a, x, grad, repeat: int) -> list:
    _run(fn, a, x, grad)  # (warm-up)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        _run(fn, a, x, grad)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def main(argv=None) -> int:
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--channels", type=int, default=2560)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "scan_cpu.csv")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    wrong = []
    for n in args.seq_lens:
        g = torch.Generator().manual_seed(n)
        a = torch.rand(1, n, args.channels, generator=g) * 0.1 + 0.9  # (decays near 1: states carry far)
        x = torch.randn(1, n, args.channels, generator=g)
        grad = torch.randn(1, n, args.channels, generator=g)
        scan_fn = linear_attention.Recurrence.apply
        ref, mine = _run(_loop, a, x, grad), _run(scan_fn, a, x, grad)
        err = max(float((m - r).norm() / r.norm()) for m, r in zip(mine, ref))
        if not err <= 1e-5:
            wrong.append(f"seq {n}: rel_err {err:.2e}")
        loop, scan = _ms(_loop, a, x, grad, args.repeat), _ms(scan_fn, a, x, grad, args.repeat)
        row = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "threads": args.threads,
               "torch": torch.__version__, "transformers": transformers.__version__, "seq_len": n,
               "channels": args.channels, "loop_min_ms": f"{min(loop):.3f}",
               "loop_median_ms": f"{statistics.median(loop):.3f}", "scan_min_ms": f"{min(scan):.3f}",
               "scan_median_ms": f"{statistics.median(scan):.3f}",
               "loop_vs_scan": f"{statistics.median(loop) / statistics.median(scan):.2f}", "rel_err": f"{err:.1e}"}  # fmt: skip
        print(f"seq {n:6d} x {args.channels} fp32 fwd+bwd: loop {row['loop_median_ms']} ms, scan "
              f"{row['scan_median_ms']} ms ({row['loop_vs_scan']}x), rel_err {err:.1e}")  # fmt: skip
        append_rows(args.out, FIELDS, [row])
    for line in wrong:
        print("INACCURATE scan:", line)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
