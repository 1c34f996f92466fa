"""The ``"sdpa"`` and ``"cudnn"`` backends: PyTorch's own fused attention ops, forward and backward, per ring step.

Same contract as ``torch_backend``. PyTorch's scaled-dot-product attention ops that return the
log-sum-exp run every ring step whose mask is a set of fully visible rectangles and causal diagonals
(``BlockMask.pieces``: no mask, the causal diagonal, the zig-zag halves, the striped layout's shifted
diagonal); each rectangle's output and natural-log LSE are merged into the fp32 accumulators.

Each backend tries its ops in order and runs a step on the first that takes the inputs (``OPS``):

- ``"sdpa"``: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (fp32, fp16, bf16; GQA
  native); on CUDA ``aten._scaled_dot_product_flash_attention`` (fp16 / bf16, one head_dim, a multiple
  of 8 up to 256; GQA native), else ``aten._scaled_dot_product_efficient_attention`` (also fp32, and a
  value head_dim of its own; key/value heads repeated for GQA).
- ``"cudnn"`` (CUDA only): ``aten._scaled_dot_product_cudnn_attention`` (fp16 / bf16, one head_dim, a
  multiple of 8 up to 128; key/value heads repeated for GQA, inputs made contiguous), else as ``"sdpa"``.

Backward: the ring saves the global output and LSE, so the fused backward of each rectangle, given
the global ``out`` and ``lse`` (it derives ``delta = rowsum(dO * O)`` from them), yields exactly that
rectangle's share of dQ, dK and dV. The ops' LSE layouts differ: flash ``[B, H, L]``; efficient
``[B, H, L rounded up to 32]`` (the tail unused); cuDNN ``[B, H, L, 1]``.

Steps these ops cannot express (sliding windows, packed documents, float64, inputs no op takes) run on
the ``triton`` backend on CUDA and on the ``torch`` backend elsewhere, inside the same call. The ops
have no attention logit softcapping: with ``softcap`` every step runs on that fallback.

Caveat: the ops return their output and gradients in the input dtype, so in fp16/bf16 each rectangle
is rounded once before it is merged (the triton kernels keep fp32 until the end of the ring).
GPU status: the CUDA ops have not run on a GPU in this project's tests yet (their calls are checked
against PyTorch's op schemas and meta kernels); the CPU op is tested.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import masked_fallback, torch_backend, unsupported_by
from .mask import BlockMask

__all__ = ["OPS", "SOFTCAP", "FusedOp", "backward", "forward", "fused_op", "step_op", "unsupported"]

_HALF = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten
SOFTCAP = True  # on the masked fallback (the fused ops have no softcapping)


class FusedOp(NamedTuple):
    """One of PyTorch's fused attention ops, wrapped to one contract.

    ``takes(q, v)``: the op runs inputs like these. ``fwd(q, k, v, causal, scale)``: (out in q's dtype,
    natural-log lse fp32 [B, Hq, Lq]) of plain attention, top-left causal. ``bwd(do, q, k, v, out, lse,
    causal, scale)``: (dq, dk, dv) in q's dtype, given the global output and LSE of the rows; dk / dv per
    key/value head or per query head. k / v may have fewer heads than q in both.
    """

    name: str
    takes: Callable[[torch.Tensor, torch.Tensor], bool]
    fwd: Callable
    bwd: Callable


def _repeat_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Key/value heads repeated to ``q_heads`` (query head h reads key/value head h // group)."""
    return x if x.shape[1] == q_heads else x.repeat_interleave(q_heads // x.shape[1], dim=1)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()`` (written as a clone, which PyTorch's fake CUDA tensors also run)."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _nothing(q, dtype):
    return torch.empty(0, dtype=dtype, device=q.device)


# CPU flash ---------------------------------------------------------------------------------------------


def _cpu_fwd(q, k, v, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_bwd(do, q, k, v, out, lse, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal, scale=scale)


# CUDA flash --------------------------------------------------------------------------------------------


def _flash_fwd(q, k, v, causal, scale):
    res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_bwd(do, q, k, v, out, lse, causal, scale):
    # cum_seq_q / cum_seq_k undefined (None), as the forward returns them for dense inputs: a defined one, even empty,
    # selects the variable-length kernel
    seed = _nothing(q, torch.int64)
    return _aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, seed, scale=scale
    )


# CUDA memory-efficient: LSE rows padded to a multiple of 32; no GQA ---------------------------------------


def _lse_rows(length: int) -> int:
    return -(-length // 32) * 32


def _as_returned(t: torch.Tensor) -> torch.Tensor:
    """``t`` [B, H, L, D] as a view of a dense [B, L, H, D] tensor (the memory-efficient forward's output layout)."""
    return _dense(t.transpose(1, 2)).transpose(1, 2)


def _efficient_fwd(q, k, v, causal, scale):
    hq = q.shape[1]
    res = _aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, hq), _repeat_kv(v, hq), None, True, 0.0, causal, scale=scale
    )
    return res[0], res[1].narrow(2, 0, q.shape[2])


