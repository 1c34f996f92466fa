"""Attention logit softcapping and learned attention sinks in ``ring_attention``, against float64 plain attention.

Softcapping (Gemma2: scores ``s`` become ``cap * tanh(s / cap)`` before masking) runs inside every
ring step, on every backend (torch; triton, in its CPU interpreter here; sdpa and flash_attn on their
fallback where their fused kernels cannot); sinks (gpt-oss: one extra logit per head with no value)
are merged once into the final LSE of the whole ring. Both are checked forward and backward (the
sink's gradient included) at 1 rank in-process and on a real 2-rank gloo group, over layouts, GQA,
windows, packed documents and fully padded rows.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.kernels import torch_backend

from .dist_utils import run_distributed
from .reference import doc_ids_from_cu, reference_attention, rel_err

FP32_TOL = 1e-5  # fp32 against float64: rounding and summation order only
CAP = 4.0  # small enough that tanh bends the scores of these random inputs (|s| up to ~8)


def _cases(full: int) -> list[dict]:
    cu = torch.tensor([0, 7, 20, 33, full], dtype=torch.int32)
    pad = torch.where(torch.arange(full)[None].repeat(2, 1) < torch.tensor([[full - 9], [full - 20]]), 0, -1)
    base = dict(layout="zigzag", batch=2, hq=4, hkv=2, d=32, causal=True, window=None, cu=None, docs=None)
    return [
        dict(base, softcap=CAP),
        dict(base, sinks=True),
        dict(base, softcap=CAP, sinks=True, window=9, layout="striped"),
        dict(base, softcap=CAP, batch=1, cu=cu, hkv=1),
        dict(base, sinks=True, batch=1, cu=cu, layout="contiguous"),
        dict(base, softcap=CAP, sinks=True, docs=pad),  # padded rows: zeros, never NaN
        dict(base, softcap=CAP, causal=False, hq=2),
        dict(base, sinks="per query", window=9, docs=pad),  # (Inkling 2: a sink projected from each token)
        dict(base, sinks="per query", batch=1, cu=cu, layout="striped", hkv=1),
    ]


def _run(rank: int, world: int, case: dict, backend: str) -> dict:
    full = 48
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d = case["batch"], case["hq"], case["hkv"], case["d"]
    q, dout = (torch.randn(b, hq, full, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hkv, full, d, generator=g) for _ in range(2))
    per_query = case.get("sinks") == "per query"
    sinks = torch.randn((b, hq, full) if per_query else (hq,), generator=g) if case.get("sinks") else None

    def part(x):
        return hf_ring.shard(x, dim=2, rank=rank, world_size=world, layout=case["layout"])

    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    sl = None if sinks is None else (part(sinks) if per_query else sinks.clone()).requires_grad_()
    out = hf_ring.ring_attention(
        ql, kl, vl, layout=case["layout"], causal=case["causal"], sliding_window=case["window"],
        softcap=case.get("softcap"), sinks=sl, cu_seqlens=case["cu"], document_ids=case["docs"], backend=backend,
    )  # fmt: skip
    out.backward(part(dout))
    docs = case["docs"] if case["cu"] is None else doc_ids_from_cu(case["cu"], full)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.double().requires_grad_()
    ref = reference_attention(
        *ref_in, causal=case["causal"], window=case["window"], docs=docs, softcap=case.get("softcap"), sinks=ref_sinks
    )
    ref.backward(dout.double())
    errs = [
        rel_err(a, r) for a, r in zip((out, ql.grad, kl.grad, vl.grad), (part(ref), *(part(x.grad) for x in ref_in)))
    ]
    return {
        "errs": errs,
        "finite": bool(torch.isfinite(out).all()),
        "dsinks": None if sl is None else sl.grad,  # this rank's rows' share: the shares sum to the gradient
        "ref_dsinks": None if sinks is None else (part(ref_sinks.grad) if per_query else ref_sinks.grad),
    }


def _backends() -> tuple:
    """torch (the reference backend), sdpa (PyTorch's fused ops; softcapped steps on its fallback) and auto
    everywhere; triton where it runs (CUDA, or its CPU interpreter)."""
    from hf_ring.kernels import triton_backend

    runs_triton = torch.cuda.is_available() or triton_backend.interpreted()
    return ("torch", "sdpa", "auto", "triton") if runs_triton else ("torch", "sdpa", "auto")


def _worker(rank: int, world: int) -> list:
    torch_backend.BLOCK_Q = torch_backend.BLOCK_K = 8  # many tiles: exercise tile classes and edges
    return [{b: _run(rank, world, case, b) for b in _backends()} for case in _cases(48)]


def _check(per_rank: list) -> None:
    for i, case in enumerate(_cases(48)):
        label = {k: v for k, v in case.items() if not isinstance(v, torch.Tensor)}
        for backend in per_rank[0][i]:
            runs = [r[i][backend] for r in per_rank]
            for rank, run in enumerate(runs):
                assert run["finite"], (label, backend, rank)
                assert max(run["errs"]) <= FP32_TOL, f"{label} {backend} rank {rank}: (out, dq, dk, dv) {run['errs']}"
            if case.get("sinks") == "per query":  # each rank's queries' own
                assert all(rel_err(run["dsinks"], run["ref_dsinks"]) <= FP32_TOL for run in runs), (label, backend)
            elif case.get("sinks"):
                total = sum(run["dsinks"] for run in runs)
                assert rel_err(total, runs[0]["ref_dsinks"]) <= FP32_TOL, (label, backend)


@pytest.mark.slow  # (the two-rank run below goes through the same steps, and the ring besides)
def test_softcap_and_sinks_one_rank():
    _check([_worker(0, 1)])


def test_softcap_and_sinks_two_ranks():
    _check(run_distributed(_worker, 2, timeout=300))


def test_softcapping_changes_the_result_and_sinks_take_probability():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g) * 3 for _ in range(3))
    plain = hf_ring.ring_attention(q, k, v)
    assert rel_err(hf_ring.ring_attention(q, k, v, softcap=CAP), plain) > 1e-2
    # a sink far above every score (|s| < 60 here) takes nearly all the probability: the output shrinks to 0
    assert hf_ring.ring_attention(q, k, v, sinks=torch.full((2,), 100.0)).abs().max() < 1e-6


def test_every_backend_implements_softcapping_and_one_without_it_is_refused():
    import types

    from hf_ring.kernels import BACKENDS, get_backend, unsupported_by

    q = k = v = torch.randn(1, 2, 16, 16)
    for name in BACKENDS:
        assert get_backend(name, q.device, q.dtype).SOFTCAP, name
    without = types.SimpleNamespace(__name__="a backend without softcapping", forward=None, backward=None)
    assert "softcapping is not implemented by a backend without softcapping" in unsupported_by(
        without, q, k, v, softcap=CAP
    )
    assert unsupported_by(without, q, k, v) is None
    want = reference_attention(q, k, v, softcap=CAP)
    assert rel_err(hf_ring.ring_attention(q, k, v, softcap=CAP, backend="flash_attn"), want) <= FP32_TOL
    for bad, match in ((0.0, "softcap must be a positive finite number"), (float("inf"), "softcap must be")):
        with pytest.raises(ValueError, match=match):
            hf_ring.ring_attention(q, k, v, softcap=bad)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor \[q_heads=2\]"):
        hf_ring.ring_attention(q, k, v, sinks=torch.zeros(3))
