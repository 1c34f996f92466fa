"""The ``"cudnn"`` backend: the ``"sdpa"`` backend with PyTorch's cuDNN attention op tried first (CUDA only).

``aten._scaled_dot_product_cudnn_attention`` and its backward run the rectangles of every step they can
express (fp16 / bf16, one head_dim, a multiple of 8 up to 128); other inputs go to the ``"sdpa"``
backend's CUDA ops, masked steps to the ``"triton"`` backend. See ``sdpa_backend`` for the contract and
the LSE layouts. GPU status: not yet run on a GPU in this project's tests.
"""

from __future__ import annotations

from functools import partial

import torch

from . import sdpa_backend

__all__ = ["SOFTCAP", "backward", "forward", "unsupported"]

SOFTCAP = True  # on the masked fallback, as the sdpa backend
forward = partial(sdpa_backend.forward, backend="cudnn")
backward = partial(sdpa_backend.backward, backend="cudnn")


def unsupported(q, k, v) -> str | None:
    """Why these inputs cannot run here, or None."""
    if q.device.type != "cuda":
        return "PyTorch's cuDNN attention runs on CUDA only"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this PyTorch build"
    return sdpa_backend.unsupported(q, k, v)
