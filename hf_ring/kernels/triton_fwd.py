"""Triton forward kernel of one ring step, with the online-softmax merge fused into its epilogue.

One program owns ``BLOCK_M`` queries of one (batch, query head) and walks the key/value block of
this ring step in tiles of ``BLOCK_N`` keys; query head ``h`` reads key/value head ``h // group``
(GQA-native, nothing is repeated). Its epilogue merges the tile-loop result into the running fp32
accumulators ``out`` / ``lse`` in place, so a ring step is one launch and no block-sized temporary.

Tile classes come from global positions (and document ids) loaded inside the kernel, never from a
dense mask: a vectorised *scan* over the int32 position arrays classifies every tile from its
min/max bounds (``EMPTY`` / ``FULL`` / ``PARTIAL``, the rules of ``mask.BlockMask.classify``) and
finds the range of non-empty tiles and the contiguous run of full tiles in it. The main loop then
runs in three parts: partial/mixed tiles before the full run (classified one by one: empty tiles
skipped, full ones mask-free), the full run with the mask-free, branch-free path (the one the
compiler software-pipelines), and the tiles after it. A zig-zag step that is half visible costs
half; a query tile that sees nothing returns before touching the accumulators.

Numerics: scores are scaled by ``scale * log2(e)`` and exponentiated with ``exp2``; the kernel's
inputs and outputs are natural-log LSE (converted in the epilogue, base 2 never leaks out).
Accumulators are fp32. Low-precision inputs feed ``tl.dot`` natively on the GPU (fp32
accumulation); with ``UPCAST`` (fp32 inputs, or the CPU interpreter) tiles are converted to fp32
and the dots run in IEEE fp32. Positions are int32 and must stay below 2**30.

The jit helpers ``_classify`` and ``_scan`` are shared with the backward kernels (``triton_bwd``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["LOG2E", "doc_mode", "fwd_launch", "head_dims", "softcap_constexpr"]

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_BIG = tl.constexpr(1 << 30)  # sentinel bound; positions must be smaller


@triton.jit
def _classify(
    q_lo, q_hi, k_lo, k_hi, qd_lo, qd_hi, kd_lo, kd_hi, window,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """``(empty, full)`` of tiles with these position / document bounds (scalars or vectors).

    ``HAS_DOCS``: 0 none, 1 document ids, 2 block codes (``mask.BlockMask.blocks``: -1 padding, 0 ordinary, c > 0
    block c, which sees itself both ways). A tile without valid rows carries the sentinel bounds
    ``lo = BIG > hi = -BIG``: empty.
    """
    empty = (q_lo > q_hi) | (k_lo > k_hi)
    full = empty == 0
    if CAUSAL:
        if HAS_DOCS == 2:  # block codes: keys after the queries are hidden unless a block may span both sides
            share = tl.maximum(tl.maximum(qd_lo, kd_lo), 1) <= tl.minimum(qd_hi, kd_hi)
            empty = empty | ((k_lo > q_hi) & (share == 0))
        else:
            empty = empty | (k_lo > q_hi)
        full = full & (k_hi <= q_lo)
    if HAS_WINDOW:
        if CAUSAL:
            empty = empty | (q_lo - k_hi >= window)
            full = full & (q_hi - k_lo < window)
        else:
            empty = empty | (q_lo - k_hi >= window) | (k_lo - q_hi >= window)
            full = full & (q_hi - k_lo < window) & (k_hi - q_lo < window)
    if HAS_DOCS == 2:  # block codes: only padding (-1) hides
        empty = empty | (qd_hi < 0) | (kd_hi < 0)
        full = full & (qd_lo >= 0) & (kd_lo >= 0)
    elif HAS_DOCS:
        empty = empty | (qd_hi < 0) | (kd_hi < 0) | (qd_hi < kd_lo) | (kd_hi < qd_lo)
        full = full & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
    full = full & (empty == 0)
    return empty, full


@triton.jit
def _bounds(POS, DOC, offs, valid, AXIS: tl.constexpr, HAS_DOCS: tl.constexpr):
    """Min/max of the valid positions and document ids at ``offs``, reduced along ``AXIS``."""
    p = tl.load(POS + offs, mask=valid, other=0)
    lo = tl.min(tl.where(valid, p, _BIG), axis=AXIS)
    hi = tl.max(tl.where(valid, p, -_BIG), axis=AXIS)
    if HAS_DOCS:
        d = tl.load(DOC + offs, mask=valid, other=-1)
        dlo = tl.min(tl.where(valid, d, _BIG), axis=AXIS)
        dhi = tl.max(tl.where(valid, d, -_BIG), axis=AXIS)
    else:
        dlo = lo
        dhi = hi
    return lo, hi, dlo, dhi


@triton.jit
def _tile_class(
    POS, DOC, tile, L, f_lo, f_hi, fd_lo, fd_hi, window,
    SCAN_KEYS: tl.constexpr, BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """``(empty, full)`` of scanned tile ``tile`` against the fixed tile with the given bounds."""
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    valid = offs < L
    lo, hi, dlo, dhi = _bounds(POS, DOC, offs, valid, 0, HAS_DOCS)
    if SCAN_KEYS:
        empty, full = _classify(f_lo, f_hi, lo, hi, fd_lo, fd_hi, dlo, dhi, window, CAUSAL, HAS_WINDOW, HAS_DOCS)
    else:
        empty, full = _classify(lo, hi, f_lo, f_hi, dlo, dhi, fd_lo, fd_hi, window, CAUSAL, HAS_WINDOW, HAS_DOCS)
    full = full & ((tile + 1) * BLOCK <= L)  # a ragged tile always takes the masked path
    return empty, full


@triton.jit
def _scan(
    POS, DOC, L, f_lo, f_hi, fd_lo, fd_hi, window,
    SCAN_KEYS: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr,
):  # fmt: skip
    """Classify every tile of the scanned side (keys if ``SCAN_KEYS`` else queries), ``SCAN`` at a time.

    Returns ``(first, full_first, full_end, end)``: tiles ``[first, end)`` hold every non-empty
    tile; ``[full_first, full_end)`` is a run of FULL tiles inside it (empty when the full tiles
    are not contiguous, then ``full_first = full_end = end``).
    """
    n_tiles = tl.cdiv(L, BLOCK)
    first = n_tiles
    last = n_tiles * 0 - 1
    f_first = n_tiles
    f_last = n_tiles * 0 - 1
    n_full = n_tiles * 0
    for t0 in range(0, n_tiles, SCAN):
        tid = t0 + tl.arange(0, SCAN)
        offs = tid[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        valid = offs < L
        lo, hi, dlo, dhi = _bounds(POS, DOC, offs, valid, 1, HAS_DOCS)
        if SCAN_KEYS:
            empty, full = _classify(f_lo, f_hi, lo, hi, fd_lo, fd_hi, dlo, dhi, window, CAUSAL, HAS_WINDOW, HAS_DOCS)
        else:
            empty, full = _classify(lo, hi, f_lo, f_hi, dlo, dhi, fd_lo, fd_hi, window, CAUSAL, HAS_WINDOW, HAS_DOCS)
        full = full & ((tid + 1) * BLOCK <= L)
        live = (empty == 0) & (tid < n_tiles)
        first = tl.minimum(first, tl.min(tl.where(live, tid, n_tiles), axis=0))
        last = tl.maximum(last, tl.max(tl.where(live, tid, -1), axis=0))
        f_first = tl.minimum(f_first, tl.min(tl.where(full, tid, n_tiles), axis=0))
        f_last = tl.maximum(f_last, tl.max(tl.where(full, tid, -1), axis=0))
        n_full += tl.sum(full.to(tl.int32), axis=0)
    end = last + 1
    run = (n_full > 0) & (n_full == f_last - f_first + 1)
    f_first = tl.where(run, f_first, end)
    f_end = tl.where(run, f_last + 1, end)
    return first, f_first, f_end, end


def doc_mode(has_docs: bool, blocks: bool) -> int:
    """The kernels' ``HAS_DOCS`` value: 0 no documents, 1 document ids, 2 block codes."""
    return 0 if not has_docs else 2 if blocks else 1


