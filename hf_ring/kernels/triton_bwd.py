"""Triton backward kernels of one ring step: dQ, and dK/dV with the GQA group summed in-kernel.

Both recompute the probabilities from the final (global) natural-log LSE of the forward pass,
``p = exp(scale * q.k - lse)``, and use ``delta = rowsum(dO * O)`` of the final output, so a ring
step's contribution needs nothing from the other steps:

- ``_dq_kernel``: one program per (query tile, batch, query head) walks the key tiles;
  ``dQ += scale * dS @ K`` with ``dS = P * (dO @ V^T - delta)``.
- ``_dkdv_kernel``: one program per (key tile, batch, key/value head) walks every query head of
  its GQA group and every query tile: ``dV += P^T @ dO``, ``dK += scale * dS^T @ Q``. The group's
  heads are summed in registers, so no atomics are needed and the result is deterministic.

Tiles are classified and skipped exactly as in the forward kernel (``triton_fwd._scan``), with the
roles of queries and keys swapped in the dK/dV kernel. Results are added (``+=``) into fp32
gradient buffers, read and written once per program. A row whose LSE is ``-inf`` (it saw no key)
gets probability 0: its LSE is read as ``+inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fwd import (
    _LOG2E,
    LOG2E,
    _bounds,
    _scan,
    _tanh,
    _tile_class,
    _visible,
    doc_mode,
    head_dims,
    softcap_constexpr,
)  # fmt: skip

__all__ = ["bwd_launch"]


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, qp, qd, m_ok, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn, stride_vd,
    start_n, Lk, qk_scale, window, slope,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kt_ptrs = K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    vt_ptrs = V + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd
    n_ok = offs_n < Lk
    if MASKED or BLOCK_D != HEAD_DIM:
        kt = tl.load(kt_ptrs, mask=n_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    else:
        kt = tl.load(kt_ptrs)
    if MASKED or BLOCK_DV != HEAD_DIM_V:
        vt = tl.load(vt_ptrs, mask=n_ok[None, :] & (offs_dv[:, None] < HEAD_DIM_V), other=0.0)
    else:
        vt = tl.load(vt_ptrs)
    if UPCAST:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee")
        dp = tl.dot(do, vt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
        dp = tl.dot(do, vt)
    s = s * qk_scale
    if SOFTCAP > 0.0:
        t = _tanh(s / SOFTCAP)
        s = SOFTCAP * t
    if MASKED or ALIBI:  # (the key positions, loaded once for the mask and ALiBi's bias)
        kp = tl.load(KPOS + offs_n, mask=n_ok, other=0)
    if ALIBI:  # (ALiBi's bias: no gradient of its own, the score's flows to q and k as without it)
        s += slope * (kp[None, :] - qp[:, None]).to(tl.float32)
    p = tl.math.exp2(s - lse2[:, None])
    if MASKED:
        if HAS_DOCS:
            kd = tl.load(KDOC + offs_n, mask=n_ok, other=-1)
        else:
            kd = kp
        p = tl.where(_visible(qp, kp, qd, kd, m_ok, n_ok, window, CAUSAL, HAS_WINDOW, HAS_DOCS), p, 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP > 0.0:
        ds = ds * (1.0 - t * t)  # d(c * tanh(x / c)) / dx
    if UPCAST:
        dq += tl.dot(ds, tl.trans(kt), input_precision="ieee")
    else:
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, KPOS, QDOC, KDOC, SLOPES,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_qdoc, stride_kdoc,
    Lq, Lk, HQ, GROUP, qk_scale, scale, window,
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
        bh_q = b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        bh_o = b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        bh_l = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
        K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
        tile_mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        offs_dv = tl.arange(0, BLOCK_DV)
        do_mask = m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        q = tl.load(Q + bh_q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=tile_mask, other=0.0)
        do = tl.load(DO + bh_o + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od, mask=do_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + bh_l + offs_m * stride_lm, mask=m_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)  # rows that saw nothing: p = 0
        delta = tl.load(DELTA + bh_l + offs_m * stride_lm, mask=m_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for t in range(first, f_first):
            empty, full = _tile_class(
                KPOS, KDOC, t, Lk, q_lo, q_hi, qd_lo, qd_hi, window, True, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS
            )
            if full:
                dq = _dq_tile(
                    dq, q, do, lse2, delta, qp, qd, m_ok, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn,
                    stride_vd, t * BLOCK_N, Lk, qk_scale, window, slope,
                    False, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
            elif empty == 0:
                dq = _dq_tile(
                    dq, q, do, lse2, delta, qp, qd, m_ok, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn,
                    stride_vd, t * BLOCK_N, Lk, qk_scale, window, slope,
                    True, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
        for t in range(f_first, f_end):
            dq = _dq_tile(
                dq, q, do, lse2, delta, qp, qd, m_ok, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn,
                stride_vd, t * BLOCK_N, Lk, qk_scale, window, slope,
                False, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
            )  # fmt: skip
        for t in range(f_end, end):
            empty, full = _tile_class(
                KPOS, KDOC, t, Lk, q_lo, q_hi, qd_lo, qd_hi, window, True, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS
            )
            if full:
                dq = _dq_tile(
                    dq, q, do, lse2, delta, qp, qd, m_ok, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn,
                    stride_vd, t * BLOCK_N, Lk, qk_scale, window, slope,
                    False, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
            elif empty == 0:
                dq = _dq_tile(
                    dq, q, do, lse2, delta, qp, qd, m_ok, K, V, KPOS, KDOC, stride_kn, stride_kd, stride_vn,
                    stride_vd, t * BLOCK_N, Lk, qk_scale, window, slope,
                    True, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
        g_ptrs = (
            DQ + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
            + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd
        )  # fmt: skip
        tl.store(g_ptrs, tl.load(g_ptrs, mask=tile_mask, other=0.0) + dq * scale, mask=tile_mask)


@triton.jit
def _dkdv_tile(
    dk, dv, kk, vv, kp, kd, n_ok, Q, DO, LSE, DELTA, QPOS, QDOC,
    stride_qm, stride_qd, stride_om, stride_od, stride_lm,
    start_m, Lq, qk_scale, window, slope,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):  # fmt: skip
    """One query tile against the program's key tile, in transposed form (keys are the rows)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    qt_ptrs = Q + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd
    do_ptrs = DO + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    m_ok = offs_m < Lq
    if MASKED or BLOCK_D != HEAD_DIM:
        qt = tl.load(qt_ptrs, mask=m_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    else:
        qt = tl.load(qt_ptrs)
    if MASKED or BLOCK_DV != HEAD_DIM_V:
        do = tl.load(do_ptrs, mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    else:
        do = tl.load(do_ptrs)
    if MASKED:
        lse = tl.load(LSE + offs_m * stride_lm, mask=m_ok, other=float("-inf"))
        delta = tl.load(DELTA + offs_m * stride_lm, mask=m_ok, other=0.0)
    else:
        lse = tl.load(LSE + offs_m * stride_lm)
        delta = tl.load(DELTA + offs_m * stride_lm)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    if UPCAST:
        qt = qt.to(tl.float32)
        do = do.to(tl.float32)
        st = tl.dot(kk, qt, input_precision="ieee")
        dpt = tl.dot(vv, tl.trans(do), input_precision="ieee")
    else:
        st = tl.dot(kk, qt)
        dpt = tl.dot(vv, tl.trans(do))
    st = st * qk_scale
    if SOFTCAP > 0.0:
        tt = _tanh(st / SOFTCAP)
        st = SOFTCAP * tt
    if MASKED or ALIBI:  # (the query positions, loaded once for the mask and ALiBi's bias)
        qp = tl.load(QPOS + offs_m, mask=m_ok, other=0)
    if ALIBI:
        st += slope * (kp[:, None] - qp[None, :]).to(tl.float32)
    pt = tl.math.exp2(st - lse2[None, :])
    if MASKED:
        if HAS_DOCS:
            qd = tl.load(QDOC + offs_m, mask=m_ok, other=-1)
        else:
            qd = qp
        vis = _visible(qp, kp, qd, kd, m_ok, n_ok, window, CAUSAL, HAS_WINDOW, HAS_DOCS)
        pt = tl.where(tl.trans(vis), pt, 0.0)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP > 0.0:
        dst = dst * (1.0 - tt * tt)
    if UPCAST:
        dv += tl.dot(pt, do, input_precision="ieee")
        dk += tl.dot(dst, tl.trans(qt), input_precision="ieee")
    else:
        dv += tl.dot(pt.to(do.dtype), do)
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt))
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, KPOS, QDOC, KDOC, SLOPES,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_lb, stride_lh, stride_lm,
    stride_qdoc, stride_kdoc,
    Lq, Lk, HKV, GROUP, qk_scale, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < Lk
    if HAS_DOCS:
        QDOC += b.to(tl.int64) * stride_qdoc
        KDOC += b.to(tl.int64) * stride_kdoc
    k_lo, k_hi, kd_lo, kd_hi = _bounds(KPOS, KDOC, offs_n, n_ok, 0, HAS_DOCS)
    first, f_first, f_end, end = _scan(
        QPOS, QDOC, Lq, k_lo, k_hi, kd_lo, kd_hi, window, False, BLOCK_M, SCAN, CAUSAL, HAS_WINDOW, HAS_DOCS
    )
    if first < end:
        kp = tl.load(KPOS + offs_n, mask=n_ok, other=0)
        if HAS_DOCS:
            kd = tl.load(KDOC + offs_n, mask=n_ok, other=-1)
        else:
            kd = kp
        tile_mask = n_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        offs_dv = tl.arange(0, BLOCK_DV)
        v_mask = n_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        kv_off = b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
        kk = tl.load(K + kv_off + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=tile_mask, other=0.0)
        kv_off = b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
        vv = tl.load(V + kv_off + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd, mask=v_mask, other=0.0)
        if UPCAST:
            kk = kk.to(tl.float32)
            vv = vv.to(tl.float32)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        for g in range(0, GROUP):
            h = hk * GROUP + g
            Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
            DOh = DO + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
            bh_l = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
            LSEh = LSE + bh_l
            DELTAh = DELTA + bh_l
            if ALIBI:
                slope = tl.load(SLOPES + h).to(tl.float32) * _LOG2E
            else:
                slope = 0.0
            for t in range(first, f_first):
                empty, full = _tile_class(
                    QPOS, QDOC, t, Lq, k_lo, k_hi, kd_lo, kd_hi, window, False, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_DOCS
                )
                if full:
                    dk, dv = _dkdv_tile(
                        dk, dv, kk, vv, kp, kd, n_ok, Qh, DOh, LSEh, DELTAh, QPOS, QDOC,
                        stride_qm, stride_qd, stride_om, stride_od, stride_lm, t * BLOCK_M, Lq, qk_scale, window, slope,
                        False, HEAD_DIM, BLOCK_D,
                        HEAD_DIM_V, BLOCK_DV, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                    )  # fmt: skip
                elif empty == 0:
                    dk, dv = _dkdv_tile(
                        dk, dv, kk, vv, kp, kd, n_ok, Qh, DOh, LSEh, DELTAh, QPOS, QDOC,
                        stride_qm, stride_qd, stride_om, stride_od, stride_lm, t * BLOCK_M, Lq, qk_scale, window, slope,
                        True, HEAD_DIM, BLOCK_D,
                        HEAD_DIM_V, BLOCK_DV, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                    )  # fmt: skip
            for t in range(f_first, f_end):
                dk, dv = _dkdv_tile(
                    dk, dv, kk, vv, kp, kd, n_ok, Qh, DOh, LSEh, DELTAh, QPOS, QDOC,
                    stride_qm, stride_qd, stride_om, stride_od, stride_lm, t * BLOCK_M, Lq, qk_scale, window, slope,
                    False, HEAD_DIM, BLOCK_D,
                    HEAD_DIM_V, BLOCK_DV, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                )  # fmt: skip
            for t in range(f_end, end):
                empty, full = _tile_class(
                    QPOS, QDOC, t, Lq, k_lo, k_hi, kd_lo, kd_hi, window, False, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_DOCS
                )
                if full:
                    dk, dv = _dkdv_tile(
                        dk, dv, kk, vv, kp, kd, n_ok, Qh, DOh, LSEh, DELTAh, QPOS, QDOC,
                        stride_qm, stride_qd, stride_om, stride_od, stride_lm, t * BLOCK_M, Lq, qk_scale, window, slope,
                        False, HEAD_DIM, BLOCK_D,
                        HEAD_DIM_V, BLOCK_DV, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                    )  # fmt: skip
                elif empty == 0:
                    dk, dv = _dkdv_tile(
                        dk, dv, kk, vv, kp, kd, n_ok, Qh, DOh, LSEh, DELTAh, QPOS, QDOC,
                        stride_qm, stride_qd, stride_om, stride_od, stride_lm, t * BLOCK_M, Lq, qk_scale, window, slope,
                        True, HEAD_DIM, BLOCK_D,
                        HEAD_DIM_V, BLOCK_DV, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_DOCS, UPCAST, SOFTCAP, ALIBI,
                    )  # fmt: skip
        dk_ptrs = (
            DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
            + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
        )  # fmt: skip
        dv_ptrs = (
            DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
            + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd
        )  # fmt: skip
        tl.store(dk_ptrs, tl.load(dk_ptrs, mask=tile_mask, other=0.0) + dk * scale, mask=tile_mask)
        tl.store(dv_ptrs, tl.load(dv_ptrs, mask=v_mask, other=0.0) + dv, mask=v_mask)


