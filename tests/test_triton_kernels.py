"""The Triton ring-step kernels against the torch backend and a float64 dense reference.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes are
small; tiles of 16/32 make every shape span several tiles, with ragged last tiles (40, 72) and
tile classes of every kind (empty, full, partial; full runs that are and are not contiguous).
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_ring.kernels import torch_backend, triton_backend
from hf_ring.kernels.mask import BlockMask
from hf_ring.kernels.triton_backend import KernelConfig

from .reference import rel_err

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not triton_backend.interpreted(),
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)",
)


# Small tiles on any device, so that the test shapes cross tile edges (the interpreter default
# is the same size; on a GPU this keeps fp16 inputs on the tensor-core path).
def _tiles(m, n, scan, upcast=DEVICE.type == "cpu"):
    """The same ``m`` x ``n`` tiles for the forward, dQ (m queries, n keys) and dK/dV (m keys, n queries)."""
    return KernelConfig(block_m=m, block_n=n, num_warps=4, num_stages=1, dq_block_m=m, dq_block_n=n,
                        dq_num_warps=4, dq_num_stages=1, dkv_block_n=m, dkv_block_m=n, dkv_num_warps=4,
                        dkv_num_stages=1, scan=scan, upcast=upcast)  # fmt: skip


SMALL = _tiles(32, 16, scan=4)
SQUARE = _tiles(16, 16, scan=2)

# fp32: same math as the torch backend / float64 in another order: rounding only.
FP32_TOL = 1e-5
# fp16 (STYLE.md rule): error vs float64 at most 2x that of attention computed in fp16, plus eps.
LOWP_FACTOR, LOWP_EPS = 2.0, 1e-4


def _cat(*ranges):
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def _docs(pos: torch.Tensor, bounds, batch: int, pad=()) -> torch.Tensor:
    """[batch, L] int32 ids: document = number of bounds <= position; positions in ``pad`` get -1."""
    d = torch.bucketize(pos, torch.tensor(bounds), right=True).to(torch.int32)
    d = d[None].repeat(batch, 1)
    for row, lo, hi in pad:
        d[row, (pos >= lo) & (pos < hi)] = -1
    return d


def _case(name, q_pos, k_pos, *, b=1, hq=2, hkv=1, d=64, dv=None, causal=True, window=None, q_doc=None, k_doc=None):
    """``dv``: the values' head_dim when it differs from ``d`` (multi-head latent attention)."""
    return pytest.param(dict(b=b, hq=hq, hkv=hkv, d=d, dv=dv or d, q_pos=q_pos, k_pos=k_pos, causal=causal,
                             window=window, q_doc=q_doc, k_doc=k_doc), id=name)  # fmt: skip


A40, A72, A96 = torch.arange(40), torch.arange(72), torch.arange(96)
ZZ = _cat((0, 24), (72, 96))  # a zig-zag shard: two contiguous halves
P72 = torch.arange(0, 144, 2)  # positions with a stride (striped layout)

