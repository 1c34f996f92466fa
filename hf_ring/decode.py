"""Exact attention of queries every rank holds alike to keys/values spread over the ranks: the decode step of
long-context generation, where each rank of the CP group keeps a shard of the KV cache.

Each rank attends the queries to its own keys through a local kernel, with the mask from global positions
(causal, sliding windows, documents: the ``BlockMask`` the ring uses), and gets a partial output and its LSE in
fp32. One all-gather of (output, LSE) lets every rank merge the N partial results by the log-sum-exp rule, the
merge the ring does step by step, so every rank ends with the same output. Per call: one collective of
N x batch x q_heads x new_tokens x (head_dim + 1) fp32 values (for one new token of a 32-head, 128-dim model,
16.5 KB per rank and layer), plus the pre-flight check when ``check=True``.

Forward only: decoding runs without gradients.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .comm import RingComm, group_rank_and_size
from .kernels import BlockMask, choose_backend
from .kernels.mask import Selection, selection_error
from .preflight import check_everywhere

__all__ = ["decode_attention"]

_FIELDS = (
    "error", "batch", "q_heads", "new_tokens", "head_dim", "kv_heads", "v_head_dim", "causal", "sliding_window",
)  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    group=None,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    selected=None,
    distance_bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    backend: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Attention of ``q`` (the same on every rank of ``group``) to the keys/values of every rank of ``group``.

    Args:
        q: [batch, q_heads, new, head_dim], identical on every rank.
        k, v: [batch, kv_heads, local_keys, head_dim]: this rank's part of the keys/values (0 keys allowed);
            ``q_heads % kv_heads == 0``; v's head_dim may differ (multi-head latent attention).
        q_pos: [new] integer global positions of the queries; k_pos: [local_keys] of this rank's keys.
        group: the CP process group (None: the default group; none initialised: one rank).
        causal, sliding_window, softcap, scale: as in ``ring_attention`` (visibility from the positions).
        sinks: [q_heads] learned attention sinks, merged once into the global LSE; or [batch, q_heads, new], one per
            query (Inkling 2).
        q_doc, k_doc: [1 or batch, new] and [1 or batch, local_keys] integer document ids (-1: padding, which
            sees nothing and is seen by nothing), or None (one document).
        selected: [batch, new, K] integer global key positions each query may see at most (DeepSeek sparse
            attention's top-k, ``hf_ring.sparse.select_decode``), below the queries' largest position + 1, or
            ``ring_attention``'s other forms of a selection (per key/value head, ``Selection`` of blocks); the local
            kernel is then the torch backend's.
        distance_bias: [batch, q_heads, new, E]: each query's bias by backward distance, as in ``ring_attention``
            (Inkling's relative position bias); the local kernel is then the torch backend's.
        alibi_slopes: [q_heads]: ALiBi's slope per head (``-slope * d``), as in ``ring_attention``; the local kernel
            is then the torch backend's.
        backend: the local kernel (``"auto"``, ``"torch"``, ``"triton"``, ``"sdpa"``).
        check: run the pre-flight check (one small all-gather: every rank raises the same error when one rank's
            arguments are wrong or ranks disagree on the query shape) before the merge's all-gather. A caller
            that checked once per generation step passes False for the layers after the first.

    Returns:
        [batch, q_heads, new, v_head_dim] in q's dtype, the same on every rank; rows that see no key are 0.
    """
    rank, world = group_rank_and_size(group)
    error = _error(q, k, v, q_pos, k_pos, q_doc, k_doc, sinks, distance_bias, alibi_slopes)
    if error is None and distance_bias is not None and softcap is not None:
        error = "distance_bias is not supported with softcap"
    if error is None and alibi_slopes is not None:
        if softcap is not None or distance_bias is not None:
            error = "alibi_slopes is not supported with softcap or distance_bias"
        distance_bias = alibi_slopes  # (the torch backend tells them by their shape)
    if error is None and selected is not None:
        error = selection_error(selected, q, k)
    if check:
        summary = [1] + [0] * (len(_FIELDS) - 1)
        if error is None:
            window = -1 if sliding_window is None else int(sliding_window)
            summary = [0, *q.shape, int(k.shape[1]), int(v.shape[3]), int(causal), window]
        device = q.device if isinstance(q, torch.Tensor) else None
        check_everywhere(error, summary, RingComm(group), device, fields=_FIELDS, op="decode_attention")
    elif error is not None:
        raise ValueError(f"decode_attention (rank {rank}): {error}")
    b, hq, t, d = q.shape
    out = torch.zeros(b, hq, t, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, t), float("-inf"), dtype=torch.float32, device=q.device)
    if k.shape[2]:
        mask = BlockMask(
            q_pos=q_pos.detach().cpu().long(),
            k_pos=k_pos.detach().cpu().long(),
            causal=bool(causal),
            window=None if sliding_window is None else int(sliding_window),
            q_doc=None if q_doc is None else q_doc.detach().cpu().to(torch.int32),
            k_doc=None if k_doc is None else k_doc.detach().cpu().to(torch.int32),
        )
        if selected is not None:
            sel = Selection.of(selected)
            sel = dataclasses.replace(sel, index=sel.index.to(q.device))
            mask = mask.with_selection(sel, int(max(mask.q_pos.max(), mask.k_pos.max())) + 1)
        if not mask.is_empty():
            plain = selected is None and distance_bias is None
            module, problem = choose_backend(backend if plain else "torch", q, k, v, softcap)
            if problem is not None:
                raise ValueError(f"decode_attention: {problem}")
            kwargs = {} if softcap is None else {"softcap": float(softcap)}
            if distance_bias is not None:
                kwargs["bias"] = distance_bias.detach()
            scale = d**-0.5 if scale is None else float(scale)
            with torch.autocast(q.device.type, enabled=False):
                module.forward(q, k, v, mask, scale, out, lse, **kwargs)
    if world > 1:
        out, lse = _merge(out, lse, group, world)
    if sinks is not None:
        sink = sinks.detach().float()
        merged = torch.logaddexp(lse, sink[None, :, None] if sink.dim() == 1 else sink)
        out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    return out.to(q.dtype)


