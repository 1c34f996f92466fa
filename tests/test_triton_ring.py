"""The whole ring with ``backend="triton"`` on 2 gloo ranks against plain attention on the unsharded sequence.

The cases of one test run in one launch (process start costs seconds); the kernels run in Triton's interpreter,
inherited by the ranks through TRITON_INTERPRET (set by conftest before the launch). ``make test`` runs each
feature once (``FEATURES``); the combinations of features run under ``make test-all``.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.kernels import triton_backend

from .dist_utils import run_distributed
from .reference import doc_ids_from_cu, reference_attention, rel_err, sdpa_attention

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_backend.interpreted()),
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)",
)

WORLD = 2
FULL = 56  # 2 ranks x 28 local tokens: zig-zag chunks of 14, ragged against the 32/16 interpreter tiles
# fp32: the same math as the float64 reference in another order: rounding only.
FP32_TOL = 1e-5
# fp16 (STYLE.md rule): at most 2x the error of PyTorch's SDPA in fp16 against float64, plus eps.
LOWP_FACTOR, LOWP_EPS = 2.0, 1e-4


def _cases() -> list[dict]:
    cu = torch.tensor([0, 9, 30, 30, 41, FULL], dtype=torch.int32)  # off the chunk edges, one empty doc
    pad = torch.arange(FULL)[None].repeat(2, 1)
    pad = torch.where(pad < torch.tensor([[FULL - 6], [FULL - 25]]), pad // 20, -1)  # docs, then right padding
    base = dict(batch=2, hq=4, hkv=2, d=64, dv=None, causal=True, window=None, cu=None, docs=None, layout="zigzag",
                alibi=False)  # fmt: skip
    return [
        dict(base),
        dict(base, causal=False, d=80),
        dict(base, batch=1, hq=8, hkv=2, d=128),
        dict(base, hkv=1),  # MQA
        dict(base, window=9),
        dict(base, window=9, causal=False, d=80),
        dict(base, batch=1, cu=cu),
        dict(base, docs=pad, hq=2, hkv=2),
        dict(base, layout="striped"),
        dict(base, layout="striped", batch=1, cu=cu, window=6),
        dict(base, layout="contiguous"),
        dict(base, layout="contiguous", window=13, causal=False),
        dict(base, batch=1, hq=4, hkv=4, d=48, dv=32, cu=cu),  # values with their own head_dim (MLA)
        dict(base, alibi=True),  # ALiBi's slopes (BLOOM, MPT), in the kernels
        dict(base, alibi=True, docs=pad, hq=2, hkv=2, layout="striped", window=11),
    ]


def _run_case(rank, world, case, dtype, seed):
    """Relative errors (out, dq, dk, dv) of this rank vs float64, and those of SDPA in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, d, lay = case["batch"], case["hq"], case["hkv"], case["d"], case["layout"]
    dv = case["dv"] or d
    q = torch.randn(b, hq, FULL, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, FULL, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, FULL, dv, generator=g).to(dtype)
    dout = torch.randn(b, hq, FULL, dv, generator=g).to(dtype)

    def part(x):
        return hf_ring.shard(x, dim=2, rank=rank, world_size=world, layout=lay)

    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    slopes = torch.tensor([0.5, 2**-0.5, 0.125, 0.0625])[:hq] if case["alibi"] else None
    out = hf_ring.ring_attention(
        ql, kl, vl, layout=lay, causal=case["causal"], sliding_window=case["window"],
        cu_seqlens=case["cu"], document_ids=case["docs"], backend="triton", alibi_slopes=slopes,
    )  # fmt: skip
    out.backward(part(dout))
    docs = case["docs"] if case["cu"] is None else doc_ids_from_cu(case["cu"], FULL)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, causal=case["causal"], window=case["window"], docs=docs, alibi=slopes)
    ref.backward(dout.double())
    refs = (part(ref), *(part(x.grad) for x in ref_in))
    mine = [rel_err(a, r) for a, r in zip((out, ql.grad, kl.grad, vl.grad), refs)]
    sdpa = None
    if dtype != torch.float32:
        sd_in = [x.clone().requires_grad_() for x in (q, k, v)]
        sd = sdpa_attention(*sd_in, causal=case["causal"], window=case["window"], docs=docs)
        sd.backward(dout)
        sdpa = [rel_err(part(a), r) for a, r in zip((sd, *(x.grad for x in sd_in)), refs)]
    return mine, sdpa


# each layout, causal and not, GQA, MQA, a window, packed and padded documents, MLA's value head_dim, ALiBi: once each
FEATURES = (0, 1, 3, 4, 6, 7, 8, 10, 12, 13)
COMBINATIONS = tuple(i for i in range(len(_cases())) if i not in FEATURES)
FP16 = (0, 7)  # (in FEATURES' launch)


def _worker(rank, world, which):
    biased = []  # the triton kernels' calls with ALiBi's slopes (not the torch backend's)
    for name in ("forward", "backward"):
        kernel = getattr(triton_backend, name)

        def spy(*args, _kernel=kernel, **kwargs):
            biased.append(kwargs.get("bias") is not None)
            return _kernel(*args, **kwargs)

        setattr(triton_backend, name, spy)
    cases = _cases()
    results = {"fp32": [_run_case(rank, world, cases[i], torch.float32, seed=i) for i in which]}
    results["biased_calls"] = sum(biased)
    results["fp16"] = [_run_case(rank, world, cases[i], torch.float16, seed=10 + i) for i in FP16 if i in which]
    return results


def _label(case):
    return {key: val for key, val in case.items() if not isinstance(val, torch.Tensor)}


def _check(which):
    cases = _cases()
    for rank, res in enumerate(run_distributed(_worker, WORLD, which, timeout=600)):
        for i, (errs, _) in zip(which, res["fp32"]):
            assert max(errs) <= FP32_TOL, f"rank {rank} fp32 {_label(cases[i])}: rel errors (out, dq, dk, dv) {errs}"
        # the ALiBi cases: the triton kernels took the slopes at every step, forward and backward
        assert res["biased_calls"] == sum(cases[i]["alibi"] for i in which) * 2 * WORLD > 0
        for i, (errs, sdpa) in zip([i for i in FP16 if i in which], res["fp16"]):
            for name, e, s in zip(("out", "dq", "dk", "dv"), errs, sdpa):
                assert e <= LOWP_FACTOR * s + LOWP_EPS, (
                    f"rank {rank} fp16 {_label(cases[i])} {name}: {e:.2e} vs SDPA {s:.2e}"
                )


def test_triton_ring_matches_plain_attention():
    _check(FEATURES)


@pytest.mark.slow  # (each feature alone runs above)
def test_triton_ring_matches_plain_attention_on_combined_features():
    _check(COMBINATIONS)