CASES = [
    _case("none", A40, A40, causal=False),
    _case("none-ragged-gqa4", A40, A72, hq=4, hkv=1, d=80, causal=False),
    _case("causal-diag", A72, A72, hq=4, hkv=2),
    _case("causal-offset", A40 + 24, A72, hq=2, hkv=2, d=128),  # keys past the queries: empty tiles
    _case("causal-empty-rows", A40, A72 + 20, hq=4, hkv=2),  # the first 20 queries see nothing
    _case("zigzag-diag-gqa4", ZZ, ZZ, hq=4, hkv=1, d=128),
    _case("zigzag-half-visible", _cat((24, 72)), ZZ, hq=2, hkv=2, d=80),
    _case("striped", P72 + 1, P72, hq=2, hkv=1),
    _case("window-causal", A72, A72, hq=4, hkv=2, d=80, window=13),
    _case("window-noncausal", A40 + 16, A72, hq=2, hkv=1, window=9, causal=False),
    _case("window-2", A40, A40, window=2),  # one neighbour: dense tiles are mostly empty
    _case("docs-causal-pad", A72, A72, b=2, hq=4, hkv=2,
          q_doc=_docs(A72, [20, 45], 2, pad=[(1, 60, 72)]), k_doc=_docs(A72, [20, 45], 2, pad=[(1, 60, 72)])),
    _case("docs-noncausal-shared", A40, A72, b=2, causal=False,
          q_doc=_docs(A40, [7, 33], 1), k_doc=_docs(A72, [7, 33, 50], 1)),
    _case("docs-window-gqa4", ZZ, ZZ, hq=4, hkv=1, d=80, window=11,
          q_doc=_docs(ZZ, [10, 80], 1), k_doc=_docs(ZZ, [10, 80], 1)),
    _case("docs-split-full-tiles", A40, A96, causal=False,  # key docs 0, 1, 0: full tiles not contiguous
          q_doc=torch.zeros(1, 40, dtype=torch.int32), k_doc=((A96 // 32) % 2).to(torch.int32)[None]),
    _case("docs-all-padding-tile", A40, A40, b=2, hq=2, hkv=2,
          q_doc=_docs(A40, [], 2, pad=[(0, 0, 32), (1, 8, 40)]), k_doc=_docs(A40, [], 2, pad=[(1, 0, 5)])),
    _case("causal-d256", A40, A40, hq=2, hkv=1, d=256),  # the largest head_dim
    _case("zigzag-half-d40", _cat((24, 72)), ZZ, hq=4, hkv=2, d=40),  # a small head_dim padded to 64
    # values with another head_dim than queries/keys (DeepSeek's 192 / 128, scaled down), both ways round
    _case("mla-zigzag-diag", ZZ, ZZ, hq=4, hkv=4, d=48, dv=32),
    _case("mla-docs-window-gqa", A72, A72, b=2, hq=4, hkv=2, d=24, dv=40, window=30,
          q_doc=_docs(A72, [20, 45], 2, pad=[(1, 60, 72)]), k_doc=_docs(A72, [20, 45], 2, pad=[(1, 60, 72)])),
]  # fmt: skip

FP16_CASES = [CASES[i] for i in (1, 2, 5, 8, 11, 18)]


def _mask(c) -> BlockMask:
    return BlockMask(q_pos=c["q_pos"], k_pos=c["k_pos"], causal=c["causal"], window=c["window"],
                     q_doc=c["q_doc"], k_doc=c["k_doc"])  # fmt: skip


def _inputs(c, dtype, seed=0, transposed=False):
    g = torch.Generator().manual_seed(seed)
    lq, lk = c["q_pos"].numel(), c["k_pos"].numel()

    def rnd(h, n, d):
        if transposed:  # [B, L, H, D] viewed as [B, H, L, D], as Transformers hands them over
            return torch.randn(c["b"], n, h, d, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(c["b"], h, n, d, generator=g).to(dtype).to(DEVICE)

    d, dv = c["d"], c["dv"]
    return rnd(c["hq"], lq, d), rnd(c["hkv"], lk, d), rnd(c["hkv"], lk, dv), rnd(c["hq"], lq, dv)


def _dense(q, k, v, mask: BlockMask, scale, dtype=torch.float64, slopes=None):
    """Masked attention in ``dtype`` (softmax in fp32 or better): ``(out, lse)``; empty rows give 0 / -inf.
    ``slopes``: ALiBi's, the score of key j for query i less ``slope * (q_pos[i] - k_pos[j])``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.to(dtype).repeat_interleave(g, 1), v.to(dtype).repeat_interleave(g, 1)
    s = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    if slopes is not None:
        dist = (mask.q_pos[:, None] - mask.k_pos[None, :]).to(q.device, dtype)
        s = s - slopes.to(q.device, dtype)[:, None, None] * dist
    vis = mask.visible().to(q.device)[:, None]
    s = s.float() if dtype in (torch.float16, torch.bfloat16) else s
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]).to(dtype)
    return p @ v, lse


def _run(backend, c, q, k, v, do, scale, config=None, slopes=None):
    """Forward from empty accumulators, then backward with the resulting LSE: (out, lse, dq, dk, dv)."""
    b, hq, lq, _ = q.shape
    kw = {} if config is None else {"config": config}
    if slopes is not None:
        kw["bias"] = slopes
    mask = _mask(c)
    out = torch.zeros(b, hq, lq, v.shape[-1], device=DEVICE)
    lse = torch.full((b, hq, lq), -math.inf, device=DEVICE)
    backend.forward(q, k, v, mask, scale, out, lse, **kw)
    delta = (do.float() * out).sum(-1)
    dq = torch.zeros(q.shape, device=DEVICE)
    dk, dv = torch.zeros(k.shape, device=DEVICE), torch.zeros(v.shape, device=DEVICE)
    backend.backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, **kw)
    return out, lse, dq, dk, dv


def _reference(c, q, k, v, do, scale, dtype=torch.float64, slopes=None):
    """Dense attention and its autograd gradients in ``dtype``: (out, lse, dq, dk, dv)."""
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = _dense(*xs, _mask(c), scale, dtype, slopes)
    out.backward(do.to(dtype))
    return (out.detach(), lse.detach(), *(x.grad for x in xs))


def _lse_err(a, ref):
    """Relative error of the finite entries; inf if the -inf pattern differs."""
    inf_a, inf_r = torch.isinf(a), torch.isinf(ref)
    if not torch.equal(inf_a, inf_r) or bool(torch.isnan(a).any()):
        return math.inf
    return rel_err(a[~inf_a], ref[~inf_r]) if bool((~inf_r).any()) else 0.0


def _errors(mine, ref):
    return [_lse_err(mine[1].cpu(), ref[1].cpu())] + [
        rel_err(a.cpu(), r.cpu()) for a, r in zip((mine[0], *mine[2:]), (ref[0], *ref[2:]))
    ]


@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_torch_backend_and_float64(case):
    q, k, v, do = _inputs(case, torch.float32)
    scale = case["d"] ** -0.5
    mine = _run(triton_backend, case, q, k, v, do, scale, SMALL)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), mine):
        assert not torch.isnan(t).any(), f"NaN in {name}"
    ref_torch = _run(torch_backend, case, q, k, v, do, scale)
    ref64 = _reference(case, q, k, v, do, scale)
    for label, ref in (("torch backend", ref_torch), ("float64", ref64)):
        errs = _errors(mine, ref)
        assert max(errs) <= FP32_TOL, f"vs {label}: rel errors (lse, out, dq, dk, dv) {errs}"


@pytest.mark.parametrize("case", [CASES[i] for i in (4, 5, 8, 11)])
def test_alibi_slopes_match_torch_backend_and_float64(case):
    """ALiBi (BLOOM, MPT): ``-slope * (q_pos - k_pos)`` with a slope per query head, added in every tile (the full,
    mask-free ones too) of the forward and both backward kernels."""
    q, k, v, do = _inputs(case, torch.float32, seed=2)
    scale = case["d"] ** -0.5
    slopes = torch.tensor([0.5, 2**-0.5, 0.125, 0.0625])[: case["hq"]].to(DEVICE)
    mine = _run(triton_backend, case, q, k, v, do, scale, SMALL, slopes=slopes)
    ref_torch = _run(torch_backend, case, q, k, v, do, scale, slopes=slopes)
    ref64 = _reference(case, q, k, v, do, scale, slopes=slopes)
    for label, ref in (("torch backend", ref_torch), ("float64", ref64)):
        errs = _errors(mine, ref)
        assert max(errs) <= FP32_TOL, f"vs {label}: rel errors (lse, out, dq, dk, dv) {errs}"
    plain = _run(triton_backend, case, q, k, v, do, scale, SMALL)  # (the slopes do change every output)
    assert min(_errors(plain, ref64)[1:]) > 1e-3


@pytest.mark.parametrize("case", FP16_CASES)
@pytest.mark.parametrize("upcast", [True, False], ids=["upcast", "native-dots"])
def test_fp16_within_twice_fp16_attention_error(case, upcast):
    """upcast: fp16 tiles converted to fp32 (the interpreter default); native-dots: fp16 tiles and
    P / dS cast to fp16 before their dots, the code path of fp16/bf16 inputs on a GPU."""
    q, k, v, do = _inputs(case, torch.float16, seed=1)
    scale = case["d"] ** -0.5
    mine = _run(triton_backend, case, q, k, v, do, scale, _tiles(32, 16, scan=4, upcast=upcast))
    ref64 = _reference(case, q, k, v, do, scale)
    yardstick = _errors(_reference(case, q, k, v, do, scale, dtype=torch.float16), ref64)
    for name, e, y in zip(("lse", "out", "dq", "dk", "dv"), _errors(mine, ref64), yardstick):
        assert e <= LOWP_FACTOR * y + LOWP_EPS, f"{name}: {e:.2e} vs fp16 attention {y:.2e}"


@pytest.mark.parametrize("case", [CASES[3], CASES[11], CASES[13], CASES[19]])
@pytest.mark.parametrize(  # (16 x 16: four times the tiles in the interpreter; make test-all)
    "config", [pytest.param(SQUARE, marks=pytest.mark.slow), _tiles(32, 32, scan=1)], ids=["16x16", "32x32"]
)
def test_other_tilings_and_strided_inputs(case, config):
    q, k, v, do = _inputs(case, torch.float32, seed=2, transposed=True)
    assert not q.is_contiguous()
    scale = 0.3
    errs = _errors(_run(triton_backend, case, q, k, v, do, scale, config), _reference(case, q, k, v, do, scale))
    assert max(errs) <= FP32_TOL, errs


@pytest.mark.parametrize(
    "case",
    [
        _case("causal-gqa2", _cat((24, 48), (72, 96)), ZZ, hq=4, hkv=2, d=80),
        _case("docs-window", A40 + 20, A72, b=2, window=30, q_doc=_docs(A40 + 20, [31, 50], 2, pad=[(1, 55, 60)]),
              k_doc=_docs(A72, [31, 50], 2, pad=[(1, 0, 4)])),
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_blocks_merge_into_running_accumulators(case, dtype):
    """Two ring steps (two key blocks) into the same accumulators equal attention over their union."""
    q, k, v, do = _inputs(case, dtype, seed=3)
    scale = case["d"] ** -0.5
    k_pos = case["k_pos"]
    cut = 40
    blocks = [(slice(0, cut)), (slice(cut, None))]
    b, hq, lq, d = q.shape
    out = torch.zeros(b, hq, lq, d, device=DEVICE)
    lse = torch.full((b, hq, lq), -math.inf, device=DEVICE)

    def sub(sl):
        kd = None if case["k_doc"] is None else case["k_doc"][:, sl]
        return BlockMask(case["q_pos"], k_pos[sl], case["causal"], case["window"], case["q_doc"], kd)

    for sl in reversed(blocks):  # the later keys first: the merge must rescale the older partial
        triton_backend.forward(q, k[:, :, sl], v[:, :, sl], sub(sl), scale, out, lse, config=SMALL)
    delta = (do.float() * out).sum(-1)
    dq, dk, dv = (
        torch.zeros(q.shape, device=DEVICE),
        torch.zeros(k.shape, device=DEVICE),
        torch.zeros(k.shape, device=DEVICE),
    )
    for sl in blocks:
        triton_backend.backward(do, q, k[:, :, sl], v[:, :, sl], lse, delta, sub(sl), scale, dq[:, :, :], dk[:, :, sl],
                                dv[:, :, sl], config=SMALL)  # fmt: skip
    ref = _reference(case, q, k, v, do, scale)
    errs = _errors((out, lse, dq, dk, dv), ref)
    tol = FP32_TOL if dtype == torch.float32 else 1e-5  # fp16 inputs, fp32 math: rounding of fp32 only
    assert max(errs) <= tol, f"rel errors (lse, out, dq, dk, dv) {errs}"


def test_fully_masked_block_leaves_accumulators_untouched():
    case = _case("future", A40, A72 + 40).values[0]  # every key after every query
    q, k, v, do = _inputs(case, torch.float32)
    out = torch.randn(1, 2, 40, 64, device=DEVICE)
    lse = torch.randn(1, 2, 40, device=DEVICE)
    lse[:, :, :5] = -math.inf
    out0, lse0 = out.clone(), lse.clone()
    triton_backend.forward(q, k, v, _mask(case), 0.125, out, lse, config=SMALL)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    dq, dk, dv = (
        torch.zeros(q.shape, device=DEVICE),
        torch.zeros(k.shape, device=DEVICE),
        torch.zeros(k.shape, device=DEVICE),
    )
    triton_backend.backward(do, q, k, v, lse, (do * out).sum(-1), _mask(case), 0.125, dq, dk, dv, config=SMALL)
    assert not dq.any() and not dk.any() and not dv.any()


def test_empty_tiles_are_never_read():
    """NaN in keys/values of tiles the mask hides entirely must not reach any output: they are skipped."""
    case = _case("half", _cat((32, 64)), _cat((0, 32), (96, 128)), hq=4, hkv=2).values[0]
    q, k, v, do = _inputs(case, torch.float32)
    k[:, :, 32:], v[:, :, 32:] = math.nan, math.nan  # positions 96..127: after every query
    mine = _run(triton_backend, case, q, k, v, do, 0.125, SMALL)
    assert all(bool(torch.isfinite(t).all()) for t in (mine[0], mine[2], mine[3][:, :, :32], mine[4][:, :, :32]))
    assert not mine[3][:, :, 32:].any() and not mine[4][:, :, 32:].any()
    k[:, :, 32:], v[:, :, 32:] = 0.0, 0.0
    ref = _reference(case, q, k, v, do, 0.125)
    assert max(_errors(mine, ref)) <= FP32_TOL


def test_strided_inputs_past_int32_offsets_are_copied(monkeypatch):
    """A [B, L, H, D] view whose (batch, head) slice spans more than int32 offsets reach is copied to
    the contiguous layout (shown with the limit lowered to sit between the two spans); accumulators
    are never copied but refused, and a slice too long even when contiguous is unsupported."""
    case = CASES[1].values[0]  # 40 queries (4 heads), 72 keys (1 head), d=80
    q, k, v, do = _inputs(case, torch.float32, seed=4, transposed=True)
    assert triton_backend._slice_span(q) == 39 * 4 * 80 + 79 and triton_backend._slice_span(q.contiguous()) == 3199
    assert triton_backend._slice_span(k) == 71 * 80 + 79  # one key/value head: the view spans as little
    ref = _run(triton_backend, case, q, k, v, do, 0.2)
    monkeypatch.setattr(triton_backend, "INT32_LIMIT", 6000)
    qc, kc, vc = triton_backend._int32_safe(q, k, v)
    assert qc.is_contiguous() and torch.equal(qc, q) and kc is k and vc is v
    copies, safe = [], triton_backend._int32_safe

    def spy(*tensors, copy=True):
        result = safe(*tensors, copy=copy)
        copies.extend(r is not t for r, t in zip(result, tensors))
        return result

    monkeypatch.setattr(triton_backend, "_int32_safe", spy)
    mine = _run(triton_backend, case, q, k, v, do, 0.2)
    assert sum(copies) == 3  # q in the forward; do and q in the backward
    assert max(_errors(mine, ref)) == 0.0  # the same kernel on the same numbers
    with pytest.raises(ValueError, match="2\\*\\*31 or more elements"):
        triton_backend._int32_safe(torch.zeros(1, 72, 4, 80).transpose(1, 2), copy=False)
    monkeypatch.setattr(triton_backend, "INT32_LIMIT", 5000)
    assert "int32 offsets" in triton_backend.unsupported(q, k, v)  # ring_attention falls back or says why


def test_float64_inputs_fall_back_to_torch_backend():
    case = CASES[2].values[0]
    q, k, v, do = _inputs(case, torch.float64)
    errs = _errors(_run(triton_backend, case, q, k, v, do, 0.125), _reference(case, q, k, v, do, 0.125))
    assert max(errs) <= 1e-6


def test_rejects_bad_accumulators():
    case = CASES[0].values[0]
    q, k, v, _ = _inputs(case, torch.float32)
    out = torch.zeros(1, 2, 40, 64, dtype=torch.float16, device=DEVICE)
    lse = torch.zeros(1, 2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="out must be fp32"):
        triton_backend.forward(q, k, v, _mask(case), 0.125, out, lse)
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(block_m=48)
    assert triton_backend.unsupported(q, k, v) is None
    big = torch.zeros(1, 2, 8, 288, device=DEVICE)
    assert "head_dim 288" in triton_backend.unsupported(big, big, big)  # the ring falls back or says why


def test_flash_backend_plan_and_cpu_fallback():
    """Which zig-zag steps flash-attn can run (pure host logic), and the fallback where it cannot."""
    from hf_ring.kernels import flash_backend

    diag = flash_backend.plan(BlockMask(ZZ, ZZ, causal=True))
    assert [(kind, qs.start, ks.start) for kind, qs, ks in diag] == [
        ("causal", 0, 0),
        ("full", 24, 0),
        ("causal", 24, 24),
    ]
    half = flash_backend.plan(BlockMask(_cat((24, 72)), ZZ, causal=True))
    assert [(kind, qs.start, ks.start, ks.stop) for kind, qs, ks in half] == [("full", 0, 0, 24)]
    # striped (stride 2): rank 1 against rank 0 is a diagonal, rank 0 against rank 1 the shifted one
    assert [(kind, qs, ks) for kind, qs, ks in flash_backend.plan(BlockMask(P72 + 1, P72, causal=True))] == [
        ("causal", slice(0, 72), slice(0, 72))
    ]
    assert [(kind, qs, ks) for kind, qs, ks in flash_backend.plan(BlockMask(P72, P72 + 1, causal=True))] == [
        ("causal", slice(1, 72), slice(0, 71))
    ]
    assert flash_backend.plan(BlockMask(P72 + 4, P72, causal=True)) is None  # two keys off the diagonal
    assert flash_backend.plan(BlockMask(A40, A40, causal=True, window=8)) is None
    case = CASES[5].values[0]
    q, k, v, do = _inputs(case, torch.float32)
    errs = _errors(_run(flash_backend, case, q, k, v, do, 0.125), _run(torch_backend, case, q, k, v, do, 0.125))
    assert max(errs) <= FP32_TOL