def head_dims(head_dim: int, v_head_dim: int) -> dict:
    """The kernels' head-size constants: q/k's and v's head_dim and their tiles (powers of two, at least 16)."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HEAD_DIM_V=v_head_dim,
                BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)))  # fmt: skip


def softcap_constexpr(softcap: float | None) -> float:
    """The ``SOFTCAP`` compile-time value of the kernels: the cap in log2 units, 0.0 for none.

    Scores are in log2 units (``scale * log2(e) * q.k``), so ``c * tanh(x / c)`` on natural scores is
    ``c2 * tanh(s / c2)`` on them with ``c2 = c * log2(e)``. A model has one cap, so one compilation.
    """
    return 0.0 if softcap is None else float(softcap) * LOG2E


@triton.jit
def _tanh(x):
    """tanh from exp2 (Triton has no tanh): sign(x) * (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1]."""
    neg = x < 0.0
    e = tl.math.exp2(tl.where(neg, x, -x) * 2.8853900817779268)  # exp(-2|x|): 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(neg, -t, t)


@triton.jit
def _visible(qp, kp, qd, kd, row_ok, col_ok, window,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    """Element-wise visibility of queries ``qp`` (rows) and keys ``kp`` (columns) of a tile (``HAS_DOCS`` as in
    ``_classify``; with block codes: not padding, and the key not after the query or in the query's block)."""
    vis = row_ok[:, None] & col_ok[None, :]
    if CAUSAL:
        after = kp[None, :] <= qp[:, None]
        if HAS_DOCS == 2:
            after = after | ((qd[:, None] == kd[None, :]) & (qd[:, None] > 0))
        vis = vis & after
    if HAS_WINDOW:
        dist = qp[:, None] - kp[None, :]
        if CAUSAL:
            vis = vis & (dist < window)
        else:
            vis = vis & (dist < window) & (-dist < window)
    if HAS_DOCS == 2:
        vis = vis & (qd[:, None] >= 0) & (kd[None, :] >= 0)
    elif HAS_DOCS:
        vis = vis & (qd[:, None] == kd[None, :]) & (qd[:, None] >= 0)
    return vis


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, qp, qd, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn, stride_vd,
    start_n, Lk, qk_scale, window, slope,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax; ``MASKED`` evaluates the mask element-wise; ``SOFTCAP`` > 0
    caps the (log2-unit) scores at ``SOFTCAP * tanh(s / SOFTCAP)`` before the mask; ``ALIBI`` adds
    ``slope * (k_pos - q_pos)`` (``slope``: the head's, in log2 units)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kt_ptrs = K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    v_ptrs = V + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    if MASKED:
        n_ok = offs_n < Lk
        kt = tl.load(kt_ptrs, mask=n_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            kt = tl.load(kt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        if BLOCK_DV == HEAD_DIM_V:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, kt) * qk_scale
    if SOFTCAP > 0.0:
        s = SOFTCAP * _tanh(s / SOFTCAP)
    if MASKED:  # (the key positions, loaded once for the mask and ALiBi's bias)
        kp = tl.load(KPOS + offs_n, mask=n_ok, other=0)
    elif ALIBI:  # (a full tile lies inside the block)
        kp = tl.load(KPOS + offs_n)
    if ALIBI:
        s += slope * (kp[None, :] - qp[:, None]).to(tl.float32)
    if MASKED:
        if HAS_DOCS:
            kd = tl.load(KDOC + offs_n, mask=n_ok, other=-1)
        else:
            kd = kp
        vis = _visible(qp, kp, qd, kd, qp == qp, n_ok, window, CAUSAL, HAS_WINDOW, HAS_DOCS)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: p = 0
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc += tl.dot(p, v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(
    Q, K, V, OUT, LSE, QPOS, KPOS, QDOC, KDOC, SLOPES,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_qdoc, stride_kdoc,
    Lq, Lk, HQ, GROUP, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP
    if ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32) * _LOG2E
    else:
        slope = 0.0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    if HAS_DOCS:
        QDOC += b.to(tl.int64) * stride_qdoc
        KDOC += b.to(tl.int64) * stride_kdoc
    # Bounds of this query tile, then the tiles of the key block it has to visit.
    q_lo, q_hi, qd_lo, qd_hi = _bounds(QPOS, QDOC, offs_m, m_ok, 0, HAS_DOCS)
    first, f_first, f_end, end = _scan(
        KPOS, KDOC, Lk, q_lo, q_hi, qd_lo, qd_hi, window, True, BLOCK_N, SCAN, CAUSAL, HAS_WINDOW, HAS_DOCS
    )
    if first < end:
        qp = tl.load(QPOS + offs_m, mask=m_ok, other=0)
        if HAS_DOCS:
            qd = tl.load(QDOC + offs_m, mask=m_ok, other=-1)
        else:
            qd = qp
        Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
        q_mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        # Tiles before the full run: classified one by one.
        for t in range(first, f_first):
            empty, full = _tile_class(
                KPOS, KDOC, t, Lk, q_lo, q_hi, qd_lo, qd_hi, window, True, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS
            )
            if full:
                acc, l_i, m_i = _fwd_tile(
                    acc, l_i, m_i, q, qp, qd, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn, stride_vd,
                    t * BLOCK_N, Lk, qk_scale, window, slope,
                    False, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
            elif empty == 0:
                acc, l_i, m_i = _fwd_tile(
                    acc, l_i, m_i, q, qp, qd, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn, stride_vd,
                    t * BLOCK_N, Lk, qk_scale, window, slope,
                    True, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
        # The run of fully visible tiles: no mask, no branch.
        for t in range(f_first, f_end):
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, q, qp, qd, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn, stride_vd,
                t * BLOCK_N, Lk, qk_scale, window, slope,
                False, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
            )  # fmt: skip
        # Tiles after it (the diagonal of a causal block, the edge of a window).
        for t in range(f_end, end):
            empty, full = _tile_class(
                KPOS, KDOC, t, Lk, q_lo, q_hi, qd_lo, qd_hi, window, True, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS
            )
            if full:
                acc, l_i, m_i = _fwd_tile(
                    acc, l_i, m_i, q, qp, qd, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn, stride_vd,
                    t * BLOCK_N, Lk, qk_scale, window, slope,
                    False, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
            elif empty == 0:
                acc, l_i, m_i = _fwd_tile(
                    acc, l_i, m_i, q, qp, qd, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn, stride_vd,
                    t * BLOCK_N, Lk, qk_scale, window, slope,
                    True, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
        # Epilogue: merge (acc / l_i, m_i + log2 l_i) into the natural-log accumulators in place.
        offs_dv = tl.arange(0, BLOCK_DV)
        o_mask = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        o_ptrs = (
            OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
            + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
        )  # fmt: skip
        l_ptrs = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m * stride_lm
        old = tl.load(l_ptrs, mask=m_ok, other=float("-inf")) * _LOG2E
        seen = l_i > 0.0
        blk = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        top = tl.maximum(old, blk)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.math.exp2(old - top)
        w_blk = tl.math.exp2(blk - top)
        tot = w_old + w_blk
        inv = 1.0 / tl.where(tot > 0.0, tot, 1.0)
        o_old = tl.load(o_ptrs, mask=o_mask, other=0.0)
        o_new = o_old * (w_old * inv)[:, None] + acc * (w_blk * inv / tl.where(seen, l_i, 1.0))[:, None]
        lse_new = tl.where(tot > 0.0, top + tl.math.log2(tl.where(tot > 0.0, tot, 1.0)), float("-inf"))
        tl.store(o_ptrs, o_new, mask=o_mask)
        tl.store(l_ptrs, lse_new * _LN2, mask=m_ok)


def fwd_launch(
    q, k, v, pos, scale: float, causal: bool, window, out, lse, cfg, softcap=None, blocks=False, slopes=None
) -> None:
    """Launch the forward kernel; ``out`` [B, Hq, Lq, Dv] and ``lse`` [B, Hq, Lq] fp32 are updated in place
    (``Dv``: v's head_dim, which may differ from q's and k's).

    pos: ``(q_pos, k_pos, q_doc, k_doc)`` int32 device tensors (docs ``[1 or B, L]`` or None).
    cfg: a ``triton_backend.KernelConfig``. softcap: attention logit softcapping (None: off). blocks: the docs are
    block codes (``mask.BlockMask.blocks``). slopes: ALiBi's, [q_heads] fp32 on the device (None: off).
    """
    batch, hq, lq, head_dim = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    q_pos, k_pos, q_doc, k_doc = pos
    has_docs = q_doc is not None
    if has_docs:
        doc_strides = (q_doc.stride(0) if q_doc.shape[0] > 1 else 0, k_doc.stride(0) if k_doc.shape[0] > 1 else 0)
    else:
        q_doc, k_doc, doc_strides = q_pos, k_pos, (0, 0)
    grid = (triton.cdiv(lq, cfg.block_m), batch * hq)
    _fwd_kernel[grid](
        q, k, v, out, lse, q_pos, k_pos, q_doc, k_doc, q_pos if slopes is None else slopes,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(), *doc_strides,
        lq, lk, hq, hq // hkv, scale * LOG2E, 0 if window is None else int(window),
        **head_dims(head_dim, v.shape[-1]), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SCAN=cfg.scan,
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_DOCS=doc_mode(has_docs, blocks),
        UPCAST=cfg.upcast or q.dtype == torch.float32, SOFTCAP=softcap_constexpr(softcap), ALIBI=slopes is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
