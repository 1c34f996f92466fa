"""Local block kernels of one ring step, behind one seam.

Every backend module provides the same two functions (see ``torch_backend`` for the contract):

- ``forward(q, k, v, mask, scale, out, lse) -> (out, lse)``: attend to one key/value block and
  merge into the fp32 accumulators ``out`` / ``lse`` (natural-log) in place;
- ``backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, *, out=None) -> (dq, dk, dv)``:
  accumulate the block's gradients into fp32 ``dq`` / ``dk`` / ``dv`` in place (``out``: the global
  output in q's dtype, which fused backward kernels take instead of ``delta``).

Backends: ``"torch"`` (reference, any device), ``"triton"`` (our fused kernels), ``"sdpa"``
(PyTorch's fused attention ops, forward and backward, with the masked steps on ``"triton"`` on CUDA
and on ``"torch"`` elsewhere), ``"flash_attn"`` (optional). ``"auto"`` picks by device from measured
figures (``AUTO``; docs/kernels.md): ``"sdpa"`` on CPU, where PyTorch's flash op ran a ring step
2.0-2.8x faster than the torch backend; ``"triton"`` on CUDA (when importable) until GPU figures
say otherwise; ``"torch"`` elsewhere.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

from .mask import EMPTY, FULL, PARTIAL, BlockMask

__all__ = [
    "AUTO", "BACKENDS", "BlockMask", "EMPTY", "FULL", "PARTIAL", "get_backend", "masked_fallback",
    "resolve_backend", "triton_importable",
]  # fmt: skip

BACKENDS = ("auto", "torch", "triton", "sdpa", "flash_attn")
_MODULES = {"torch": "torch_backend", "triton": "triton_backend", "sdpa": "sdpa_backend", "flash_attn": "flash_backend"}

#: What ``"auto"`` runs on each device type (see the module docstring for the figures behind it).
AUTO = {"cpu": "sdpa", "cuda": "triton"}


def resolve_backend(name: str, device: torch.device) -> str:
    """The concrete backend name for ``name`` on ``device``; ValueError for an unknown name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    choice = AUTO.get(device.type, "torch")
    if choice == "triton" and not triton_importable():
        return "sdpa"
    return choice


def triton_importable() -> bool:
    """True when Triton (and so the ``"triton"`` backend) can be imported."""
    return importlib.util.find_spec("triton") is not None


def masked_fallback(device: torch.device) -> ModuleType:
    """The backend that runs the steps fused attention ops cannot express: triton on CUDA (torch without it)."""
    name = "triton" if device.type == "cuda" and triton_importable() else "torch"
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")


def get_backend(name: str, device: torch.device) -> ModuleType:
    """The backend module for ``name`` (after resolving ``"auto"``) on ``device``."""
    resolved = resolve_backend(name, device)
    return importlib.import_module(f"{__name__}.{_MODULES[resolved]}")
