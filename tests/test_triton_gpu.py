"""GPU-only checks of the compiled Triton kernels (and of flash-attn where installed); skipped without CUDA.

Long shapes, bf16/fp16 and the default (GPU) tile configurations, forward and backward against a
float64 reference and PyTorch's SDPA in the same dtype (STYLE.md low-precision rule).
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_ring
from hf_ring.kernels import flash_backend, torch_backend, triton_backend
from hf_ring.kernels.mask import BlockMask

from .reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
# Low precision: at most 2x the error of SDPA in the same dtype against float64, plus eps.
LOWP_FACTOR, LOWP_EPS = 2.0, 2e-4
# fp32 inputs run IEEE fp32 dots: rounding only.
FP32_TOL = 2e-5


def _rand(*shape, dtype, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(*shape, device=CUDA, generator=g, dtype=torch.float32).to(dtype)


def _step(backend, q, k, v, do, mask, scale):
    b, hq, lq, _ = q.shape
    out = torch.zeros(b, hq, lq, v.shape[-1], device=CUDA)
    lse = torch.full((b, hq, lq), -math.inf, device=CUDA)
    backend.forward(q, k, v, mask, scale, out, lse)
    delta = (do.float() * out).sum(-1)
    dq = torch.zeros(q.shape, device=CUDA)
    dk, dv = torch.zeros(k.shape, device=CUDA), torch.zeros(v.shape, device=CUDA)
    backend.backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, out=out.to(q.dtype))
    return out, dq, dk, dv


def _dense(q, k, v, do, mask: BlockMask, scale, dtype):
    """Masked attention and its autograd gradients in ``dtype``: (out, dq, dk, dv).

    Matmuls in ``dtype``, softmax in fp32 (or float64), GQA by repeating K/V; rows that see no key
    give 0 (not NaN, which SDPA's math path would produce for them).
    """
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    kk, vv = xs[1].repeat_interleave(g, 1), xs[2].repeat_interleave(g, 1)
    s = (xs[0] @ kk.transpose(-1, -2)).float() if dtype != torch.float64 else xs[0] @ kk.transpose(-1, -2)
    vis = mask.visible().to(CUDA)[:, None]
    s = (s * scale).masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)).to(dtype)
    o = p @ vv
    o.backward(do.to(dtype))
    return (o.detach(), *(x.grad for x in xs))


CASES = {
    "causal-2k-d128-gqa4": dict(b=1, hq=8, hkv=2, lq=2048, lk=2048, d=128, q_off=0, causal=True),
    "full-1000x1500-d80": dict(b=2, hq=4, hkv=4, lq=1000, lk=1500, d=80, q_off=0, causal=False),
    "zigzag-half-d64": dict(b=1, hq=8, hkv=2, lq=2048, lk=2048, d=64, q_off=2048, causal=True),
    "window-d256": dict(b=1, hq=4, hkv=1, lq=1024, lk=1024, d=256, q_off=0, causal=True, window=300),
    "docs-d128": dict(b=2, hq=4, hkv=2, lq=1536, lk=1536, d=128, q_off=0, causal=True, docs=True),
    # DeepSeek's multi-head latent attention: queries / keys 192, values 128 (the head_dim-256 tiles)
    "mla-zigzag-d192-dv128": dict(b=1, hq=8, hkv=8, lq=2048, lk=2048, d=192, dv=128, q_off=2048, causal=True),
}


def _mask(c) -> BlockMask:
    qp = torch.arange(c["lq"]) + c["q_off"]
    kp = torch.arange(c["lk"])
    qd = kd = None
    if c.get("docs"):
        qd = (qp // 500).to(torch.int32)[None].repeat(c["b"], 1)
        kd = (kp // 500).to(torch.int32)[None].repeat(c["b"], 1)
        qd[1, -100:] = -1
        kd[1, -100:] = -1
    return BlockMask(qp, kp, c["causal"], c.get("window"), qd, kd)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_match_sdpa_on_gpu(name, dtype):
    c = CASES[name]
    q = _rand(c["b"], c["hq"], c["lq"], c["d"], dtype=dtype, seed=0)
    k = _rand(c["b"], c["hkv"], c["lk"], c["d"], dtype=dtype, seed=1)
    v = _rand(c["b"], c["hkv"], c["lk"], c.get("dv", c["d"]), dtype=dtype, seed=2)
    do = _rand(c["b"], c["hq"], c["lq"], c.get("dv", c["d"]), dtype=dtype, seed=3)
    mask, scale = _mask(c), c["d"] ** -0.5
    mine = _step(triton_backend, q, k, v, do, mask, scale)
    ref = _dense(q, k, v, do, mask, scale, torch.float64)
    errs = [rel_err(a, r) for a, r in zip(mine, ref)]
    if dtype == torch.float32:
        assert max(errs) <= FP32_TOL, f"rel errors (out, dq, dk, dv) {errs}"
        return
    yard = [rel_err(a, r) for a, r in zip(_dense(q, k, v, do, mask, scale, dtype), ref)]
    for n, e, y in zip(("out", "dq", "dk", "dv"), errs, yard):
        assert e <= LOWP_FACTOR * y + LOWP_EPS, f"{n}: {e:.2e} vs SDPA {y:.2e}"


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_one_gpu_bf16_matches_sdpa(layout):
    """ring_attention(backend="triton") without a group (one rank) on a long bf16 sequence."""
    q = _rand(1, 8, 4096, 128, dtype=torch.bfloat16, seed=4).requires_grad_()
    k = _rand(1, 2, 4096, 128, dtype=torch.bfloat16, seed=5).requires_grad_()
    v = _rand(1, 2, 4096, 128, dtype=torch.bfloat16, seed=6).requires_grad_()
    do = _rand(1, 8, 4096, 128, dtype=torch.bfloat16, seed=7)
    out = hf_ring.ring_attention(q, k, v, layout=layout, backend="triton")
    out.backward(do)
    mine = (out, q.grad, k.grad, v.grad)
    mask = BlockMask(torch.arange(4096), torch.arange(4096), True)
    ref = _dense(q, k, v, do, mask, 128**-0.5, torch.float32)
    yard = _dense(q, k, v, do, mask, 128**-0.5, torch.bfloat16)
    for n, a, y, r in zip(("out", "dq", "dk", "dv"), mine, yard, ref):
        assert rel_err(a, r) <= LOWP_FACTOR * rel_err(y, r) + LOWP_EPS, n


def test_values_of_their_own_head_dim_through_two_virtual_ranks_bf16():
    """DeepSeek's 192 / 128 through ring_attention over 2 virtual ranks: the keys and values travel side by side in
    one message and reach the kernels as strided views of it."""
    from .reference import virtual_ring

    q, k = _rand(1, 8, 2048, 192, dtype=torch.bfloat16, seed=8), _rand(1, 8, 2048, 192, dtype=torch.bfloat16, seed=9)
    v, do = _rand(1, 8, 2048, 128, dtype=torch.bfloat16, seed=10), _rand(1, 8, 2048, 128, dtype=torch.bfloat16, seed=11)
    mine = virtual_ring(q, k, v, do, 2, "zigzag", backend="triton")
    mask = BlockMask(torch.arange(2048), torch.arange(2048), True)
    ref = _dense(q, k, v, do, mask, 192**-0.5, torch.float32)
    yard = _dense(q, k, v, do, mask, 192**-0.5, torch.bfloat16)
    for n, a, y, r in zip(("out", "dq", "dk", "dv"), mine, yard, ref):
        assert rel_err(a, r) <= LOWP_FACTOR * rel_err(y, r) + LOWP_EPS, n


def test_torch_compile_on_gpu():
    q, k, v = (_rand(1, 4, 1024, 64, dtype=torch.bfloat16, seed=s) for s in (8, 9, 10))

    def f(q, k, v):
        return hf_ring.ring_attention(q, k, v, backend="triton").float().square().sum()

    torch.testing.assert_close(torch.compile(f)(q, k, v), f(q, k, v), rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not flash_backend.available(), reason="flash_attn is not installed")
@pytest.mark.parametrize("q_runs,k_runs", [
    ([(0, 512), (1536, 2048)], [(0, 512), (1536, 2048)]),  # zig-zag diagonal step
    ([(512, 1024), (1024, 1536)], [(0, 512), (1536, 2048)]),  # zig-zag half-visible step
    ([(0, 1024)], [(0, 1024)]),  # contiguous diagonal
])  # fmt: skip
def test_flash_backend_matches_triton(q_runs, k_runs):
    qp = torch.cat([torch.arange(a, b) for a, b in q_runs])
    kp = torch.cat([torch.arange(a, b) for a, b in k_runs])
    mask = BlockMask(qp, kp, True)
    assert flash_backend.plan(mask) is not None
    q = _rand(2, 8, qp.numel(), 128, dtype=torch.bfloat16, seed=11)
    k, v = (_rand(2, 2, kp.numel(), 128, dtype=torch.bfloat16, seed=s) for s in (12, 13))
    do = _rand(2, 8, qp.numel(), 128, dtype=torch.bfloat16, seed=14)
    mine = _step(flash_backend, q, k, v, do, mask, 0.1)
    ref = _step(torch_backend, q, k, v, do, mask, 0.1)
    for n, a, r in zip(("out", "dq", "dk", "dv"), mine, ref):
        assert rel_err(a, r) <= 1e-2, n  # flash-attn rounds each block's output to bf16 once


N_BLOCKS = 4096


@pytest.mark.parametrize("window", [None, 1024])
def test_bidirectional_blocks_through_two_virtual_ranks_bf16(window):
    """Gemma 3's image blocks (256 tokens, one across the zig-zag chunk edge) on the compiled kernels, bf16, with
    and without its sliding window, against dense attention with the blockwise mask."""
    from .reference import dense_mask, virtual_ring

    n = N_BLOCKS
    q, do = _rand(1, 8, n, 128, dtype=torch.bfloat16, seed=12), _rand(1, 8, n, 128, dtype=torch.bfloat16, seed=13)
    k, v = _rand(1, 4, n, 128, dtype=torch.bfloat16, seed=14), _rand(1, 4, n, 128, dtype=torch.bfloat16, seed=15)
    blocks = torch.full((1, n), -1)
    blocks[0, 300:556] = 0
    blocks[0, 900:1156] = 1  # zig-zag over 2 ranks: chunks of 1024, this image spans the edge at 1024
    mine = virtual_ring(q, k, v, do, 2, "zigzag", backend="triton", window=window, blocks=blocks)
    vis = dense_mask(n, True, window, None, blocks)[0, 0]

    class _Mask:  # the dense mask in BlockMask's place for _dense
        def visible(self):
            return vis[None]

    ref = _dense(q, k, v, do, _Mask(), 128**-0.5, torch.float32)
    yard = _dense(q, k, v, do, _Mask(), 128**-0.5, torch.bfloat16)
    for name, a, y, r in zip(("out", "dq", "dk", "dv"), mine, yard, ref):
        assert rel_err(a, r) <= LOWP_FACTOR * rel_err(y, r) + LOWP_EPS, name
