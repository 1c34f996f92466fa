"""What context parallelism costs a Gated DeltaNet layer's recurrence on one rank (CPU, Transformers' kernel).

For N ranks of a zig-zag layout, each rank's shard (2 chunks of S / 2N tokens) runs forward + backward three
ways, timed side by side in one process (min / median of ``--repeat`` runs):

- ``local``: the kernel on the shard's chunks alone, no state from other ranks (what a rank would pay if the
  states were free: the lower bound);
- ``sharded``: ``hf_ring.linear_attention.gated_delta_rule`` as a rank runs it (values widened by d_k, the states
  of every chunk composed, outputs corrected), with every chunk's state handed over in-process (no network);
- ``whole / N``: the unsharded kernel on the whole sequence, divided by N (the ideal per-rank share).

The ratio ``sharded / local`` is what the exact state passing costs in compute. Before timing, the sharded output
is checked against the whole sequence's at the rank's tokens (``rel_err``; exit 1 above 1e-5). Rows go to
``benchmarks/results/linear_cpu.csv`` with the CPU, versions and date. Example:

    python benchmarks/bench_linear_cpu.py --seq-len 8192 --world 4
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
from hf_ring import layout as L  # noqa: E402
from hf_ring.linear_attention import chunks, gated_delta_rule  # noqa: E402

FIELDS = ["date", "cpu", "threads", "torch", "transformers", "seq_len", "world", "k_heads", "v_heads", "d_k", "d_v",
          "local_ms", "sharded_ms", "whole_per_rank_ms", "sharded_vs_local", "rel_err"]  # fmt: skip


class _Sent(Exception):  # noqa: N818 - not an error: the recording stops the rank's call there
    pass


class _Recorded:
    """Stands in for the all-gather in a rank's call: keeps what the rank sends and stops the call there."""

    sent = None

    def gather(self, x):
        self.sent = x
        raise _Sent


class _Handed:
    """Every chunk's state, handed to the rank in-process (stands in for the all-gather)."""

    def __init__(self, every):
        self.every = every

    def gather(self, x):
        return self.every


def _inputs(b, n, hk, hv, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, n, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, n, hv, dv, generator=g)
    return [
        t.requires_grad_() for t in (q, k, v, -torch.rand(b, n, hv, generator=g), torch.rand(b, n, hv, generator=g))
    ]


def _timed(fn) -> float:
    start = time.perf_counter()
    out = fn()
    out.float().square().sum().backward()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--k-heads", type=int, default=4)
    parser.add_argument("--v-heads", type=int, default=8)
    parser.add_argument("--d-k", type=int, default=64)
    parser.add_argument("--d-v", type=int, default=64)
    parser.add_argument("--rank", type=int, default=0, help="the rank whose shard is timed")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "linear_cpu.csv")
    args = parser.parse_args(argv)
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as kernel

    n, world = args.seq_len, args.world
    shape = (1, n, args.k_heads, args.v_heads, args.d_k, args.d_v)
    q, k, v, g, beta = _inputs(*shape)
    groups = args.v_heads // args.k_heads
    rep = (lambda t: t.repeat_interleave(groups, dim=2)) if groups > 1 else (lambda t: t)
    pos = L.positions(n, rank=args.rank, world_size=world, layout="zigzag")
    plan = chunks(len(pos), rank=args.rank, world_size=world, layout="zigzag")
    with torch.no_grad():  # every chunk's [F | P], as each rank hands them to the all-gather
        sent = []
        for r in range(world):
            p = L.positions(n, rank=r, world_size=world, layout="zigzag")
            record = _Recorded()
            try:
                gated_delta_rule(q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], kernel=kernel, gather=record,
                                 plan=chunks(len(p), rank=r, world_size=world, layout="zigzag"),
                                 use_qk_l2norm_in_kernel=True)  # fmt: skip
            except _Sent:
                sent.append(record.sent)
        every = torch.stack(sent)
    mine = [t[:, pos].detach().requires_grad_() for t in (q, k, v, g, beta)]

    def local():
        runs = [plan.split(t, dim=1).flatten(0, 1) for t in mine]
        return kernel(rep(runs[0]), rep(runs[1]), runs[2], g=runs[3], beta=runs[4], use_qk_l2norm_in_kernel=True)[0]

    def sharded():
        return gated_delta_rule(*mine, kernel=kernel, plan=plan, gather=_Handed(every), use_qk_l2norm_in_kernel=True)

    def whole():
        return kernel(rep(q), rep(k), v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    with torch.no_grad():
        err = float((sharded() - whole()[:, pos]).norm() / whole()[:, pos].norm())
    if not err <= 1e-5:
        print(f"the sharded output differs from the whole sequence's by {err:.2e}")
        sys.exit(1)
    times = {"local": [], "sharded": [], "whole": []}
    for _ in range(args.repeat):  # side by side, interleaved
        for name, fn in (("local", local), ("sharded", sharded), ("whole", whole)):
            times[name].append(_timed(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:8s} min {min(t):9.1f} ms  median {statistics.median(t):9.1f} ms")
    print(f"sharded / local {med['sharded'] / med['local']:.2f}x; whole / N {med['whole'] / world:.1f} ms")
    row = {
        "date": datetime.date.today().isoformat(), "cpu": cpu_name(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "seq_len": n, "world": world,
        "k_heads": args.k_heads, "v_heads": args.v_heads, "d_k": args.d_k, "d_v": args.d_v,
        "local_ms": round(med["local"], 1), "sharded_ms": round(med["sharded"], 1),
        "whole_per_rank_ms": round(med["whole"] / world, 1),
        "sharded_vs_local": round(med["sharded"] / med["local"], 2), "rel_err": f"{err:.1e}",
    }  # fmt: skip
    print("rows appended to", append_rows(args.out, FIELDS, [row]))
    return row


if __name__ == "__main__":
    main()
