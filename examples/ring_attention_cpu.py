"""Ring attention on 2 CPU processes: exactness against plain attention, and the bytes each rank sent.

    torchrun --nproc_per_node 2 examples/ring_attention_cpu.py [--seq-len 4096] [--layout zigzag]

Every rank builds the same full q/k/v (same seed), keeps its zig-zag shard, runs
``hf_ring.ring_attention`` forward and backward, and compares its output and gradients with plain
attention computed on the whole, unsharded sequence.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_ring


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--layout", default="zigzag", choices=hf_ring.LAYOUTS)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    s, d = args.seq_len, args.head_dim
    q = torch.randn(1, args.heads, s, d, generator=g)
    k = torch.randn(1, args.kv_heads, s, d, generator=g)
    v = torch.randn(1, args.kv_heads, s, d, generator=g)
    dout = torch.randn(1, args.heads, s, d, generator=g)

    def part(x):
        return hf_ring.shard(x, dim=2, rank=rank, world_size=world, layout=args.layout)

    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    comm = hf_ring.RingComm()
    out = hf_ring.ring_attention(ql, kl, vl, layout=args.layout, comm=comm)
    fwd_bytes = comm.bytes_sent
    out.backward(part(dout))

    # plain attention on the unsharded sequence (K/V repeated to the query heads only here)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    group = args.heads // args.kv_heads
    ref = F.scaled_dot_product_attention(
        ref_in[0], ref_in[1].repeat_interleave(group, 1), ref_in[2].repeat_interleave(group, 1), is_causal=True
    )
    ref.backward(dout.double())

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    errs = {
        "out": err(out, part(ref)),
        "dq": err(ql.grad, part(ref_in[0].grad)),
        "dk": err(kl.grad, part(ref_in[1].grad)),
        "dv": err(vl.grad, part(ref_in[2].grad)),
    }
    expected = 2 * (world - 1) * kl.numel() * kl.element_size()
    for r in range(world):
        if r == rank:
            print(
                f"rank {rank}: positions {ql.shape[2]} of {s} ({args.layout}); relative error vs plain attention "
                + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
                + f"; forward sent {fwd_bytes} bytes (2*(N-1)*kv block = {expected}), forward+backward {comm.bytes_sent}",
                flush=True,
            )
        dist.barrier()
    ok = max(errs.values()) < 1e-5 and fwd_bytes == expected
    if rank == 0:
        print("exact: yes" if ok else "exact: NO", flush=True)
    dist.barrier()  # (every rank alive while the group closes: gloo can abort a process left alone)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
