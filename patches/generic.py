"""Families whose attention needs nothing beyond what hf_ring implements: one generic patch for all of them.

Each listed family calls Transformers' attention interface with query/key/value after its own
projections, norms and rotary embedding, with its ``scaling``, per layer its ``sliding_window`` (from
``config.layer_types`` or ``config.sliding_window``), and the attention features the attention
function implements: logit softcapping (``softcap``: Gemma2, optionally Gemma3) and learned sinks
(``s_aux``: gpt-oss). What else is special about these families happens outside the attention
function, on local tokens, and so is exact under context parallelism as it is: QK norm (OLMo2,
Gemma3), layers without RoPE (SmolLM3), an attention multiplier (Granite, passed as ``scaling``),
logit scales and final logit softcapping (Granite, Cohere2, Gemma2), mixture-of-experts MLPs
(Mixtral, Qwen3-MoE, gpt-oss).

What the generic patch refuses (``check``): layer types other than full / sliding attention, and the
MoE router's load-balancing loss (``config.output_router_logits=True``): computed per rank on its
local tokens it would not be the loss of the whole sequence.

Models of these families are switched by ``hf_ring.apply_ring_attention(model)`` (or
``hf_ring.patches.get_patch(model_type)``); they have no family-named entry points.
"""

from __future__ import annotations

from ._family import FamilyPatch, LogitTransform, check_layer_types

__all__ = ["FAMILIES", "LOGIT_TRANSFORMS", "PATCHES", "check"]

FAMILIES = {
    "cohere2": "transformers.models.cohere2.modeling_cohere2.Cohere2Attention",
    "gemma2": "transformers.models.gemma2.modeling_gemma2.Gemma2Attention",
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3.Gemma3Attention",
    "gpt_oss": "transformers.models.gpt_oss.modeling_gpt_oss.GptOssAttention",
    "granite": "transformers.models.granite.modeling_granite.GraniteAttention",
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralAttention",
    "olmo2": "transformers.models.olmo2.modeling_olmo2.Olmo2Attention",
    "phi3": "transformers.models.phi3.modeling_phi3.Phi3Attention",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention",
    "smollm3": "transformers.models.smollm3.modeling_smollm3.SmolLM3Attention",
}
"""``config.model_type`` -> the attention class the generic patch switches."""


def check(config) -> None:
    """ValueError for what these families can configure and hf_ring does not implement."""
    what = getattr(config, "model_type", "model")
    check_layer_types(config, what)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{what}: config.output_router_logits=True adds the MoE router's load-balancing loss, which each rank "
            "would compute on its own tokens only (not the loss of the whole sequence); set "
            "config.output_router_logits=False to train with context parallelism"
        )


LOGIT_TRANSFORMS = {
    "cohere2": LogitTransform(multiply="logit_scale"),
    "gemma2": LogitTransform(softcap="final_logit_softcapping"),
    "gemma3_text": LogitTransform(softcap="final_logit_softcapping"),
    "granite": LogitTransform(divide="logits_scaling"),
}
"""What these families' causal-LM heads do to the lm_head output before the loss (the others: nothing)."""

PATCHES = {
    model_type: FamilyPatch(
        name=model_type,
        model_types=(model_type,),
        attention_class=path,
        check_config=check,
        logit_transform=LOGIT_TRANSFORMS.get(model_type),
    )
    for model_type, path in FAMILIES.items()
}
"""``config.model_type`` -> its ``FamilyPatch``."""
