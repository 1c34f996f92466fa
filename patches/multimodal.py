"""Vision-language models whose text model is of a supported family, for text-only batches.

Transformers loads some of the most fine-tuned checkpoints as vision-language models even for text work:
``AutoModelForCausalLM`` maps Gemma 3 (4B, 12B, 27B; ``model_type`` ``gemma3``) to
``Gemma3ForConditionalGeneration``, and Mistral Small 3.1 / 3.2 are ``Mistral3ForConditionalGeneration``. Their
language model is a plain decoder of a family hf_ring supports (``gemma3_text``, ``mistral``); the vision tower
and the projector only run when images are given.

The patch switches the text model's attention only (``set_attn_implementation`` for the text sub-config; the
vision tower keeps its own) and checks the text config as the text family does. A call with images or video
(``pixel_values``, ``mm_encoder_outputs``, ``token_type_ids`` marking image tokens) raises on every rank before
anything runs (``_family.TextOnly``): image tokens attend to each other both ways, which the ring's causal masks
do not express. The heads of these models apply no logit transform (Gemma 3's vision-language head has no final
softcapping), so the chunked loss needs none.
"""

from __future__ import annotations

import functools

from . import generic, mistral
from ._family import FamilyPatch

__all__ = ["MEDIA", "PATCHES", "WRAPPERS"]

MEDIA = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")
"""Keywords that carry images or video into these models' forward."""

WRAPPERS = {  # model_type: (the text config's model_type, the text model's attention class, its config check)
    "gemma3": ("gemma3_text", "transformers.models.gemma3.modeling_gemma3.Gemma3Attention", generic.check),
    "mistral3": (
        "mistral",
        "transformers.models.mistral.modeling_mistral.MistralAttention",
        mistral.PATCH.check_config,
    ),
}


def _check(config, *, wrapper: str, text_type: str, check) -> None:
    """The text family's check, for the text config a ``wrapper`` model holds."""
    if getattr(config, "model_type", None) != text_type:
        raise ValueError(f"{wrapper}: hf_ring supports its text model of type {text_type!r}, not {config.model_type!r}")
    check(config)


PATCHES = {
    model_type: FamilyPatch(
        name=model_type,
        model_types=(model_type,),
        attention_class=path,
        check_config=functools.partial(_check, wrapper=model_type, text_type=text_type, check=check),
        media=MEDIA,
    )
    for model_type, (text_type, path, check) in WRAPPERS.items()
}
"""``config.model_type`` of the vision-language model -> its ``FamilyPatch``."""
