"""The ``"flash_attn"`` backend: FlashAttention-2 kernels for the ring steps whose mask they can express.

Same contract as ``torch_backend``. A step's mask is cut into fully visible rectangles and causal
diagonals (``BlockMask.pieces``: the zig-zag halves, the contiguous diagonal, the striped layout's
shifted diagonal); each runs ``flash_attn_func`` (``causal=True`` on the diagonals: equal lengths, so
flash-attn's bottom-right alignment is the diagonal), and its output and natural-log LSE are merged
into the fp32 accumulators by the LSE rule. The backward runs flash-attn's own backward kernel per
rectangle, fed the global output and LSE the ring saved: it derives ``delta = rowsum(dO * O)`` from
them, which is exactly the global delta, so each rectangle yields its exact share of dQ, dK and dV.

Everything else falls back to the ``"triton"`` backend on CUDA (``"torch"`` elsewhere): blocks with
sliding windows or documents, fp32 inputs, head_dim > 256, machines without ``flash_attn``.
Attention logit softcapping is flash-attn's own ``softcap`` argument, forward and backward.

Caveat: flash-attn returns outputs and gradients in the input dtype (bf16/fp16), so each rectangle
is rounded once more than with the fused triton kernel, whose accumulators stay fp32.
GPU status: flash-attn is installed on none of the machines this project is tested on; this module's
kernel path has not run (its host logic, ``BlockMask.pieces``, is tested on CPU).
"""

from __future__ import annotations

import inspect

import torch

from . import masked_fallback, torch_backend, unsupported_by
from .mask import BlockMask

try:  # optional dependency
    from flash_attn import flash_attn_func
    from flash_attn.flash_attn_interface import _flash_attn_backward
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = _flash_attn_backward = None

__all__ = ["SOFTCAP", "available", "backward", "forward", "plan", "unsupported"]

SOFTCAP = True  # flash-attn's ``softcap``; the fallbacks implement it too


def available() -> bool:
    """True when ``flash_attn`` is importable."""
    return flash_attn_func is not None


def plan(mask: BlockMask) -> list[tuple[str, slice, slice]] | None:
    """``[(kind, q_slice, k_slice)]`` with kind ``"full"`` or ``"causal"``; None if flash-attn cannot run it."""
    return mask.pieces()


def unsupported(q, k, v) -> str | None:
    """Why these inputs cannot run here, or None: whatever flash-attn cannot take goes to the fallback."""
    return unsupported_by(masked_fallback(q.device), q, k, v)


def _usable(q: torch.Tensor, v: torch.Tensor) -> bool:
    """flash-attn takes these inputs (CUDA, fp16 / bf16, one head_dim up to 256 for q, k and v)."""
    return (
        available() and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
        and v.shape[-1] == q.shape[-1]
    )  # fmt: skip


def _t(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> flash-attn's [B, L, H, D] (a view)."""
    return x.transpose(1, 2)


def forward(q, k, v, mask: BlockMask, scale: float, out: torch.Tensor, lse: torch.Tensor, *, softcap=None):
    """Attend ``q`` to one key/value block and merge into the accumulators in place.

    q: [batch, q_heads, local_q, head_dim]; k, v: [batch, kv_heads, local_k, head_dim] (values of another
    head_dim run on the fallback). out: [batch, q_heads, local_q, v_head_dim] fp32; lse: [batch, q_heads,
    local_q] fp32. softcap: attention logit softcapping (None: off). Returns ``(out, lse)``.
    """
    pieces = plan(mask) if _usable(q, v) else None
    if pieces is None:
        return masked_fallback(q.device).forward(q, k, v, mask, scale, out, lse, softcap=softcap)
    for kind, qs, ks in pieces:
        o, blk_lse, _ = flash_attn_func(
            _t(q[:, :, qs]), _t(k[:, :, ks]), _t(v[:, :, ks]),
            softmax_scale=scale, causal=kind == "causal", softcap=softcap or 0.0, return_attn_probs=True,
        )  # fmt: skip
        torch_backend.merge_(out[:, :, qs], lse[:, :, qs], _t(o).float(), blk_lse.float())
    return out, lse


def _backward_kwargs(scale: float, causal: bool, softcap: float | None) -> dict:
    """Keyword arguments of flash-attn's ``_flash_attn_backward`` for this version (2.6 and 2.7+ differ)."""
    params = inspect.signature(_flash_attn_backward).parameters
    kw = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, softcap=softcap or 0.0, alibi_slopes=None,
              deterministic=False, rng_state=None)  # fmt: skip
    if "window_size" in params:
        kw["window_size"] = (-1, -1)
    else:
        kw.update(window_size_left=-1, window_size_right=-1)
    return {name: value for name, value in kw.items() if name in params}


def backward(do, q, k, v, lse, delta, mask: BlockMask, scale: float, dq, dk, dv, *, out=None, softcap=None):
    """Accumulate the gradients of one block into ``dq``, ``dk``, ``dv`` (fp32) in place.

    Shapes as in ``torch_backend.backward``; ``out``: the global output in q's dtype (without it the
    step runs on the fallback); softcap: as in ``forward``. Returns ``(dq, dk, dv)``.
    """
    pieces = plan(mask) if out is not None and _usable(q, v) and _flash_attn_backward is not None else None
    if pieces is None:
        return masked_fallback(q.device).backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, softcap=softcap)
    for kind, qs, ks in pieces:
        qq, kk, vv = (_t(x).contiguous() for x in (q[:, :, qs], k[:, :, ks], v[:, :, ks]))
        g_q, g_k, g_v = torch.empty_like(qq), torch.empty_like(kk), torch.empty_like(vv)
        _flash_attn_backward(
            _t(do[:, :, qs]).contiguous(), qq, kk, vv, _t(out[:, :, qs]).contiguous(), lse[:, :, qs].contiguous(),
            g_q, g_k, g_v, **_backward_kwargs(scale, kind == "causal", softcap),
        )  # fmt: skip
        dq[:, :, qs] += _t(g_q)
        dk[:, :, ks] += _t(g_k)
        dv[:, :, ks] += _t(g_v)
    return dq, dk, dv