def _efficient_bwd(do, q, k, v, out, lse, causal, scale):
    # its kernel reads out (and computes delta from it in fp16 / bf16) with the row stride of the layout its forward
    # returns, [B, L, H, D] dense: out and dO given in that layout, whatever slice of the ring's output they are
    out, do = (_as_returned(t) for t in (out, do))
    hq, lq = q.shape[1], q.shape[2]
    padded = torch.nn.functional.pad(lse, (0, _lse_rows(lq) - lq))
    seed = _nothing(q, torch.int64)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        do, q, _repeat_kv(k, hq), _repeat_kv(v, hq), None, out, padded, seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


# CUDA cuDNN: LSE [B, H, L, 1]; no GQA ------------------------------------------------------------------


def _cudnn_inputs(q, k, v):
    hq = q.shape[1]
    return _dense(q), _dense(_repeat_kv(k, hq)), _dense(_repeat_kv(v, hq))


def _cudnn_fwd(q, k, v, causal, scale):
    q, k, v = _cudnn_inputs(q, k, v)
    res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].squeeze(-1)


def _cudnn_bwd(do, q, k, v, out, lse, causal, scale):
    q, k, v = _cudnn_inputs(q, k, v)
    seed = _nothing(q, torch.int64)
    return _aten._scaled_dot_product_cudnn_attention_backward(
        _dense(do), q, k, v, _dense(out), _dense(lse.unsqueeze(-1)), seed, seed, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )  # fmt: skip


def _head_dims_ok(q, v, largest: int, one: bool) -> bool:
    dims = (q.shape[-1], v.shape[-1])
    return (not one or dims[0] == dims[1]) and all(d % 8 == 0 and d <= largest for d in dims)


def _takes_cpu_flash(q, v) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, *_HALF) and v.shape[-1] == q.shape[-1]


def _takes_flash(q, v) -> bool:
    return q.device.type == "cuda" and q.dtype in _HALF and _head_dims_ok(q, v, 256, one=True)


def _takes_efficient(q, v) -> bool:
    return q.device.type == "cuda" and q.dtype in (torch.float32, *_HALF) and _head_dims_ok(q, v, 256, one=False)


def _takes_cudnn(q, v) -> bool:
    return q.device.type == "cuda" and q.dtype in _HALF and _head_dims_ok(q, v, 128, one=True)


CPU_FLASH = FusedOp("flash_for_cpu", _takes_cpu_flash, _cpu_fwd, _cpu_bwd)
FLASH = FusedOp("flash", _takes_flash, _flash_fwd, _flash_bwd)
EFFICIENT = FusedOp("efficient", _takes_efficient, _efficient_fwd, _efficient_bwd)
CUDNN = FusedOp("cudnn", _takes_cudnn, _cudnn_fwd, _cudnn_bwd)

#: The ops each backend tries, in order.
OPS = {"sdpa": (CPU_FLASH, FLASH, EFFICIENT), "cudnn": (CUDNN, FLASH, EFFICIENT)}


