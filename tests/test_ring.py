"""Ring attention on real gloo groups against plain attention on the unsharded sequence."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

import hf_ring
from hf_ring.kernels import resolve_backend, torch_backend

from .dist_utils import run_distributed
from .reference import doc_ids_from_cu, reference_attention, rel_err, sdpa_attention

# fp32: the ring computes the same math as the reference in a different order: rounding only.
FP32_TOL = 1e-5
# fp16/bf16 (STYLE.md rule): at most 2x the error of PyTorch's SDPA in the same dtype against a
# float64 reference, plus a small epsilon for outputs whose SDPA error happens to be tiny.
LOWP_FACTOR, LOWP_EPS = 2.0, 1e-4

FULL_LEN = {1: 40, 2: 48, 3: 60, 4: 96}  # multiples of 2N; chunk edges at 12 (N=2), 10 (N=3), 12 (N=4)


def _cases(world_size: int) -> list[dict]:
    s = FULL_LEN[world_size]
    cu = torch.tensor([0, 7, 20, 20, 33, s], dtype=torch.int32)  # boundaries off the chunk edges, one empty doc
    pad = torch.arange(s)[None].repeat(2, 1)
    pad = torch.where(pad < torch.tensor([[s - 9], [s - 20]]), 0, -1)  # right padding: rows that see nothing
    # lowp: also run in fp16 / bf16 (test_low_precision_within_twice_sdpa_error)
    base = dict(batch=2, hq=4, hkv=2, d=64, dv=None, causal=True, window=None, cu=None, docs=None, lowp=True)
    # values with their own head_dim (multi-head latent attention: DeepSeek's 192 / 128, scaled down), one
    # combination of features per layout
    mla = {
        "zigzag": dict(hq=4, hkv=4, d=48, dv=32, batch=1, cu=cu),
        "striped": dict(d=24, dv=40, window=9),
        "contiguous": dict(d=48, dv=32, docs=pad, causal=False),
    }
    cases = []
    for layout in hf_ring.LAYOUTS:
        cases += [
            dict(base, layout=layout),
            dict(base, layout=layout, causal=False),
            dict(base, layout=layout, hq=4, hkv=4, d=80, lowp=False),
            dict(base, layout=layout, hq=8, hkv=2, d=128, batch=1),
            dict(base, layout=layout, hq=4, hkv=1, d=64),  # MQA
            dict(base, layout=layout, window=9),
            dict(base, layout=layout, window=9, causal=False, d=80, lowp=False),
            dict(base, layout=layout, batch=1, cu=cu),
            dict(base, layout=layout, batch=1, cu=cu, window=6, hkv=1, lowp=False),
            dict(base, layout=layout, docs=pad),
            dict(base, layout=layout, **mla[layout]),
        ]
    return cases


BACKENDS = ("torch", "sdpa")  # the CPU backends ("auto" is sdpa for fp32)
LOWP_BACKENDS = (*BACKENDS, "auto")  # "auto" in fp16/bf16: the sdpa forward with the torch backward


def _run_case(rank, world, case, dtype=torch.float32, seed=0, backend="auto", ulysses=None):
    """(out, dq, dk, dv) of this rank, and of the float64 reference sharded the same way."""
    s = FULL_LEN[world]
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = case["batch"], case["hq"], case["hkv"], case["d"]
    dv = case["dv"] or d
    q = torch.randn(b, hq, s, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, dv, generator=g).to(dtype)
    dout = torch.randn(b, hq, s, dv, generator=g).to(dtype)
    lay = case["layout"]

    def part(x):
        return hf_ring.shard(x, dim=2, rank=rank, world_size=world, layout=lay)

    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    out = hf_ring.ring_attention(
        ql, kl, vl, layout=lay, causal=case["causal"], sliding_window=case["window"],
        cu_seqlens=case["cu"], document_ids=case["docs"], backend=backend, ulysses=ulysses,
    )  # fmt: skip
    out.backward(part(dout))
    docs = case["docs"] if case["cu"] is None else doc_ids_from_cu(case["cu"], s)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, causal=case["causal"], window=case["window"], docs=docs)
    ref.backward(dout.double())
    mine = (out, ql.grad, kl.grad, vl.grad)
    refs = (part(ref), *(part(x.grad) for x in ref_in))
    extra = None
    if dtype != torch.float32:  # SDPA's own error in the same dtype, for the low-precision rule
        sd_in = [x.clone().requires_grad_() for x in (q, k, v)]
        sd = sdpa_attention(*sd_in, causal=case["causal"], window=case["window"], docs=docs)
        sd.backward(dout)
        extra = [rel_err(part(a), r) for a, r in zip((sd, *(x.grad for x in sd_in)), refs)]
    return [rel_err(a, r) for a, r in zip(mine, refs)], extra, [bool(torch.isfinite(a).all()) for a in mine]


def _numeric_worker(rank, world):
    torch_backend.BLOCK_Q = torch_backend.BLOCK_K = 8  # many tiles: exercise tile classes and edges
    return {b: [_run_case(rank, world, case, backend=b)[0] for case in _cases(world)] for b in BACKENDS}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_plain_attention_fp32(world):
    per_rank = run_distributed(_numeric_worker, world, timeout=300)
    cases = _cases(world)
    for rank, by_backend in enumerate(per_rank):
        for backend, errs in by_backend.items():
            for case, e in zip(cases, errs):
                label = {key: val for key, val in case.items() if not isinstance(val, torch.Tensor)}
                assert max(e) <= FP32_TOL, f"rank {rank} {backend} {label}: rel errors (out, dq, dk, dv) {e}"


def _selection_worker(rank, world):
    """(out, dq, dk, dv) errors of a call with a selection of keys per query (DeepSeek sparse attention's top-k), per
    layout, backend and feature: random global positions (repeats, keys the causal mask hides, rows left empty); also
    a list per key/value head, and lists of blocks of 4 or 5 positions (MiniMax M3's indexer), per head or not
    (blocks past the sequence's end, a last block cut short)."""
    from hf_ring.comm import ulysses_groups

    torch_backend.BLOCK_Q = torch_backend.BLOCK_K = 8
    s = FULL_LEN[world]
    hybrids = {1: None, 2: ulysses_groups(None, 2)} if world > 1 else {1: None}  # (every rank creates them)
    pad = torch.where(torch.arange(s)[None].repeat(2, 1) < torch.tensor([[s - 9], [s - 20]]), 0, -1)
    cu = torch.tensor([0, 7, 20, 33, s], dtype=torch.int32)
    feats = {
        "causal": {},
        "padded": {"docs": pad},
        "packed-gqa1": {"cu": cu, "hkv": 1},
        "bidirectional": {"causal": False},
        "per-head": {"heads": True},
        "blocks-per-head-padded": {"heads": True, "block": 4, "docs": pad},
        "blocks-gqa1": {"block": 5, "hkv": 1},
        "blocks-from-7": {"block": 4, "start": 7},  # (keys before 7 in no block)
        "positions-from-5": {"start": 5},  # (entry e names position 5 + e)
        "blocks-per-head-3kv": {"heads": True, "block": 4, "hq": 6, "hkv": 3},  # (Ulysses: each head repeated)
    }
    errs = {}
    for layout, backend, (u, hybrid) in itertools.product(hf_ring.LAYOUTS, BACKENDS, hybrids.items()):
        for feat, opts in feats.items():
            g = torch.Generator().manual_seed(3)
            b, hq, hkv, d, dv = 2, opts.get("hq", 4), opts.get("hkv", 2), 24, 16
            q, k = torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
            v, dout = torch.randn(b, hkv, s, dv, generator=g), torch.randn(b, hq, s, dv, generator=g)
            block, heads, start = opts.get("block", 1), opts.get("heads", False), opts.get("start", 0)
            sel = torch.randint(-1, -(-s // block) + 2, (b, *((hkv,) if heads else ()), s, 5), generator=g)
            named = start + sel.clamp_min(0)[..., None] * block + torch.arange(block)  # the positions of each entry
            named = torch.where((sel[..., None] >= 0) & (named < s), named, s).flatten(-2)
            keep = torch.zeros(*named.shape[:-1], s + 1, dtype=torch.bool).scatter_(-1, named, True)[..., :s]
            keep = keep.repeat_interleave(hq // hkv, dim=1) if heads else keep[:, None]

            def part(x, dim=2, lay=layout):
                return hf_ring.shard(x, dim=dim, rank=rank, world_size=world, layout=lay)

            ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
            causal, docs, cus = opts.get("causal", True), opts.get("docs"), opts.get("cu")
            out = hf_ring.ring_attention(
                ql, kl, vl, layout=layout, causal=causal, document_ids=docs, cu_seqlens=cus,
                selected=hf_ring.Selection(part(sel, dim=-2), block, start), backend=backend, ulysses=hybrid,
            )  # fmt: skip
            out.backward(part(dout))
            ref_docs = docs if cus is None else doc_ids_from_cu(cus, s)
            ref_in = [x.double().requires_grad_() for x in (q, k, v)]
            ref = reference_attention(*ref_in, causal=causal, docs=ref_docs, keep=keep)
            ref.backward(dout.double())
            mine = (out, ql.grad, kl.grad, vl.grad)
            refs = (part(ref), *(part(x.grad) for x in ref_in))
            errs[(layout, backend, f"U={u}", feat)] = [rel_err(a, r) for a, r in zip(mine, refs)]
    if world > 1:  # with Ulysses, ranks whose selections differ in shape (the all-to-all would hang): all refuse
        q = torch.randn(1, 4, s // world, 8)
        kv = torch.randn(1, 2, s // world, 8)
        sel = torch.zeros(1, s // world, 3 + rank, dtype=torch.long)
        try:
            hf_ring.ring_attention(q, kv, kv, selected=sel, ulysses=hybrids[2])
            errs["mismatch"] = None
        except ValueError as e:
            errs["mismatch"] = str(e)
    return errs


# (4 ranks under make test-all: the ring's steps at 4 ranks run in test_matches_plain_attention_fp32)
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_selection_of_keys_per_query_matches_masked_plain_attention(world):
    for rank, errs in enumerate(run_distributed(_selection_worker, world, timeout=300)):
        if world > 1:
            mismatch = errs.pop("mismatch")
            assert mismatch is not None and "ranks disagree on selection entries per query" in mismatch, mismatch
        for case, e in errs.items():
            assert max(e) <= FP32_TOL, f"rank {rank} {case}: rel errors (out, dq, dk, dv) {e}"


def _shared_reference(q, k, v, ek, ev, e_pos, *, window=None, docs=None, sinks=None, keep=None):
    """Float64 softmax over the sequence's keys (causal, window, documents) and the shared keys (causal by their
    positions, ``keep`` [batch, S, n] their selection), with sinks; rows that see nothing give 0."""
    from .reference import dense_mask

    g = q.shape[1] // k.shape[1]
    keys = torch.cat([k, ek], 2).double().repeat_interleave(g, 1)
    values = torch.cat([v, ev], 2).double().repeat_interleave(g, 1)
    s = q.shape[2]
    seen = e_pos[None, :] <= torch.arange(s)[:, None]
    seen = (seen[None] if keep is None else seen[None] & keep)[:, None]
    vis = torch.cat([dense_mask(s, True, window, docs).expand(seen.shape[0], -1, -1, -1), seen], -1)
    scores = (q.double() @ keys.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        col = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, col], -1), -1)[..., :-1] @ values
    return torch.softmax(scores, -1).nan_to_num(0.0) @ values


def _shared_worker(rank, world):
    """Errors of calls with shared keys (DeepSeek-V4's compressed entries: every rank holds them whole) against float64
    attention over both: per layout and feature (a window with sinks and one key/value head, keys and values one
    tensor, a selection of blocks, padding, which the shared keys ignore). Their gradients are summed over the ranks."""
    torch_backend.BLOCK_Q = torch_backend.BLOCK_K = 8
    s, m = FULL_LEN[world], 4
    n = s // m
    e_pos = torch.arange(1, n + 1) * m - 1  # entry e: the window ending at m (e + 1) - 1
    pad = torch.where(torch.arange(s)[None].repeat(2, 1) < torch.tensor([[s - 9], [s - 20]]), 0, -1)
    feats = {
        "window-sinks-mqa": {"window": 5, "sinks": True, "hkv": 1},
        "one-tensor-mqa": {"window": 3, "same": True, "hkv": 1},
        "selected-blocks": {"select": True},
        "padded-selected": {"docs": pad, "select": True, "sinks": True},
    }
    errs = {}
    for layout, backend, (feat, opts) in itertools.product(hf_ring.LAYOUTS, BACKENDS, feats.items()):
        g = torch.Generator().manual_seed(5)
        b, hq, hkv, d = 2, 4, opts.get("hkv", 2), 16
        q, k, v, dout = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv, hq))
        ek, ev = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
        ev = ek if opts.get("same") else ev
        sinks = torch.randn(hq, generator=g) if opts.get("sinks") else None
        sel = keep = None
        if opts.get("select"):
            sel = torch.randint(-1, n + 1, (b, s, 3), generator=g)  # (entries past the last: none)
            keep = torch.zeros(b, s, n + 2, dtype=torch.bool).scatter_(-1, torch.where(sel >= 0, sel, n + 1), True)
            keep = keep[..., :n]

        def part(x, dim=2, lay=layout):
            return hf_ring.shard(x, dim=dim, rank=rank, world_size=world, layout=lay)

        ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
        ekl = ek.clone().requires_grad_()
        evl = ekl if opts.get("same") else ev.clone().requires_grad_()
        sl = None if sinks is None else sinks.clone().requires_grad_()
        selection = None if sel is None else hf_ring.Selection(part(sel, dim=1), m, m - 1)
        shared = hf_ring.ring.SharedKeys(ekl, evl, e_pos, selection)
        out = hf_ring.ring_attention(
            ql, kl, vl, layout=layout, sliding_window=opts.get("window"), sinks=sl, document_ids=opts.get("docs"),
            shared=lambda s=shared: s, backend=backend,
        )  # fmt: skip
        out.backward(part(dout))
        theirs = [ekl.grad] + ([] if opts.get("same") else [evl.grad]) + ([] if sl is None else [sl.grad])
        if world > 1:  # (each rank's share)
            for t in theirs:
                dist.all_reduce(t)
        ref_in = [x.double().requires_grad_() for x in (q, k, v, ek)]
        ref_ev = ref_in[3] if opts.get("same") else ev.double().requires_grad_()
        ref_sinks = None if sinks is None else sinks.double().requires_grad_()
        ref = _shared_reference(*ref_in, ref_ev, e_pos, window=opts.get("window"), docs=opts.get("docs"),
                                sinks=ref_sinks, keep=keep)  # fmt: skip
        ref.backward(dout.double())
        mine = (out, ql.grad, kl.grad, vl.grad, *theirs)
        refs = [part(ref), *(part(x.grad) for x in ref_in[:3]), ref_in[3].grad]
        refs += ([] if opts.get("same") else [ref_ev.grad]) + ([] if ref_sinks is None else [ref_sinks.grad])
        errs[(layout, backend, feat)] = [rel_err(a, r) for a, r in zip(mine, refs)]
    return errs


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shared_keys_merge_with_the_ring_as_one_softmax(world):
    for rank, errs in enumerate(run_distributed(_shared_worker, world, timeout=300)):
        assert len(errs) == len(hf_ring.LAYOUTS) * len(BACKENDS) * 4
        for case, e in errs.items():
            assert max(e) <= FP32_TOL, f"rank {rank} {case}: rel errors (out, dq, dk, dv, shared..., sinks) {e}"


def _hybrid_worker(rank, world, u):
    from hf_ring.comm import ulysses_groups

    torch_backend.BLOCK_Q = torch_backend.BLOCK_K = 8
    groups = ulysses_groups(None, u)
    assert (groups.ulysses_size, groups.ring_size, groups.ulysses_rank) == (u, world // u, rank % u)
    return {b: [_run_case(rank, world, case, backend=b, ulysses=groups)[0] for case in _cases(world)] for b in BACKENDS}


@pytest.mark.parametrize("world, u", [(2, 2), (4, 2), (4, 4)], ids=["2x1", "2x2", "4x1"])
def test_ulysses_ring_hybrid_matches_plain_attention_fp32(world, u):
    """U x R: heads exchanged inside groups of U ranks, the ring across them; every layout and case of the pure
    ring (GQA, MQA and KV heads fewer than U, windows, packed documents, padding), outputs and gradients."""
    per_rank = run_distributed(_hybrid_worker, world, u, timeout=600)
    cases = _cases(world)
    for rank, by_backend in enumerate(per_rank):
        for backend, errs in by_backend.items():
            for case, e in zip(cases, errs):
                label = {key: val for key, val in case.items() if not isinstance(val, torch.Tensor)}
                assert max(e) <= FP32_TOL, f"rank {rank} {backend} U={u} {label}: rel errors (out, dq, dk, dv) {e}"


def _hybrid_extras_worker(rank, world):
    """2 x 2: softcapping and sinks (and the sinks' gradient), and ALiBi, through the hybrid; its errors on every
    rank."""
    from hf_ring.comm import ulysses_groups

    groups = ulysses_groups(None, 2)
    s, g = FULL_LEN[world], torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, h, s, 16, generator=g) for h in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=g)

    def part(x):
        return hf_ring.shard(x, dim=2, rank=rank, world_size=world)

    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    sl = sinks.clone().requires_grad_()
    out = hf_ring.ring_attention(ql, kl, vl, softcap=2.0, sinks=sl, ulysses=groups)
    out.backward(part(dout))
    dsinks = sl.grad.clone()
    dist.all_reduce(dsinks)  # each rank holds its rows' share of its heads' sinks gradient
    ref_in = [x.double().requires_grad_() for x in (q, k, v, sinks)]
    ref = reference_attention(*ref_in[:3], softcap=2.0, sinks=ref_in[3])
    ref.backward(dout.double())
    errs = [rel_err(out, part(ref)), rel_err(ql.grad, part(ref_in[0].grad)), rel_err(kl.grad, part(ref_in[1].grad)),
            rel_err(vl.grad, part(ref_in[2].grad)), rel_err(dsinks, ref_in[3].grad)]  # fmt: skip
    slopes = torch.tensor([0.5, 0.25, 0.125, 2**-0.5])  # ALiBi: each rank the slopes of its query heads
    ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
    out = hf_ring.ring_attention(ql, kl, vl, alibi_slopes=slopes, ulysses=groups)
    out.backward(part(dout))
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, alibi=slopes)
    ref.backward(dout.double())
    errs += [rel_err(out, part(ref)), *(rel_err(t.grad, part(r.grad)) for t, r in zip((ql, kl, vl), ref_in))]
    messages = []
    for call in (
        lambda: ulysses_groups(None, 3),  # does not divide 4 ranks: raised locally, before any collective
        lambda: hf_ring.ring_attention(*(torch.randn(1, 3, s // world, 16) for _ in range(3)), ulysses=groups),
        lambda: hf_ring.ring_attention(  # only rank 0 is wrong: every rank raises
            torch.randn(1, 6 if rank == 0 else 4, s // world, 16),
            *(torch.randn(1, 2, s // world, 16) for _ in "kv"),
            ulysses=groups,
        ),
        lambda: hf_ring.ring_attention(  # a sink per query (Inkling 2's), or a bias by distance: not with Ulysses
            ql.detach(), kl.detach(), vl.detach(), sinks=torch.zeros(1, 4, s // world), ulysses=groups
        ),
        lambda: hf_ring.ring_attention(
            ql.detach(), kl.detach(), vl.detach(), distance_bias=torch.zeros(1, 4, s // world, 3), ulysses=groups
        ),
    ):
        try:
            call()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    hf_ring.ring_attention(ql.detach(), kl.detach(), vl.detach(), ulysses=groups)  # the groups still work
    pure = ulysses_groups(None, 1)  # U = 1: the pure ring, bit for bit
    same = torch.equal(hf_ring.ring_attention(ql, kl, vl, ulysses=pure), hf_ring.ring_attention(ql, kl, vl))
    return errs, messages, same


def test_ulysses_ring_hybrid_softcap_sinks_and_errors_on_every_rank():
    for rank, (errs, messages, same) in enumerate(run_distributed(_hybrid_extras_worker, 4, timeout=300)):
        assert max(errs) <= FP32_TOL, (rank, errs)
        assert same
        assert "ulysses_size=3 does not divide the context-parallel group's 4 ranks" in messages[0], messages[0]
        assert "q_heads (3) must be a multiple of ulysses_size (2)" in messages[1], messages[1]
        assert "ranks disagree on q_heads: [6, 4, 4, 4]" in messages[2], messages[2]  # checked over all 4 ranks
        assert "a sink per query (sinks [batch, q_heads, local_seq]) is not supported with ulysses" in messages[3]
        assert "distance_bias is not supported with ulysses" in messages[4], messages[4]


def test_without_process_group_equals_plain_attention():
    assert not dist.is_initialized()
    for case in (c for c in _cases(1) if c["layout"] == "zigzag"):
        errs, _, _ = _run_case(0, 1, case)
        assert max(errs) <= FP32_TOL, (case["layout"], errs)


def _lowp_worker(rank, world, dtype):
    cases = [c for c in _cases(world) if c["lowp"]]
    return {b: [_run_case(rank, world, c, dtype=dtype, seed=1, backend=b) for c in cases] for b in LOWP_BACKENDS}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_within_twice_sdpa_error(dtype):
    for rank, by_backend in enumerate(run_distributed(_lowp_worker, 2, dtype, timeout=300)):
        for backend, results in by_backend.items():
            for mine, sdpa, finite in results:
                assert all(finite), f"rank {rank} {backend}: non-finite values"
                for name, a, b in zip(("out", "dq", "dk", "dv"), mine, sdpa):
                    assert a <= LOWP_FACTOR * b + LOWP_EPS, (
                        f"rank {rank} {backend} {dtype} {name}: {a:.2e} vs SDPA {b:.2e}"
                    )


def _masked_rows_worker(rank, world):
    s = FULL_LEN[world]
    docs = torch.zeros(1, s, dtype=torch.long)
    docs[:, 30:] = -1  # padding: these rows see no key
    q, k, v = (torch.randn(1, 2, s, 16) for _ in range(3))

    def part(x):
        return hf_ring.shard(x, dim=2, rank=rank, world_size=world).requires_grad_()

    ql, kl, vl = part(q), part(k), part(v)
    out = hf_ring.ring_attention(ql, kl, vl, document_ids=docs)
    out.sum().backward()
    pad = docs[0, hf_ring.positions(s, rank=rank, world_size=world)] < 0
    return [t[:, :, pad].detach() for t in (out, ql.grad, kl.grad, vl.grad)]


def test_fully_masked_rows_give_zero_not_nan():
    for out, dq, dk, dv in run_distributed(_masked_rows_worker, 2):
        for t in (out, dq, dk, dv):
            assert t.numel() > 0
            assert torch.equal(t, torch.zeros_like(t)), "padding rows must give exactly 0 output and gradient"


def _accounting_worker(rank, world):
    """Bytes sent by one forward (fp32 and fp16, GQA) and matmul flops of one zig-zag causal forward."""
    s, b, hq, hkv, d = FULL_LEN[world], 2, 4, 2, 80
    sent = []
    for dtype in (torch.float32, torch.float16):
        q = torch.randn(b, hq, s // world, d).to(dtype)
        k = torch.randn(b, hkv, s // world, d).to(dtype)
        comm = hf_ring.RingComm()
        hf_ring.ring_attention(q, k, k.clone(), comm=comm)
        sent.append((comm.bytes_sent, 2 * (world - 1) * b * hkv * (s // world) * d * q.element_size()))
    # forward + backward: K/V hop N-1 times each way, the fp32 dK/dV accumulators hop N times
    q = torch.randn(b, hq, s // world, d, dtype=torch.float16, requires_grad=True)
    k = torch.randn(b, hkv, s // world, d, dtype=torch.float16, requires_grad=True)
    comm = hf_ring.RingComm()
    hf_ring.ring_attention(q, k, k, comm=comm).sum().backward()
    kv_bytes = 2 * b * hkv * (s // world) * d
    sent.append((comm.bytes_sent, 2 * (world - 1) * kv_bytes * 2 + world * kv_bytes * 4))
    # values with their own head_dim (48 for keys of 80): the message is the keys and values side by side
    v = torch.randn(b, hkv, s // world, 48, dtype=torch.float16, requires_grad=True)
    comm = hf_ring.RingComm()
    hf_ring.ring_attention(q, k, v, comm=comm).sum().backward()
    kv_bytes = b * hkv * (s // world) * (d + 48)
    sent.append((comm.bytes_sent, 2 * (world - 1) * kv_bytes * 2 + world * kv_bytes * 4))

    torch_backend.BLOCK_Q = torch_backend.BLOCK_K = s // (2 * world)  # one tile per chunk: count chunk pairs
    q, k, v = (torch.randn(1, 2, s // world, 16) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        hf_ring.ring_attention(q, k, v, layout="zigzag", backend="torch")

    # overlap: every step but the last computes between launching the next exchange and waiting for it
    events = []

    class RecordingComm(hf_ring.RingComm):
        def commit(self):
            events.append("commit")
            super().commit()

        def wait(self):
            events.append("wait")
            super().wait()

    compute = torch_backend.forward

    def recording_forward(*args):
        events.append("compute")
        return compute(*args)

    torch_backend.forward = recording_forward
    try:
        hf_ring.ring_attention(q, k, v, layout="striped", causal=False, comm=RecordingComm(), backend="torch")
    finally:
        torch_backend.forward = compute
    return sent, counter.get_total_flops(), events


@pytest.fixture(scope="module", params=[2, 4])
def accounting(request):
    return request.param, run_distributed(_accounting_worker, request.param)


def test_forward_sends_only_kv_heads(accounting):
    world, per_rank = accounting
    for rank, (sent, _, _) in enumerate(per_rank):
        (fwd32, exp32), (fwd16, exp16), (both, exp_both), (mla, exp_mla) = sent
        assert fwd32 == exp32, f"rank {rank}: fp32 forward sent {fwd32} bytes, expected 2*(N-1)*B*Hkv*L*D*4 = {exp32}"
        assert fwd16 == exp16, f"rank {rank}: fp16 forward sent {fwd16} bytes, expected 2*(N-1)*B*Hkv*L*D*2 = {exp16}"
        assert both == exp_both, f"rank {rank}: forward+backward sent {both} bytes, expected {exp_both}"
        assert mla == exp_mla, f"rank {rank}: forward+backward with Dv != D sent {mla} bytes, expected {exp_mla}"


def test_communication_overlaps_computation(accounting):
    world, per_rank = accounting
    expected = ["commit", "compute", "wait"] * (world - 1) + ["compute"]
    for rank, (_, _, events) in enumerate(per_rank):
        assert events == expected, f"rank {rank}: {events}"


def test_zigzag_causal_skips_masked_work(accounting):
    world, per_rank = accounting
    c = FULL_LEN[world] // (2 * world)
    # Per rank: own block = 3 chunk pairs (two diagonal, one full; one skipped); every other block
    # is exactly half visible = 2 chunk pairs. Two matmuls (QK^T, PV) of 2*c*c*d flops each, 2 heads.
    expected = 2 * 2 * (2 * c * c * 16) * (3 + 2 * (world - 1))
    for rank, (_, flops, _) in enumerate(per_rank):
        assert flops == expected, f"rank {rank}: {flops} flops, expected {expected}"


# ----------------------------------------------------------------------------- errors


def _error_cases(rank, world):
    """(name, callable) pairs; each must raise ValueError on every rank."""
    local = FULL_LEN[world] // world

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype)

    q, k = t(1, 4, local, 16), t(1, 2, local, 16)
    return [
        ("length", "multiple of 4; pad the sequence to 12", lambda: hf_ring.ring_attention(t(1, 4, 5, 16), t(1, 2, 5, 16), t(1, 2, 5, 16))),
        ("heads", "multiple of kv_heads", lambda: hf_ring.ring_attention(t(1, 3, local, 16), k, k)),
        ("dtype", "one dtype", lambda: hf_ring.ring_attention(q, k.half(), k.half())),
        ("device", "one device", lambda: hf_ring.ring_attention(q, k.to("meta"), k.to("meta"))),
        ("shape", "agree on", lambda: hf_ring.ring_attention(q, t(1, 2, local, 8), t(1, 2, local, 8))),
        ("values", "k and v must agree on batch, kv_heads and local_seq",
         lambda: hf_ring.ring_attention(q, k, t(1, 1, local, 16))),
        ("value head_dim", "disagree on v_head_dim",
         lambda: hf_ring.ring_attention(q, k, t(1, 2, local, 16 + 8 * rank))),
        ("layout", "unknown layout", lambda: hf_ring.ring_attention(q, k, k, layout="spiral")),
        ("backend", "unknown backend", lambda: hf_ring.ring_attention(q, k, k, backend="cuda-magic")),
        ("cu_seqlens", "cu_seqlens", lambda: hf_ring.ring_attention(q, k, k, cu_seqlens=torch.tensor([0, 5, 9]))),
        # bad input on one rank only: the others must raise too instead of waiting for it
        ("one rank", "rejected" if rank == 0 else "multiple of kv_heads",
         lambda: hf_ring.ring_attention(t(1, 3, local, 16) if rank == 1 else q, k, k)),
        ("local length", "disagree on local_seq",
         lambda: hf_ring.ring_attention(t(1, 4, local + 2 * rank, 16), t(1, 2, local + 2 * rank, 16),
                                        t(1, 2, local + 2 * rank, 16))),
        ("documents", "disagree on documents",
         lambda: hf_ring.ring_attention(q, k, k, cu_seqlens=torch.tensor([0, 3 + rank, 2 * local]))),
        ("scale", "disagree on scale", lambda: hf_ring.ring_attention(q, k, k, scale=0.1 + rank)),
    ]  # fmt: skip


def _failing_kernel_call(q, k):
    """A kernel that fails at the second ring step: an error inside the ring stops the group (hf_ring.guard)."""
    compute, calls = torch_backend.forward, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("kernel failed")
        return compute(*args)

    torch_backend.forward = failing
    try:
        hf_ring.ring_attention(q, k, k, causal=False, backend="torch")
    finally:
        torch_backend.forward = compute


def _errors_worker(rank, world):
    results = []
    for name, expected, call in _error_cases(rank, world):
        try:
            call()
            results.append((name, expected, None))
        except ValueError as e:
            results.append((name, expected, str(e)))
    # the group still works after every refusal: a real call completes
    q = torch.randn(1, 2, FULL_LEN[world] // world, 16)
    hf_ring.ring_attention(q, q, q)
    # an error inside the ring propagates, then the group is stopped: the next call raises before communicating
    for call in (lambda: _failing_kernel_call(q, q), lambda: hf_ring.ring_attention(q, q, q)):
        try:
            call()
            results.append(("inside the ring", "raises", None))
        except (ValueError, RuntimeError) as e:
            results.append(("inside the ring", "kernel failed", str(e)))
    return results


def test_every_error_raises_on_every_rank():
    for rank, results in enumerate(run_distributed(_errors_worker, 2, timeout=120)):
        for name, expected, message in results:
            assert message is not None, f"rank {rank}: {name} did not raise"
            assert expected in message, f"rank {rank}: {name}: {message!r} lacks {expected!r}"


def test_default_scale_and_custom_scale():
    q, k, v = (torch.randn(1, 2, 24, 32) for _ in range(3))
    for scale in (None, 0.05):
        out = hf_ring.ring_attention(q, k, v, scale=scale)
        ref = reference_attention(q, k, v, scale=scale)
        assert rel_err(out, ref) <= FP32_TOL
    assert rel_err(hf_ring.ring_attention(q, k, v), hf_ring.ring_attention(q, k, v, scale=0.05)) > 0.01


def test_auto_backend_on_cpu_follows_the_measured_table():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.float32) == ("sdpa", "sdpa")
    assert resolve_backend("auto", cpu, torch.bfloat16) == ("sdpa", "torch")  # CPU flash backward is slower
    assert resolve_backend("triton", cpu, torch.bfloat16) == ("triton", "triton")
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("cuda-magic", torch.device("cpu"))


def test_only_linear_state_is_saved_for_backward():
    # Backward recomputes scores from the LSE: nothing of size S x S is kept, K/V are not repeated.
    q = torch.randn(1, 8, 64, 16, requires_grad=True)
    k = torch.randn(1, 2, 64, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hf_ring.ring_attention(q, k, k)
    assert sorted(saved) == sorted([(1, 8, 64, 16), (1, 2, 64, 16), (1, 2, 64, 16), (1, 8, 64, 16), (1, 8, 64)])


def test_autocast_does_not_lower_the_kernel_precision():
    q, k, v = (torch.randn(1, 4, 48, 32, requires_grad=True) for _ in range(3))
    plain = hf_ring.ring_attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = hf_ring.ring_attention(q, k, v)
    assert under.dtype == torch.float32
    assert torch.equal(plain, under)


def _bias_worker(rank, world):
    """Errors (out, dq, dk, dv, d bias) of calls with a bias by distance per query (Inkling's relative position bias),
    per layout and feature, against plain attention with the dense bias; and the refusals."""
    torch_backend.BLOCK_Q = torch_backend.BLOCK_K = 8
    s = FULL_LEN[world]
    pad = torch.where(torch.arange(s)[None].repeat(2, 1) < torch.tensor([[s - 9], [s - 20]]), 0, -1)
    cu = torch.tensor([0, 7, 20, 33, s], dtype=torch.int32)
    feats = {
        "causal": {},
        "extent-1": {"extent": 1},
        "extent-past-the-end": {"extent": s + 3},
        "padded-window": {"docs": pad, "window": 9},
        "packed-gqa1": {"cu": cu, "hkv": 1},
        "bidirectional": {"causal": False},  # (keys after the query: negative distances, no bias)
        "sinks-selected": {"sinks": True, "select": True},
    }
    errs = {}
    for layout, (feat, opts) in itertools.product(hf_ring.LAYOUTS, feats.items()):
        g = torch.Generator().manual_seed(5)
        b, hq, hkv, d, extent = 2, 4, opts.get("hkv", 2), 16, opts.get("extent", 6)
        q, k = torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
        v, dout = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hq, s, d, generator=g)
        bias = torch.randn(b, hq, s, extent, generator=g)
        sinks = torch.randn(hq, generator=g) if opts.get("sinks") else None
        sel = torch.randint(-1, s, (b, s, 7), generator=g) if opts.get("select") else None
        keep = None
        if sel is not None:
            keep = torch.zeros(b, s, s + 1, dtype=torch.bool).scatter_(-1, torch.where(sel >= 0, sel, s), True)
            keep = keep[:, None, :, :s]

        def part(x, dim=2, lay=layout):
            return hf_ring.shard(x, dim=dim, rank=rank, world_size=world, layout=lay)

        ql, kl, vl, bl = (part(x).requires_grad_() for x in (q, k, v, bias))
        causal, docs, cus, window = opts.get("causal", True), opts.get("docs"), opts.get("cu"), opts.get("window")
        out = hf_ring.ring_attention(
            ql, kl, vl, layout=layout, causal=causal, document_ids=docs, cu_seqlens=cus, sliding_window=window,
            sinks=sinks, selected=None if sel is None else part(sel, dim=1), distance_bias=bl,
        )  # fmt: skip
        out.backward(part(dout))
        ref_docs = docs if cus is None else doc_ids_from_cu(cus, s)
        ref_in = [x.double().requires_grad_() for x in (q, k, v, bias)]
        ref = reference_attention(
            *ref_in[:3], causal=causal, docs=ref_docs, window=window, sinks=sinks, keep=keep, bias=ref_in[3]
        )  # fmt: skip
        ref.backward(dout.double())
        mine = (out, ql.grad, kl.grad, vl.grad, bl.grad)
        refs = (part(ref), *(part(x.grad) for x in ref_in))
        errs[(layout, feat)] = [rel_err(a, r) for a, r in zip(mine, refs)]
    alibi = {  # ALiBi's slopes (BLOOM, MPT): no gradient of their own
        "alibi-causal": {},
        "alibi-padded-window": {"docs": pad, "window": 9},
        "alibi-packed-gqa1": {"cu": cu, "hkv": 1},
        "alibi-sinks": {"sinks": True},
    }
    for layout, (feat, opts) in itertools.product(hf_ring.LAYOUTS, alibi.items()):
        g = torch.Generator().manual_seed(6)
        b, hq, hkv, d = 2, 4, opts.get("hkv", 2), 16
        q, k = torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
        v, dout = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hq, s, d, generator=g)
        slopes = torch.tensor([0.5, 0.25, 0.125, 2**-0.5])  # (one is not a power of two: BLOOM with 6 heads)
        sinks = torch.randn(hq, generator=g) if opts.get("sinks") else None

        def part(x, dim=2, lay=layout):
            return hf_ring.shard(x, dim=dim, rank=rank, world_size=world, layout=lay)

        ql, kl, vl = (part(x).requires_grad_() for x in (q, k, v))
        docs, cus, window = opts.get("docs"), opts.get("cu"), opts.get("window")
        out = hf_ring.ring_attention(
            ql, kl, vl, layout=layout, document_ids=docs, cu_seqlens=cus, sliding_window=window, sinks=sinks,
            alibi_slopes=slopes,
        )  # fmt: skip
        out.backward(part(dout))
        ref_docs = docs if cus is None else doc_ids_from_cu(cus, s)
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        ref = reference_attention(*ref_in, docs=ref_docs, window=window, sinks=sinks, alibi=slopes)
        ref.backward(dout.double())
        mine = (out, ql.grad, kl.grad, vl.grad)
        errs[(layout, feat)] = [rel_err(a, r) for a, r in zip(mine, (part(ref), *(part(x.grad) for x in ref_in)))]
    q, kv = torch.randn(1, 4, s // world, 8), torch.randn(1, 2, s // world, 8)
    refusals = {
        "shape": dict(distance_bias=torch.zeros(1, 2, s // world, 3)),
        "softcap": dict(distance_bias=torch.zeros(1, 4, s // world, 3), softcap=5.0),
        "slopes-shape": dict(alibi_slopes=torch.ones(2)),
        "slopes-grad": dict(alibi_slopes=torch.ones(4, requires_grad=True)),
        "slopes-and-table": dict(alibi_slopes=torch.ones(4), distance_bias=torch.zeros(1, 4, s // world, 3)),
        "slopes-softcap": dict(alibi_slopes=torch.ones(4), softcap=5.0),
    }
    for name, kwargs in refusals.items():
        try:
            hf_ring.ring_attention(q, kv, kv, **kwargs)
            errs[name] = None
        except ValueError as e:
            errs[name] = str(e)
    return errs


# (4 ranks under make test-all: the ring's steps at 4 ranks run in test_matches_plain_attention_fp32)
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_bias_by_distance_and_alibi_match_plain_attention_with_the_dense_bias(world):
    for rank, errs in enumerate(run_distributed(_bias_worker, world, timeout=300)):
        assert "distance_bias must be a floating-point tensor [batch=1, q_heads=4" in errs.pop("shape")
        assert "distance_bias is not supported with softcap" in errs.pop("softcap")
        assert "alibi_slopes must be a floating-point tensor [q_heads=4]" in errs.pop("slopes-shape")
        assert "that requires no gradient" in errs.pop("slopes-grad")
        assert "pass distance_bias or alibi_slopes, not both" in errs.pop("slopes-and-table")
        assert "alibi_slopes is not supported with softcap" in errs.pop("slopes-softcap")
        for case, e in errs.items():
            assert max(e) <= FP32_TOL, f"rank {rank} {case}: rel errors (out, dq, dk, dv[, d bias]) {e}"
