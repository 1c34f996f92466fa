"""Reference local-block kernels in plain PyTorch (the ``"torch"`` backend; the default on CPU).

One ring step attends the local queries to the key/value block held at that step and merges the
result into fp32 accumulators with the log-sum-exp rule. Work is tiled over queries and keys, so
at most ``block_q x block_k`` scores per (batch, kv-head, group) exist at once; tiles the mask
hides completely are skipped and tiles it shows completely skip the mask. Tile edges follow the
runs of consecutive positions (the two halves of a zig-zag shard), so a half-visible block costs
half.

GQA: query head ``h`` reads key/value head ``h // group``; the group is folded into the rows of
the score matrix, nothing is repeated.

Numerics: scores, softmax and accumulators are fp32 whatever the input dtype; LSE is natural-log.
A row that sees no key keeps ``lse = -inf`` and output 0; in the backward its probabilities are 0.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .mask import EMPTY, FULL, BlockMask

__all__ = ["ALIBI", "BIAS", "SELECT", "SOFTCAP", "forward", "backward", "merge_", "tiles"]

BLOCK_Q = 512
BLOCK_K = 512
SOFTCAP = True  # implements attention logit softcapping (``softcap=``)
SELECT = True  # reads a mask's selection (``BlockMask.with_selection``: DeepSeek sparse attention's top-k)
BIAS = True  # adds a per-query bias by distance (``bias=``: Inkling's relative position bias)
ALIBI = True  # or ALiBi's slopes (``bias=`` [q_heads])


def tiles(pos: torch.Tensor, block: int) -> list[slice]:
    """Split local indices into tiles of at most ``block`` that never straddle a jump in ``pos``."""
    n = pos.numel()
    if n == 0:
        return []
    cuts = [0]
    if n > 1:
        d = pos[1:] - pos[:-1]
        breaks = (torch.nonzero(d != d[0]).flatten() + 1).tolist()
    else:
        breaks = []
    for end in breaks + [n]:
        start = cuts[-1]
        cuts.extend(range(start + block, end, block))
        cuts.append(end)
    return [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def merge_(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """In place: ``(out, lse) <- merge((out, lse), (blk_out, blk_lse))`` by the LSE rule.

    out/blk_out: [..., L, D] fp32 (normalised); lse/blk_lse: [..., L] fp32, -inf for empty rows.
    """
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_blk = torch.exp(blk_lse - safe).unsqueeze(-1)
    out.mul_(w_old).add_(blk_out * w_blk)
    lse.copy_(new)


def _fold(x: torch.Tensor, kv_heads: int, qs: slice) -> torch.Tensor:
    """[B, Hq, L, D] -> rows qs of every group member: [B, Hkv, G * tile, D] (fp32)."""
    b, hq, _, d = x.shape
    g = hq // kv_heads
    return x[:, :, qs].reshape(b, kv_heads, g * (qs.stop - qs.start), d).float()


def _unfold_rows(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hkv, G * tile, ...] -> [B, Hq, tile, ...]."""
    b, hkv = x.shape[:2]
    g = hq // hkv
    return x.reshape(b, hkv * g, x.shape[2] // g, *x.shape[3:])


def _on(mask: BlockMask, device: torch.device) -> BlockMask:
    """``mask`` with its positions and documents on ``device`` for the tile masks (uploaded once per mask, without
    blocking: no host-device copy per tile on a GPU); the mask itself elsewhere, and while dynamo traces."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return mask
    key = ("tiles on", str(device))
    if key not in mask._cache:
        t = mask.device_tensors(device)
        mask._cache[key] = dataclasses.replace(mask, **t, _cache={})
    return mask._cache[key]


def _tile_mask(mask: BlockMask, qs: slice, ks: slice, group: int) -> torch.Tensor:
    """Dense mask of a tile, broadcastable to the folded scores [B, Hkv, G * tile_q, tile_k] (``mask`` as ``_on``
    gives it: on the scores' device)."""
    vis = mask.visible(qs, ks)  # [Bd, tq, tk], or [B, Hkv, tq, tk] with a selection per key/value head
    if vis.dim() == 3:
        vis = vis[:, None]
    bd, h, tq, tk = vis.shape
    return vis[:, :, None].expand(bd, h, group, tq, tk).reshape(bd, h, group * tq, tk)


def _scores(qf, kt, scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scores, tanh)``: ``scale * q k^T``, softcapped (``softcap * tanh(s / softcap)``) when asked; the
    tanh is returned for the backward's chain rule (None without softcapping)."""
    s = torch.matmul(qf, kt.transpose(-1, -2)).mul_(scale)
    if softcap is None:
        return s, None
    t = torch.tanh(s.div_(softcap))
    return t * softcap, t


def _distances(mask: BlockMask, qs: slice, ks: slice, extent: int, group: int, device: torch.device):
    """``(index, inside)`` of a tile for a bias by distance, broadcastable to the folded scores, on ``device``: the
    backward distance ``q_pos - k_pos`` clamped into ``[0, extent)`` and where it lies there ([G * tile_q, tile_k]
    each; ``mask`` as ``_on`` gives it: its positions on the scores' device on a GPU, else on the host)."""
    dist = (mask.q_pos[qs][:, None].long() - mask.k_pos[ks][None, :].long()).to(device)
    inside = (dist >= 0) & (dist < extent)
    return dist.clamp(0, extent - 1).repeat(group, 1), inside.repeat(group, 1)


def _tile_bias(bias: torch.Tensor, where, kv_heads: int, qs: slice) -> torch.Tensor:
    """The bias of a tile, folded like its scores: ``bias``'s rows ``qs`` read at the tile's distances (0 outside
    the extent). ``where``: ``_distances``'s."""
    index, inside = where
    table = _fold(bias, kv_heads, qs)
    return table.gather(-1, index.expand(*table.shape[:2], -1, -1)).masked_fill_(~inside, 0.0)


def _slopes_bias(slopes: torch.Tensor, mask: BlockMask, qs: slice, ks: slice, kv_heads: int, device) -> torch.Tensor:
    """ALiBi's bias of a tile, folded like its scores: ``-slope * (q_pos - k_pos)`` with a slope per query head
    (``slopes`` [q_heads]); [kv_heads, G * tile_q, tile_k] (``mask`` as ``_on`` gives it)."""
    dist = (mask.q_pos[qs][:, None].long() - mask.k_pos[ks][None, :].long()).to(device, torch.float32)
    group, rows = slopes.numel() // kv_heads, qs.stop - qs.start
    column = slopes.float().view(kv_heads, group, 1, 1).expand(kv_heads, group, rows, 1).reshape(kv_heads, -1, 1)
    return -(column * dist.repeat(group, 1))


def _add_bias(s: torch.Tensor, bias: torch.Tensor, mask: BlockMask, qs: slice, ks: slice, kv_heads: int):
    """``s`` plus the tile's bias: a table by distance ([batch, q_heads, local_q, E]) or ALiBi's slopes ([q_heads]);
    returns the table's ``where`` (``_distances``) for its gradient, or None."""
    if bias.dim() == 1:
        s += _slopes_bias(bias, mask, qs, ks, kv_heads, s.device)
        return None
    where = _distances(mask, qs, ks, bias.shape[-1], bias.shape[1] // kv_heads, s.device)
    s += _tile_bias(bias, where, kv_heads, qs)
    return where


def forward(q, k, v, mask: BlockMask, scale: float, out: torch.Tensor, lse: torch.Tensor, *, softcap=None, bias=None):
    """Attend ``q`` to one key/value block and merge into the accumulators in place.

    q: [batch, q_heads, local_q, head_dim]; k: [batch, kv_heads, local_k, head_dim]; v: [batch, kv_heads,
    local_k, v_head_dim] (v's head_dim may differ, as in multi-head latent attention).
    out: [batch, q_heads, local_q, v_head_dim] fp32; lse: [batch, q_heads, local_q] fp32.
    softcap: None, or the cap of attention logit softcapping (applied before masking).
    bias: None, or [batch, q_heads, local_q, E]: each query's additive bias by backward distance ``d = q_pos - k_pos``
        (the query's row at ``d`` for ``0 <= d < E``, 0 elsewhere), added to the scaled scores (not with softcap); or
        [q_heads]: ALiBi's slope per head, the bias ``-slope * d``.
    Returns ``(out, lse)``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    k_tiles = tiles(mask.k_pos, BLOCK_K)
    on_device = _on(mask, q.device)
    for qs in tiles(mask.q_pos, BLOCK_Q):
        qf = _fold(q, hkv, qs)
        m = torch.full(qf.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        acc = qf.new_zeros(*qf.shape[:-1], v.shape[-1])
        denom = torch.zeros_like(m)
        for ks in k_tiles:
            kind = mask.classify(qs, ks)
            if kind == EMPTY:
                continue
            s, _ = _scores(qf, k[:, :, ks].float(), scale, softcap)
            if bias is not None:
                _add_bias(s, bias, on_device, qs, ks, hkv)
            if kind != FULL:
                s.masked_fill_(~_tile_mask(on_device, qs, ks, group).to(s.device), -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            corr = torch.exp(m - m_safe)
            denom.mul_(corr).add_(p.sum(-1))
            acc.mul_(corr.unsqueeze(-1)).add_(torch.matmul(p, v[:, :, ks].float()))
            m = m_new
        seen = denom > 0
        blk_lse = torch.where(seen, m + torch.log(torch.where(seen, denom, torch.ones_like(denom))), -math.inf)
        blk_out = acc / torch.where(seen, denom, torch.ones_like(denom)).unsqueeze(-1)
        merge_(out[:, :, qs], lse[:, :, qs], _unfold_rows(blk_out, hq), _unfold_rows(blk_lse, hq))
    return out, lse


def backward(
    do, q, k, v, lse, delta, mask: BlockMask, scale: float, dq, dk, dv, *, out=None, softcap=None, bias=None, dbias=None
):
    """Accumulate the gradients of one block into ``dq``, ``dk``, ``dv`` (fp32) in place (``out`` unused).

    q: [batch, q_heads, local_q, head_dim]; do: [batch, q_heads, local_q, v_head_dim]; k, v: as in ``forward``.
    lse: [batch, q_heads, local_q] fp32, the final (global) LSE; delta = rowsum(dO * O), same shape.
    dq: like q, dk: like k, dv: like v, fp32. softcap: as in ``forward`` (its derivative, ``1 - tanh^2``,
    scales the score gradients). bias: as in ``forward``; dbias: None, or like it, fp32: its gradient accumulated in
    place (the score gradients summed by distance). Returns ``(dq, dk, dv)``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    k_tiles = tiles(mask.k_pos, BLOCK_K)
    # Rows that saw nothing have lse = -inf; +inf makes their probabilities exactly 0.
    lse_safe = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse)
    on_device = _on(mask, q.device)
    for qs in tiles(mask.q_pos, BLOCK_Q):
        qf = _fold(q, hkv, qs)
        dof = _fold(do, hkv, qs)
        lse_t = lse_safe[:, :, qs].reshape(qf.shape[:-1]).unsqueeze(-1)
        delta_t = delta[:, :, qs].reshape(qf.shape[:-1]).unsqueeze(-1)
        dq_t = torch.zeros_like(qf)
        db_t = None if dbias is None else qf.new_zeros(*qf.shape[:-1], dbias.shape[-1])
        for ks in k_tiles:
            kind = mask.classify(qs, ks)
            if kind == EMPTY:
                continue
            kt, vt = k[:, :, ks].float(), v[:, :, ks].float()
            s, t = _scores(qf, kt, scale, softcap)
            if bias is not None:
                where = _add_bias(s, bias, on_device, qs, ks, hkv)
            p = torch.exp(s - lse_t)
            if kind != FULL:
                p.masked_fill_(~_tile_mask(on_device, qs, ks, group).to(p.device), 0.0)
            dv[:, :, ks] += torch.matmul(p.transpose(-1, -2), dof)
            ds = p * (torch.matmul(dof, vt.transpose(-1, -2)) - delta_t)
            if t is not None:
                ds.mul_(1.0 - t * t)  # d(softcap * tanh(s / softcap)) / ds
            dq_t += torch.matmul(ds, kt)
            dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), qf).mul_(scale)
            if db_t is not None:
                index, inside = where
                db_t.scatter_add_(-1, index.expand(*ds.shape[:2], -1, -1), ds.masked_fill(~inside, 0.0))
        dq[:, :, qs] += _unfold_rows(dq_t.mul_(scale), hq)
        if db_t is not None:
            dbias[:, :, qs] += _unfold_rows(db_t, hq)
    return dq, dk, dv
