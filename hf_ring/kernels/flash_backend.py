"""The ``"flash_attn"`` backend: FlashAttention-2 kernels for the ring steps whose mask they can express.

Same contract as ``torch_backend``. The query and key positions of a block are cut into runs of
consecutive positions (a zig-zag shard has two); every (query run, key run) pair is classified
from its bounds: hidden pairs are skipped, fully visible pairs run ``flash_attn_func(causal=False)``
and causal pairs whose runs end at the same position (the diagonal of a zig-zag or contiguous
layout, which flash-attn's bottom-right aligned causal mask expresses exactly) run
``flash_attn_func(causal=True)``. Each result, with flash-attn's natural-log LSE, is merged into
the fp32 accumulators by the LSE rule.

Everything else falls back to the ``"triton"`` backend on CUDA (``"torch"`` elsewhere): blocks
with sliding windows, documents, other pairs or many short runs (striped layout), fp32 inputs, head_dim > 256,
machines without ``flash_attn``. The backward pass always falls back: flash-attn's backward
derives ``delta = rowsum(dO * O)`` from the output it is given, while a ring step only has the
global ``delta`` and LSE (the triton backward consumes them directly).

Caveat: flash-attn returns the block output in the input dtype (bf16/fp16), so each merged block
is rounded once more than with the fused triton kernel, whose accumulators stay fp32.
"""

from __future__ import annotations

import importlib

import torch

from . import torch_backend
from .mask import EMPTY, FULL, BlockMask

try:  # optional dependency
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = None

__all__ = ["MAX_PAIRS", "available", "backward", "forward", "plan", "unsupported"]

MAX_PAIRS = 16  # more (query run, key run) pairs than this: one flash-attn call each would not pay


def available() -> bool:
    """True when ``flash_attn`` is importable."""
    return flash_attn_func is not None


def _fallback(device: torch.device):
    name = "triton_backend" if device.type == "cuda" else "torch_backend"
    return importlib.import_module(f"{__package__}.{name}")


def _runs(pos: torch.Tensor) -> list[slice]:
    """Maximal runs of consecutive positions (step +1)."""
    n = pos.numel()
    if n == 0:
        return []
    cuts = (torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *cuts, n]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def plan(mask: BlockMask) -> list[tuple[str, slice, slice]] | None:
    """``[(kind, q_slice, k_slice)]`` with kind ``"full"`` or ``"causal"``; None if flash-attn cannot run it."""
    if mask.window is not None or mask.has_docs:
        return None
    q_runs, k_runs = _runs(mask.q_pos), _runs(mask.k_pos)
    if len(q_runs) * len(k_runs) > MAX_PAIRS:  # e.g. the striped layout: one run per token
        return None
    pairs = []
    for qs in q_runs:
        for ks in k_runs:
            kind = mask.classify(qs, ks)
            if kind == EMPTY:
                continue
            if kind == FULL:
                pairs.append(("full", qs, ks))
                continue
            n, m = qs.stop - qs.start, ks.stop - ks.start
            same_end = int(mask.q_pos[qs.stop - 1]) == int(mask.k_pos[ks.stop - 1])
            if not (mask.causal and same_end and n <= m):
                return None
            pairs.append(("causal", qs, ks))
    return pairs


def unsupported(q, k, v) -> str | None:
    """Why these inputs cannot run here, or None: whatever flash-attn cannot take goes to the fallback."""
    if q.is_cuda:
        from . import triton_backend

        return triton_backend.unsupported(q, k, v)
    return None


def _usable(q: torch.Tensor) -> bool:
    return available() and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def forward(q, k, v, mask: BlockMask, scale: float, out: torch.Tensor, lse: torch.Tensor):
    """Attend ``q`` to one key/value block and merge into the accumulators in place.

    q: [batch, q_heads, local_q, head_dim]; k, v: [batch, kv_heads, local_k, head_dim].
    out: [batch, q_heads, local_q, head_dim] fp32; lse: [batch, q_heads, local_q] fp32.
    Returns ``(out, lse)``.
    """
    pairs = plan(mask) if _usable(q) else None
    if pairs is None:
        return _fallback(q.device).forward(q, k, v, mask, scale, out, lse)
    for kind, qs, ks in pairs:
        o, blk_lse, _ = flash_attn_func(
            q[:, :, qs].transpose(1, 2), k[:, :, ks].transpose(1, 2), v[:, :, ks].transpose(1, 2),
            softmax_scale=scale, causal=kind == "causal", return_attn_probs=True,
        )  # fmt: skip
        torch_backend.merge_(out[:, :, qs], lse[:, :, qs], o.transpose(1, 2).float(), blk_lse.float())
    return out, lse


def backward(do, q, k, v, lse, delta, mask: BlockMask, scale: float, dq, dk, dv):
    """Accumulate the gradients of one block into ``dq``, ``dk``, ``dv`` (fp32): the fallback backend's kernels.

    Shapes as in ``torch_backend.backward``. Returns ``(dq, dk, dv)``.
    """
    return _fallback(q.device).backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv)
