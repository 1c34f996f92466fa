"""What context parallelism costs a Gated DeltaNet or Mamba2 layer's recurrence on one rank (CPU, Transformers'
kernels).

For N ranks of a zig-zag layout, each rank's shard (2 chunks of S / 2N tokens) runs forward + backward three
ways, timed side by side in one process (min / median of ``--repeat`` runs):

- ``local``: the kernel on the shard's chunks alone, no state from other ranks (what a rank would pay if the
  states were free: the lower bound);
- ``sharded``: ``hf_ring.linear_attention.gated_delta_rule`` (values widened by d_k) or ``mamba2_scan`` as a rank
  runs it (the states of every chunk composed, outputs corrected), with every chunk's state handed over
  in-process (no network);
- ``whole / N``: the unsharded kernel on the whole sequence, divided by N (the ideal per-rank share).

The ratio ``sharded / local`` is what the exact state passing costs in compute. Before timing, the sharded output
is checked against the whole sequence's at the rank's tokens (``rel_err``; exit 1 above 1e-5). Rows go to
``benchmarks/results/linear_cpu.csv`` (Gated DeltaNet) or ``mamba2_cpu.csv`` with the CPU, versions and date.
Examples:

    python benchmarks/bench_linear_cpu.py --seq-len 8192 --world 4
    python benchmarks/bench_linear_cpu.py --mixer mamba2 --seq-len 8192 --world 4
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
from hf_ring.linear_attention import chunks, gated_delta_rule, mamba2_scan  # noqa: E402

TIMES = ["local_ms", "sharded_ms", "whole_per_rank_ms", "sharded_vs_local", "rel_err"]
FIELDS = {  # per mixer: its shape's columns
    "gated_delta_net": ["k_heads", "v_heads", "d_k", "d_v"],
    "mamba2": ["heads", "head_dim", "groups", "d_state"],
}
HEAD = ["date", "cpu", "threads", "torch", "transformers", "seq_len", "world"]


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


def _inputs(shapes: list, seed=0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in shapes]


def _every(call, tensors: list, n: int, world: int) -> torch.Tensor:
    """Every chunk's carry, as each rank hands it to the all-gather (``call(tensors at its positions, plan,
    gather)``)."""
    sent = []
    with torch.no_grad():
        for r in range(world):
            p = L.positions(n, rank=r, world_size=world, layout="zigzag")
            record = _Recorded()
            try:
                call([t[:, p] for t in tensors], chunks(len(p), rank=r, world_size=world, layout="zigzag"), record)
            except _Sent:
                sent.append(record.sent)
    return torch.stack(sent)


def _gated_delta_net(args, n):
    """``(tensors, call, local, whole, shape columns)`` for the Gated DeltaNet's rule."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as kernel

    b, hk, hv, dk, dv = 1, args.k_heads, args.v_heads, args.d_k, args.d_v
    q, k, v, g, beta = _inputs([(b, n, hk, dk), (b, n, hk, dk), (b, n, hv, dv), (b, n, hv), (b, n, hv)])
    g, beta = -g.abs() / 4, beta.sigmoid()
    rep = (lambda t: t.repeat_interleave(hv // hk, dim=2)) if hv > hk else (lambda t: t)

    def call(ts, plan, gather):
        return gated_delta_rule(*ts, kernel=kernel, plan=plan, gather=gather, use_qk_l2norm_in_kernel=True)

    def plain(ts):
        return kernel(rep(ts[0]), rep(ts[1]), ts[2], g=ts[3], beta=ts[4], use_qk_l2norm_in_kernel=True)[0]

    return [q, k, v, g, beta], call, plain, {"k_heads": hk, "v_heads": hv, "d_k": dk, "d_v": dv}


def _mamba2(args, n):
    """The same for Mamba2's scan (Transformers' ``mamba2_chunk_scan``, chunk size 256 as Bamba's default)."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan as kernel

    b, h, p, groups, s = 1, args.heads, args.head_dim, args.groups, args.d_state
    x, dt, B, C = _inputs([(b, n, h, p), (b, n, h), (b, n, groups, s), (b, n, groups, s)])
    dt = torch.nn.functional.softplus(dt - 2)
    A, D = -torch.linspace(0.5, 4.0, h), torch.ones(h)

    def call(ts, plan, gather):
        return mamba2_scan(*ts[:2], A, *ts[2:], kernel=kernel, chunk_size=256, D=D, plan=plan, gather=gather)

    def plain(ts):
        return kernel(ts[0], ts[1], A, ts[2], ts[3], 256, D=D)

    return [x, dt, B, C], call, plain, {"heads": h, "head_dim": p, "groups": groups, "d_state": s}


def _timed(fn) -> float:
    start = time.perf_counter()
    out = fn()
    out.float().square().sum().backward()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixer", choices=sorted(FIELDS), default="gated_delta_net")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--k-heads", type=int, default=4, help="Gated DeltaNet")
    parser.add_argument("--v-heads", type=int, default=8, help="Gated DeltaNet")
    parser.add_argument("--d-k", type=int, default=64, help="Gated DeltaNet")
    parser.add_argument("--d-v", type=int, default=64, help="Gated DeltaNet")
    parser.add_argument("--heads", type=int, default=16, help="Mamba2")
    parser.add_argument("--head-dim", type=int, default=64, help="Mamba2")
    parser.add_argument("--groups", type=int, default=1, help="Mamba2")
    parser.add_argument("--d-state", type=int, default=128, help="Mamba2")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose shard is timed")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<mixer>_cpu.csv")
    args = parser.parse_args(argv)
    import transformers

    n, world = args.seq_len, args.world
    tensors, call, plain, columns = (_mamba2 if args.mixer == "mamba2" else _gated_delta_net)(args, n)
    every = _every(call, tensors, n, world)
    pos = L.positions(n, rank=args.rank, world_size=world, layout="zigzag")
    plan = chunks(len(pos), rank=args.rank, world_size=world, layout="zigzag")
    mine = [t[:, pos].detach().requires_grad_() for t in tensors]
    whole_inputs = [t.detach().requires_grad_() for t in tensors]

    def local():
        return plain([plan.split(t, dim=1).flatten(0, 1) for t in mine])

    def sharded():
        return call(mine, plan, _Handed(every))

    def whole():
        return plain(whole_inputs)

    with torch.no_grad():
        want = whole()[:, pos]
        err = float((sharded() - want).norm() / want.norm())
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
        **columns, "local_ms": round(med["local"], 1), "sharded_ms": round(med["sharded"], 1),
        "whole_per_rank_ms": round(med["whole"] / world, 1),
        "sharded_vs_local": round(med["sharded"] / med["local"], 2), "rel_err": f"{err:.1e}",
    }  # fmt: skip
    name = "linear" if args.mixer == "gated_delta_net" else args.mixer
    out = args.out or Path(__file__).parent / "results" / f"{name}_cpu.csv"
    print("rows appended to", append_rows(out, HEAD + FIELDS[args.mixer] + TIMES, [row]))
    return row


if __name__ == "__main__":
    main()
