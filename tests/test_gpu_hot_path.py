"""GPU-only checks of the hot path: PyTorch's fused CUDA ops per ring step, N virtual ranks through
``ring_attention`` on one GPU, and a steady state without host syncs; skipped without CUDA.

The CPU side of the same code (plans, rectangles, the CPU fused ops, copies, collectives per step)
is tested in test_plan.py and test_ring.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_ring
from hf_ring.kernels import BlockMask, get_backend, sdpa_backend, torch_backend

from .reference import backend_step, fused_op_calls, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
# Low precision: at most 2x the error of SDPA in the same dtype against fp32 attention, plus eps.
LOWP_FACTOR, LOWP_EPS = 2.0, 2e-4


def _rand(*shape, dtype, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(*shape, device=CUDA, generator=g).to(dtype)


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("backend,dtype,op", [
    ("sdpa", torch.bfloat16, "flash"), ("sdpa", torch.float16, "flash"), ("sdpa", torch.float32, "efficient"),
    ("cudnn", torch.bfloat16, "cudnn"), ("cudnn", torch.float16, "cudnn"),
])  # fmt: skip
def test_fused_cuda_steps_match_torch_backend(layout, backend, dtype, op, monkeypatch):
    world, full = 4, 4 * 1024
    pos = [hf_ring.positions(full, rank=r, world_size=world, layout=layout) for r in range(world)]
    q = _rand(2, 8, 1024, 128, dtype=dtype, seed=0)
    k, v = (_rand(2, 2, 1024, 128, dtype=dtype, seed=s) for s in (1, 2))
    do = _rand(2, 8, 1024, 128, dtype=dtype, seed=3)
    calls = fused_op_calls(monkeypatch)
    module = get_backend(backend, CUDA)
    for src in (0, 1, 3):
        mask = BlockMask(pos[1], pos[src], causal=True)
        mine = backend_step(module, q, k, v, do, mask, 0.09)
        ref = backend_step(torch_backend, q.float(), k.float(), v.float(), do.float(), mask, 0.09)
        low = backend_step(torch_backend, q, k, v, do, mask, 0.09)  # fp32 math on the rounded inputs
        for name, a, r, y in zip(("out", "dq", "dk", "dv"), mine, ref, low):
            if dtype == torch.float32:  # the same math in another order: rounding only
                assert rel_err(a, r) <= 1e-5, (layout, src, name)
            else:
                assert rel_err(a, r) <= LOWP_FACTOR * max(rel_err(y, r), 4e-3) + LOWP_EPS, (layout, src, name)
    ran = {name for name, _ in calls}
    assert ran == {op}, f"expected PyTorch's {op} op, ran {ran}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_efficient_op_runs_values_of_their_own_head_dim(dtype, monkeypatch):
    """Multi-head latent attention's shapes (keys 192, values 128): the memory-efficient op, not the fallback."""
    pos = hf_ring.positions(2048, rank=0, world_size=2)
    q, k = (_rand(1, 4, 1024, 192, dtype=dtype, seed=s) for s in (4, 5))
    v, do = (_rand(1, 4, 1024, 128, dtype=dtype, seed=s) for s in (6, 7))
    calls = fused_op_calls(monkeypatch)
    mask = BlockMask(pos, pos, causal=True)
    mine = backend_step(sdpa_backend, q, k, v, do, mask, 0.07)
    ref = backend_step(torch_backend, q.float(), k.float(), v.float(), do.float(), mask, 0.07)
    low = backend_step(torch_backend, q, k, v, do, mask, 0.07)
    for name, a, r, y in zip(("out", "dq", "dk", "dv"), mine, ref, low):
        bound = 1e-5 if dtype == torch.float32 else LOWP_FACTOR * max(rel_err(y, r), 4e-3) + LOWP_EPS
        assert rel_err(a, r) <= bound, name
    assert {name for name, _ in calls} == {"efficient"}


def _virtual_ring(n, layout, backend, dtype, tokens=1024, heads=(8, 2), d=128):
    """Every virtual rank's (out, dq) and the summed dK/dV through ring_attention with LoopbackComm,
    and fp32 SDPA on the full sequence."""
    hq, hkv = heads
    full = [_rand(1, h, n * tokens, d, dtype=dtype, seed=10 + i) for i, h in enumerate((hq, hkv, hkv, hq))]
    shards = [[hf_ring.shard(x, dim=2, rank=r, world_size=n, layout=layout) for x in full] for r in range(n)]
    blocks = [torch.stack([s[1], s[2]]) for s in shards]
    outs, dkv = [], [torch.zeros(2, 1, hkv, tokens, d, device=CUDA) for _ in range(n)]
    for r in range(n):
        q, k, v, do = shards[r]
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        comm = hf_ring.LoopbackComm(r, n, blocks, record=True)
        out = hf_ring.ring_attention(q, k, v, layout=layout, backend=backend, comm=comm)
        (dq,) = torch.autograd.grad(out, (q,), do, retain_graph=True)
        torch.autograd.grad(out, (k, v), do)
        for s, acc in enumerate(comm.sent):
            dkv[(r - s) % n] += acc
        outs.append((out, dq))
    qf, kf, vf, dof = (x.float().requires_grad_() for x in full)
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(ref, (qf, kf, vf), dof)
    errs = []
    for r in range(n):

        def part(x, r=r):
            return hf_ring.shard(x, dim=2, rank=r, world_size=n, layout=layout)

        mine = (*outs[r], dkv[r][0], dkv[r][1])
        refs = (part(ref.detach()), *(part(g) for g in grads))
        errs.append([rel_err(a, b) for a, b in zip(mine, refs)])
    return errs


@pytest.mark.parametrize("backend", ["sdpa", "cudnn", "triton"])
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_virtual_ranks_through_ring_attention(backend, layout):
    for rank, errs in enumerate(_virtual_ring(4, layout, backend, torch.bfloat16)):
        assert max(errs) <= 2e-2, f"rank {rank} {backend} {layout}: (out, dq, dk, dv) {errs}"


@pytest.mark.parametrize("backend", ["sdpa", "cudnn", "triton", "torch"])
def test_steady_state_forward_backward_without_host_sync(backend):
    """After the first call built the plan, a forward + backward through ring_attention (4 virtual
    ranks, the masks' positions on the device) makes no synchronising CUDA call."""
    n, tokens = 4, 1024
    full = [_rand(1, h, n * tokens, 128, dtype=torch.bfloat16, seed=20 + i) for i, h in enumerate((8, 2, 2, 8))]
    q, k, v, do = (hf_ring.shard(x, dim=2, rank=1, world_size=n) for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    blocks = [torch.stack([hf_ring.shard(x, dim=2, rank=r, world_size=n) for x in full[1:3]]) for r in range(n)]
    plans = hf_ring.PlanCache()

    def step():
        plans.new_batch()
        out = hf_ring.ring_attention(q, k, v, backend=backend, comm=hf_ring.LoopbackComm(1, n, blocks), plans=plans)
        torch.autograd.grad(out, (q, k, v), do)

    step()  # builds the plan: positions uploaded once, from pinned memory
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
