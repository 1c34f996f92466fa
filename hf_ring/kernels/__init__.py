"""Local block kernels of one ring step, behind one seam.

Every backend module provides the same two functions (see ``torch_backend`` for the contract):

- ``forward(q, k, v, mask, scale, out, lse) -> (out, lse)``: attend to one key/value block and
  merge into the fp32 accumulators ``out`` / ``lse`` (natural-log) in place;
- ``backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, *, out=None) -> (dq, dk, dv)``:
  accumulate the block's gradients into fp32 ``dq`` / ``dk`` / ``dv`` in place (``out``: the global
  output in q's dtype, which fused backward kernels take instead of ``delta``).

A module with ``SOFTCAP = True`` also takes ``softcap=`` (attention logit softcapping, the scores
``s`` replaced by ``softcap * tanh(s / softcap)`` before masking) in both; the ring passes it only
when it is set, and ``"auto"`` falls back to the torch backend where the chosen one lacks it.

Backends: ``"torch"`` (reference, any device), ``"triton"`` (our fused kernels), ``"sdpa"``
(PyTorch's fused attention ops, forward and backward, with the masked steps on ``"triton"`` on CUDA
and on ``"torch"`` elsewhere), ``"cudnn"`` (``"sdpa"`` with PyTorch's cuDNN attention op first; CUDA
only), ``"flash_attn"`` (optional). ``"auto"`` picks a forward and a
backward backend by device type and input dtype from measured figures (``AUTO``; the figures are in
docs/kernels.md): on CPU ``"sdpa"`` for fp32, and for fp16/bf16 ``"sdpa"`` forward with the
``"torch"`` backward (PyTorch's CPU flash backward is 3.4-6.5x slower than ours there); on CUDA
``"triton"`` (when importable) until GPU figures say otherwise; ``"torch"`` elsewhere.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType, SimpleNamespace

import torch

from .mask import EMPTY, FULL, PARTIAL, BlockMask

__all__ = [
    "AUTO", "BACKENDS", "BlockMask", "EMPTY", "FULL", "PARTIAL", "choose_backend", "get_backend", "masked_fallback",
    "resolve_backend", "triton_importable", "unsupported_by",
]  # fmt: skip

BACKENDS = ("auto", "torch", "triton", "sdpa", "cudnn", "flash_attn")
_MODULES = {
    "torch": "torch_backend", "triton": "triton_backend", "sdpa": "sdpa_backend", "cudnn": "cudnn_backend",
    "flash_attn": "flash_backend",
}  # fmt: skip

#: What ``"auto"`` runs: (device type, ``"fp32"`` or ``"half"``) -> (forward backend, backward backend),
#: from the figures in docs/kernels.md (CPU: ``bench_kernel.py --device cpu --impls torch sdpa``).
AUTO = {
    ("cpu", "fp32"): ("sdpa", "sdpa"),
    ("cpu", "half"): ("sdpa", "torch"),
    ("cuda", "fp32"): ("triton", "triton"),  # to be decided from GPU figures
    ("cuda", "half"): ("triton", "triton"),  # to be decided from GPU figures
}


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """``(forward, backward)`` concrete backend names for ``name`` on ``device`` with ``dtype`` inputs;
    ValueError for an unknown name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name, name
    kind = "half" if dtype in (torch.float16, torch.bfloat16) else "fp32"
    choice = AUTO.get((device.type, kind), ("torch", "torch"))
    if not triton_importable():
        choice = tuple("sdpa" if c == "triton" else c for c in choice)
    return choice


def triton_importable() -> bool:
    """True when Triton (and so the ``"triton"`` backend) can be imported."""
    return importlib.util.find_spec("triton") is not None


def unsupported_by(module, q, k, v, *, softcap: float | None = None) -> str | None:
    """Why ``module`` cannot run these inputs (its ``unsupported``), or None (a module without one runs anything).

    ``softcap``: attention logit softcapping is asked for; only modules with ``SOFTCAP = True`` implement it.
    """
    check = getattr(module, "unsupported", None)
    reason = None if check is None else check(q, k, v)
    if reason is None and softcap is not None and not getattr(module, "SOFTCAP", False):
        reason = f"attention logit softcapping is not implemented by {module.__name__}"
    return reason


def masked_fallback(device: torch.device) -> ModuleType:
    """The backend that runs the steps fused attention ops cannot express: triton on CUDA (torch without it)."""
    name = "triton" if device.type == "cuda" and triton_importable() else "torch"
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")


def get_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """The backend for ``name`` (after resolving ``"auto"``) on ``device`` with ``dtype`` inputs: a module,
    or, where ``"auto"`` picks two, an object with the forward of one and the backward of the other."""
    fwd, bwd = resolve_backend(name, device, dtype)
    forward = importlib.import_module(f"{__name__}.{_MODULES[fwd]}")
    if bwd == fwd:
        return forward
    backward = importlib.import_module(f"{__name__}.{_MODULES[bwd]}")

    def unsupported(q, k, v):
        return unsupported_by(forward, q, k, v) or unsupported_by(backward, q, k, v)

    return SimpleNamespace(
        __name__=f"{fwd} forward, {bwd} backward", forward=forward.forward, backward=backward.backward,
        unsupported=unsupported, SOFTCAP=getattr(forward, "SOFTCAP", False) and getattr(backward, "SOFTCAP", False),
    )  # fmt: skip


def choose_backend(name: str, q, k, v, softcap) -> tuple[ModuleType | None, str | None]:
    """The kernel module for ``name`` and these inputs, or an error. ``"auto"`` falls back to the
    torch backend where the preferred one cannot run the inputs (its ``unsupported`` says why)."""
    try:
        module = get_backend(name, q.device, q.dtype)
    except ImportError as e:
        return None, f"backend {name!r} is not available here ({e}); use backend='auto' or 'torch'"
    reason = unsupported_by(module, q, k, v, softcap=softcap)
    if reason is None:
        return module, None
    if name == "auto":
        return get_backend("torch", q.device), None
    return None, f"backend {name!r} cannot run these inputs: {reason}; use backend='auto' or 'torch'"