def bwd_launch(
    do,
    q,
    k,
    v,
    lse,
    delta,
    pos,
    scale: float,
    causal: bool,
    window,
    dq,
    dk,
    dv,
    cfg,
    softcap=None,
    blocks=False,
    slopes=None,
):
    """Launch the dQ and dK/dV kernels; ``dq``, ``dk``, ``dv`` (fp32) are accumulated in place.

    pos: ``(q_pos, k_pos, q_doc, k_doc)`` int32 device tensors (docs ``[1 or B, L]`` or None).
    cfg: a ``triton_backend.KernelConfig`` (its ``dq_*`` and ``dkv_*`` fields). softcap, blocks, slopes: as in
    ``fwd_launch``.
    """
    batch, hq, lq, head_dim = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    q_pos, k_pos, q_doc, k_doc = pos
    has_docs = q_doc is not None
    if has_docs:
        doc_strides = (q_doc.stride(0) if q_doc.shape[0] > 1 else 0, k_doc.stride(0) if k_doc.shape[0] > 1 else 0)
    else:
        q_doc, k_doc, doc_strides = q_pos, k_pos, (0, 0)
    common = dict(
        **head_dims(head_dim, v.shape[-1]), SCAN=cfg.scan,
        CAUSAL=bool(causal), HAS_WINDOW=window is not None, HAS_DOCS=doc_mode(has_docs, blocks),
        UPCAST=cfg.upcast or q.dtype == torch.float32, SOFTCAP=softcap_constexpr(softcap), ALIBI=slopes is not None,
    )  # fmt: skip
    slopes = q_pos if slopes is None else slopes  # (a pointer the kernels do not read without ALIBI)
    win = 0 if window is None else int(window)
    _dq_kernel[(triton.cdiv(lq, cfg.dq_block_m), batch * hq)](
        q, k, v, do, lse, delta, dq, q_pos, k_pos, q_doc, k_doc, slopes,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *lse.stride(), *doc_strides,
        lq, lk, hq, hq // hkv, scale * LOG2E, scale, win,
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages,
        **common,
    )  # fmt: skip
    _dkdv_kernel[(triton.cdiv(lk, cfg.dkv_block_n), batch * hkv)](
        q, k, v, do, lse, delta, dk, dv, q_pos, k_pos, q_doc, k_doc, slopes,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *lse.stride(),
        *doc_strides, lq, lk, hkv, hq // hkv, scale * LOG2E, scale, win,
        BLOCK_M=cfg.dkv_block_m, BLOCK_N=cfg.dkv_block_n, num_warps=cfg.dkv_num_warps,
        num_stages=cfg.dkv_num_stages, **common,
    )  # fmt: skip