def fused_op(q: torch.Tensor, v: torch.Tensor | None = None, backend: str = "sdpa") -> FusedOp | None:
    """The first of ``backend``'s ops that takes inputs like ``q`` and ``v`` (``v`` None: like ``q``), or None."""
    v = q if v is None else v
    return next((op for op in OPS[backend] if op.takes(q, v)), None)


def step_op(q: torch.Tensor, v: torch.Tensor, mask: BlockMask, *, softcap=None, backend: str = "sdpa") -> str:
    """What runs a step like this one: the fused op's name (``FusedOp.name``), or the fallback backend's
    (``"triton"``, ``"torch"``) where no op takes it. Benchmarks record it beside the backend."""
    op, _ = _plan(q, v, mask, softcap, backend)
    return op.name if op is not None else masked_fallback(q.device).__name__.rsplit(".", 1)[-1].removesuffix("_backend")


def unsupported(q, k, v) -> str | None:
    """Why these inputs cannot run here, or None: what the fused ops cannot take goes to the fallback."""
    return unsupported_by(masked_fallback(q.device), q, k, v)


def _kv_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A key/value gradient per key/value head (summed over the query heads of its group if need be)."""
    if g.shape[1] == kv_heads:
        return g
    return g.unflatten(1, (kv_heads, g.shape[1] // kv_heads)).sum(2)


def _plan(q, v, mask: BlockMask, softcap, backend: str):
    op = fused_op(q, v, backend) if softcap is None else None
    pieces = mask.pieces() if op is not None else None
    return (op, pieces) if pieces is not None else (None, None)


def forward(q, k, v, mask: BlockMask, scale: float, out: torch.Tensor, lse: torch.Tensor, *, softcap=None,
            backend: str = "sdpa"):  # fmt: skip
    """Attend ``q`` to one key/value block and merge into the accumulators in place.

    q: [batch, q_heads, local_q, head_dim]; k, v: [batch, kv_heads, local_k, head_dim] (any strides
    with a contiguous last dimension). out: [batch, q_heads, local_q, v_head_dim] fp32; lse: [batch,
    q_heads, local_q] fp32. softcap: logit softcapping (the step then runs on the fallback). backend:
    whose ops (``OPS``).
    Returns ``(out, lse)``.
    """
    op, pieces = _plan(q, v, mask, softcap, backend)
    if op is None:
        return masked_fallback(q.device).forward(q, k, v, mask, scale, out, lse, softcap=softcap)
    for kind, qs, ks in pieces:
        o, blk_lse = op.fwd(q[:, :, qs], k[:, :, ks], v[:, :, ks], kind == "causal", scale)
        torch_backend.merge_(out[:, :, qs], lse[:, :, qs], o.float(), blk_lse.float())
    return out, lse


def backward(do, q, k, v, lse, delta, mask: BlockMask, scale: float, dq, dk, dv, *, out=None, softcap=None,
             backend: str = "sdpa"):  # fmt: skip
    """Accumulate the gradients of one block into ``dq``, ``dk``, ``dv`` (fp32) in place.

    Shapes as in ``torch_backend.backward``; ``out``: the global output [batch, q_heads, local_q,
    head_dim] in q's dtype (without it, or with ``softcap``, the step runs on the fallback).
    Returns ``(dq, dk, dv)``.
    """
    op, pieces = _plan(q, v, mask, softcap, backend) if out is not None else (None, None)
    if op is None:
        return masked_fallback(q.device).backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, softcap=softcap)
    hkv = k.shape[1]
    for kind, qs, ks in pieces:
        g_q, g_k, g_v = op.bwd(
            do[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs].contiguous(),
            kind == "causal", scale,
        )  # fmt: skip
        dq[:, :, qs] += g_q
        dk[:, :, ks] += _kv_heads(g_k, hkv)
        dv[:, :, ks] += _kv_heads(g_v, hkv)
    return dq, dk, dv
