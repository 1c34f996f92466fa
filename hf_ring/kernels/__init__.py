"""Local block kernels of one ring step, behind one seam.

Every backend module provides the same two functions (see ``torch_backend`` for the contract):

- ``forward(q, k, v, mask, scale, out, lse) -> (out, lse)``: attend to one key/value block and
  merge into the fp32 accumulators ``out`` / ``lse`` (natural-log) in place;
- ``backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv) -> (dq, dk, dv)``: accumulate the
  block's gradients into fp32 ``dq`` / ``dk`` / ``dv`` in place.

Backends: ``"torch"`` (reference, any device), ``"triton"`` (fused kernels), ``"flash_attn"``
(optional). ``"auto"`` picks ``"triton"`` for CUDA tensors when Triton is importable, else ``"torch"``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

from .mask import EMPTY, FULL, PARTIAL, BlockMask

__all__ = ["BACKENDS", "BlockMask", "EMPTY", "FULL", "PARTIAL", "get_backend", "resolve_backend"]

BACKENDS = ("auto", "torch", "triton", "flash_attn")
_MODULES = {"torch": "torch_backend", "triton": "triton_backend", "flash_attn": "flash_backend"}


def resolve_backend(name: str, device: torch.device) -> str:
    """The concrete backend name for ``name`` on ``device``; ValueError for an unknown name."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        if importlib.util.find_spec(f"{__name__}.triton_backend") is not None:
            return "triton"
    return "torch"


def get_backend(name: str, device: torch.device) -> ModuleType:
    """The backend module for ``name`` (after resolving ``"auto"``) on ``device``."""
    resolved = resolve_backend(name, device)
    return importlib.import_module(f"{__name__}.{_MODULES[resolved]}")