def _merge(out: torch.Tensor, lse: torch.Tensor, group, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (out, lse), gathered and merged by the log-sum-exp rule (the same result on every rank)."""
    d = out.shape[-1]
    mine = torch.cat([out, lse.unsqueeze(-1)], -1).contiguous()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    parts = torch.stack(every)  # [world, b, hq, t, d + 1]
    lses = parts[..., d]
    total = torch.logsumexp(lses, 0)
    weights = torch.exp(lses - torch.where(torch.isinf(total), torch.zeros_like(total), total))  # 0 where unseen
    return (parts[..., :d] * weights.unsqueeze(-1)).sum(0), total


def _error(q, k, v, q_pos, k_pos, q_doc, k_doc, sinks, distance_bias=None, alibi_slopes=None) -> str | None:
    """The first problem with this rank's arguments, or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor [batch, heads, tokens, head_dim]"
    b, hq, t, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d:
        return (
            f"k {tuple(k.shape)} must be [batch={b}, kv_heads, local_keys, head_dim={d}] and v {tuple(v.shape)} "
            "[batch, kv_heads, local_keys, v_head_dim]"
        )
    if k.shape[1] == 0 or hq % k.shape[1]:
        return f"q_heads ({hq}) must be a multiple of kv_heads ({k.shape[1]})"
    if not isinstance(q_pos, torch.Tensor) or q_pos.shape != (t,):
        return f"q_pos must be a tensor [new={t}] of global positions"
    if not isinstance(k_pos, torch.Tensor) or k_pos.shape != (k.shape[2],):
        return f"k_pos must be a tensor [local_keys={k.shape[2]}] of global positions"
    if (q_doc is None) != (k_doc is None):
        return "pass q_doc and k_doc together (document ids of the queries and of this rank's keys), or neither"
    if q_doc is not None and (q_doc.shape[-1] != t or k_doc.shape[-1] != k.shape[2]):
        return f"q_doc must be [1 or batch, {t}] and k_doc [1 or batch, {k.shape[2]}]"
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) not in ((hq,), (b, hq, t))):
        return f"sinks must be a tensor [q_heads={hq}] (or one per query, [batch={b}, q_heads={hq}, new={t}])"
    if distance_bias is not None and (
        not isinstance(distance_bias, torch.Tensor) or distance_bias.dim() != 4
        or tuple(distance_bias.shape[:3]) != (b, hq, t)
    ):  # fmt: skip
        return f"distance_bias must be a tensor [batch={b}, q_heads={hq}, new={t}, extent]"
    if alibi_slopes is not None and (
        not isinstance(alibi_slopes, torch.Tensor) or tuple(alibi_slopes.shape) != (hq,)
        or not alibi_slopes.dtype.is_floating_point or alibi_slopes.device != q.device or alibi_slopes.requires_grad
    ):  # fmt: skip
        return f"alibi_slopes must be a floating-point tensor [q_heads={hq}] on q's device that requires no gradient"
    return None
