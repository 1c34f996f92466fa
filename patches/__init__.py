"""Per-family model patches (installed as ``hf_ring.patches``), in a registry keyed by ``config.model_type``.

Each dedicated family module (``llama``, ``mistral``, ``qwen2``, ``qwen3``) exposes ``PATCH`` (a
``FamilyPatch`` with ``apply`` / ``revert``) and the Liger-style entry points
``apply_ring_attention_to_<family>(..., model=None)`` and ``revert_ring_attention_from_<family>(model)``.
Families that need nothing special share the ``generic`` patch (one line each in ``generic.FAMILIES``);
vision-language models whose text model is of a supported family are patched for text-only batches
(``multimodal.WRAPPERS``).
``hf_ring.apply_ring_attention`` looks the family up here.
"""

from __future__ import annotations

from . import generic, multimodal
from ._family import FamilyPatch, is_applied
from .llama import apply_ring_attention_to_llama, revert_ring_attention_from_llama
from .mistral import apply_ring_attention_to_mistral, revert_ring_attention_from_mistral
from .qwen2 import apply_ring_attention_to_qwen2, revert_ring_attention_from_qwen2
from .qwen3 import apply_ring_attention_to_qwen3, revert_ring_attention_from_qwen3

__all__ = [
    "REGISTRY",
    "FamilyPatch",
    "get_patch",
    "is_applied",
    "supported_model_types",
    "apply_ring_attention_to_llama",
    "apply_ring_attention_to_mistral",
    "apply_ring_attention_to_qwen2",
    "apply_ring_attention_to_qwen3",
    "revert_ring_attention_from_llama",
    "revert_ring_attention_from_mistral",
    "revert_ring_attention_from_qwen2",
    "revert_ring_attention_from_qwen3",
]

REGISTRY: dict = {
    **multimodal.DEDICATED,
    **generic.PATCHES,
    **multimodal.PATCHES,
}
"""``config.model_type`` -> ``FamilyPatch``."""


def supported_model_types() -> list:
    return sorted(REGISTRY)


def get_patch(model_type) -> FamilyPatch:
    """The patch for ``model_type``; ValueError naming the supported families otherwise."""
    try:
        return REGISTRY[model_type]
    except (KeyError, TypeError):
        raise ValueError(
            f"hf_ring has no ring-attention patch for model type {model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        ) from None
