"""hf_ring: exact ring attention (context parallelism) for Hugging Face Transformers.

Core (no Transformers import): ``shard``, ``unshard``, ``positions``, ``ring_attention`` (and its ``Selection``),
``PlanCache``,
``RingComm``, ``LoopbackComm``, ``decode_attention`` (queries alike on every rank, keys/values spread over them).
Transformers integration (imported on first use): ``apply_ring_attention``, ``revert_ring_attention``,
``shard_batch``, ``reduce_loss``, ``chunk_multiple``, ``apply_chunked_loss``, ``revert_chunked_loss``,
``apply_activation_offload``, ``revert_activation_offload``, ``ring_generate``, ``check_exactness`` (and its
``ExactnessReport``).
"""

from __future__ import annotations

import importlib

from .comm import LoopbackComm, RingComm
from .decode import decode_attention
from .kernels.mask import Selection
from .layout import LAYOUTS, positions, shard, unshard
from .ring import PlanCache, ring_attention

__version__ = "0.1.0"

_LAZY = {
    "apply_ring_attention": "hf_ring.apply",
    "revert_ring_attention": "hf_ring.apply",
    "register_attention": "hf_ring.apply",
    "shard_batch": "hf_ring.batch",
    "reduce_loss": "hf_ring.batch",
    "chunk_multiple": "hf_ring.compressed",
    "check_exactness": "hf_ring.exactness",
    "ExactnessReport": "hf_ring.exactness",
    "apply_chunked_loss": "hf_ring.loss",
    "revert_chunked_loss": "hf_ring.loss",
    "apply_activation_offload": "hf_ring.offload",
    "revert_activation_offload": "hf_ring.offload",
    "ring_generate": "hf_ring.generate",
}

__all__ = [
    "LAYOUTS",
    "LoopbackComm",
    "PlanCache",
    "RingComm",
    "Selection",
    "decode_attention",
    "positions",
    "shard",
    "unshard",
    "ring_attention",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_ring' has no attribute {name!r}")
