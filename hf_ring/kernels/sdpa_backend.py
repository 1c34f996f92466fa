"""The ``"sdpa"`` backend: PyTorch's own fused attention kernels, forward and backward, per ring step.

Same contract as ``torch_backend``. PyTorch's scaled-dot-product attention ops that return the
log-sum-exp run every ring step whose mask is a set of fully visible rectangles and causal diagonals
(``BlockMask.pieces``: no mask, the causal diagonal, the zig-zag halves, the striped layout's shifted
diagonal); each rectangle's output and natural-log LSE are merged into the fp32 accumulators.

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (fp32, fp16, bf16; GQA
  native).
- CUDA: ``aten._scaled_dot_product_flash_attention`` and its backward (fp16 / bf16, head_dim a
  multiple of 8 up to 256).

Backward: the ring saves the global output and LSE, so the fused backward of each rectangle, given
the global ``out`` and ``lse`` (it derives ``delta = rowsum(dO * O)`` from them), yields exactly that
rectangle's share of dQ, dK and dV.

Steps these ops cannot express (sliding windows, packed documents, fp32 on CUDA, float64) run on the
``triton`` backend on CUDA and on the ``torch`` backend elsewhere, inside the same call. The ops have
no attention logit softcapping: with ``softcap`` every step runs on that fallback.

Caveat: the ops return their output and gradients in the input dtype, so in fp16/bf16 each rectangle
is rounded once before it is merged (the triton kernels keep fp32 until the end of the ring).
GPU status: the CUDA ops have not run on a GPU in this project's tests yet; the CPU ops are tested.
"""

from __future__ import annotations

import torch

from . import masked_fallback, torch_backend, unsupported_by
from .mask import BlockMask

__all__ = ["SOFTCAP", "backward", "forward", "runs_on_fused_ops", "unsupported"]

_HALF = (torch.float16, torch.bfloat16)
SOFTCAP = True  # on the masked fallback (the fused ops have no softcapping)


def runs_on_fused_ops(q: torch.Tensor, v: torch.Tensor | None = None) -> bool:
    """True when PyTorch's fused ops take inputs like ``q`` and ``v`` (device, dtype, head_dim; the flash ops
    need v's head_dim equal to q's; ``v`` None: like ``q``)."""
    if v is not None and v.shape[-1] != q.shape[-1]:
        return False
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, *_HALF)
    if q.device.type == "cuda":
        d = q.shape[-1]
        return q.dtype in _HALF and d % 8 == 0 and d <= 256
    return False


def unsupported(q, k, v) -> str | None:
    """Why these inputs cannot run here, or None: what the fused ops cannot take goes to the fallback."""
    return unsupported_by(masked_fallback(q.device), q, k, v)


def _fwd(q, k, v, causal: bool, scale: float):
    """(out in q's dtype, lse fp32 [B, Hq, Lq]) of plain attention, top-left causal."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) in q's dtype of one rectangle, given the global output and LSE of its rows."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    empty_i32 = torch.empty(0, dtype=torch.int32, device=q.device)
    empty_i64 = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, empty_i32, empty_i32, q.shape[2], k.shape[2], 0.0, causal, empty_i64, empty_i64,
        scale=scale,
    )  # fmt: skip


def _kv_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A key/value gradient per key/value head (summed over the query heads of its group if need be)."""
    if g.shape[1] == kv_heads:
        return g
    return g.unflatten(1, (kv_heads, g.shape[1] // kv_heads)).sum(2)


def forward(q, k, v, mask: BlockMask, scale: float, out: torch.Tensor, lse: torch.Tensor, *, softcap=None):
    """Attend ``q`` to one key/value block and merge into the accumulators in place.

    q: [batch, q_heads, local_q, head_dim]; k, v: [batch, kv_heads, local_k, head_dim] (any strides
    with a contiguous last dimension; values of another head_dim run on the fallback). out: [batch, q_heads,
    local_q, v_head_dim] fp32; lse: [batch, q_heads, local_q] fp32. softcap: logit softcapping (the step then
    runs on the fallback).
    Returns ``(out, lse)``.
    """
    pieces = mask.pieces() if runs_on_fused_ops(q, v) and softcap is None else None
    if pieces is None:
        return masked_fallback(q.device).forward(q, k, v, mask, scale, out, lse, softcap=softcap)
    for kind, qs, ks in pieces:
        o, blk_lse = _fwd(q[:, :, qs], k[:, :, ks], v[:, :, ks], kind == "causal", scale)
        torch_backend.merge_(out[:, :, qs], lse[:, :, qs], o.float(), blk_lse.float())
    return out, lse


def backward(do, q, k, v, lse, delta, mask: BlockMask, scale: float, dq, dk, dv, *, out=None, softcap=None):
    """Accumulate the gradients of one block into ``dq``, ``dk``, ``dv`` (fp32) in place.

    Shapes as in ``torch_backend.backward``; ``out``: the global output [batch, q_heads, local_q,
    head_dim] in q's dtype (without it, or with ``softcap``, the step runs on the fallback).
    Returns ``(dq, dk, dv)``.
    """
    pieces = mask.pieces() if out is not None and runs_on_fused_ops(q, v) and softcap is None else None
    if pieces is None:
        return masked_fallback(q.device).backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, softcap=softcap)
    hkv = k.shape[1]
    for kind, qs, ks in pieces:
        g_q, g_k, g_v = _bwd(
            do[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs].contiguous(),
            kind == "causal", scale,
        )  # fmt: skip
        dq[:, :, qs] += g_q
        dk[:, :, ks] += _kv_heads(g_k, hkv)
        dv[:, :, ks] += _kv_heads(g_v, hkv)
    return dq, dk, dv
