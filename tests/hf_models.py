"""Tiny random Transformers models and batches, and the two ways the parity tests run them: the unmodified
model on the full batch (``reference_step``) and hf_ring on this rank's shard, its loss share and gradients summed
over the group (``ring_step``)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["MORE_FAMILIES", "PAD_ID", "in_transformers", "VISION_LANGUAGE", "SCALE_FACTOR", "VOCAB", "error_of", "errors", "grads", "make_batch", "make_config", "make_model",
           "prepare", "reference_step", "rel", "ring_step", "text_only", "with_token_types"]  # fmt: skip

VOCAB = 96
CHAMELEON_CODES = 8  # Chameleon's VQ-VAE codebook in the test models
PAD_ID = 0

# every attention module's `scaling` is multiplied by SCALE_FACTOR: an implementation that ignored Transformers'
# `scaling` (and used head_dim ** -0.5, or the family's own multiplier) would fail every parity case
SCALE_FACTOR = 1.5
# Gemma 4 scores RMS-normed queries and keys with scaling 1.0 (dot products of the order of head_dim): 1.5 times
# that makes a random tiny model so sharp that fp32 gradients differ from float64 by 3e-5 in Transformers' own
# attention (0.3: 2.6e-6, measured without the MoE block, which has no float64 kernel). 0.2 (neither 1.0 nor
# head_dim ** -0.5) keeps the ring's gradient errors at <= 4.4e-6 (measured, 1 to 4 ranks) under the 1e-5 tolerance
# (Gemma 3n and Gemma 4 Unified score the same way: 0.2 too; Gemma 3n at 1.5 measured 7.7e-6, at 0.2 2.5e-6)
SCALE_FACTORS = {
    "gemma4_text": 0.2,
    "gemma4": 0.2,
    "gemma4_unified_text": 0.2,
    "gemma4_unified": 0.2,
    "gemma4_unified-audio": 0.2,
    "gemma3n_text": 0.2,
    "gemma3n": 0.2,
}


# RoPE types whose frequencies follow the largest position id (config overrides for make_config). The thresholds
# sit between what some ranks' shards and the whole test sequences (40 / 45 tokens) reach, so a rank that chose by
# its own positions would rotate differently: longrope switches to its long factors above 36 positions (a zig-zag
# shard of rank 1 of 2 ends at position 35); dynamic NTK rescales its base for every length above 32.
LONGROPE = {
    "original_max_position_embeddings": 36,  # Phi-3 keeps it beside rope_parameters (and overwrites that copy)
    "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 36,
                        "short_factor": [1.0 + 0.1 * i for i in range(8)],
                        "long_factor": [2.0 + 0.5 * i for i in range(8)]},
}  # fmt: skip
DYNAMIC = {"max_position_embeddings": 32, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
DYNAMIC_FULL_LAYERS = {  # Gemma 3: RoPE per layer type, dynamic on the full-attention layers only
    "max_position_embeddings": 32,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
}  # fmt: skip

EAGER_REFERENCE = ("gemma2", "gpt_oss", "deepseek_v4", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "vaultgemma", "paligemma",
                   "paligemma-gemma2", "inkling_text", "inkling2_text", "inkling2_loop_text")  # fmt: skip
"""Families with attention logit softcapping, sinks or a position bias (Inkling, whose SDPA path drops its bias): their
reference is Transformers' eager attention. PaliGemma
too: its text attention says ``is_causal=False``, so SDPA attends both ways where Transformers skips the causal mask
(no token types, no padding); eager always applies the mask (``patches.multimodal.PaliGemmaPatch``)."""

ABSENT = object()
"""A common size a family's config does not take (``MORE_FAMILIES``: left out of the config, as its checkpoints' have it)."""

_SLIDE_FULL = {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]}
_LINEAR = {"head_dim": 16, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 12,
           "linear_conv_kernel_dim": 4}  # fmt: skip
_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
           "mamba_expand": 1, "mamba_chunk_size": 8}  # fmt: skip
_MOE_SHARED = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32}  # fmt: skip
_MLA = {"num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "head_dim": 8, "v_head_dim": 12}  # fmt: skip
# (16 indexer heads: a key scores exactly 0, the ReLU of every head, for 1 query in 65536, so no two keys tie at a
# query's 6th place, where torch.topk's pick among tied keys depends on the row's length: 4 heads tied in 2 rows)
_DSA = {"index_topk": 6, "index_head_dim": 16, "index_n_heads": 16}

MORE_FAMILIES = {  # model_type: (config class, causal-LM class, what the tiny config sets beyond the common sizes)
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),  # xIELU MLP, QK norm
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),  # ReLU^2 MLP
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5, "use_qk_norm": True}),  # parallel block
    "dots1": ("Dots1Config", "Dots1ForCausalLM", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, **_SLIDE_FULL}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", _SLIDE_FULL),  # QK norm, sliding / full mix
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),  # scaled embeddings, tied head
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}),  # post-sublayer norms, partial rotary
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),  # fused QKV, parallel residual
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                   "attention_multiplier": 0.2, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                   "logits_scaling": 2.0}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16}),  # QK norm
    "ministral": ("MinistralConfig", "MinistralForCausalLM", {"head_dim": 16, **_SLIDE_FULL}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {"partial_rotary_factor": 0.5}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {"clip_qkv": 0.5}),  # clipped projections
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", _SLIDE_FULL),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5, "qk_layernorm": True}),  # lm_head bias
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 16, "attention_bias": True,
                 "attention_dropout": 0.0, "residual_dropout": 0.0}),  # (its defaults: 0.1)
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"qk_layernorm": True, "use_parallel_residual": True,
                 "partial_rotary_factor": 0.25}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 7, "use_bias": True}),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 32, **_SLIDE_FULL}),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", {}),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "logit_scale": 0.5, **_SLIDE_FULL}),
    "cwm": ("CwmConfig", "CwmForCausalLM", {"head_dim": 16, **_SLIDE_FULL}),
    # ZAYA: CCA (queries and keys mixed by two causal convolutions, 2 tokens back; values half delayed by a token),
    # sliding and full layers, a router carrying its state across layers, a skip expert
    "zaya": ("ZayaConfig", "ZayaForCausalLM", {"head_dim": 16, "layer_types": ["hybrid_sliding", "hybrid"],
                                               "sliding_window": 6, "num_experts": 4, "num_experts_per_tok": 1,
                                               "moe_intermediate_size": 32, "router_hidden_size": 16}),
    # Inkling: a relative position bias by distance (extents 5 on the sliding layer, 7 on the full one), log scaling
    # of its full layer's queries and bias from position 10, short convolutions on keys, values and both residual
    # branches, an MoE layer with shared experts as a sink; a head on hidden states divided by a muP multiplier, its
    # vocabulary padded
    "inkling_text": ("InklingTextConfig", "InklingForCausalLM", {
        "head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
        "sliding_window_size": 5, "d_rel": 4, "rel_extent": 7, "log_scaling_n_floor": 10, "log_scaling_alpha": 0.5,
        "layer_types": ["hybrid_sliding", "hybrid"], "mlp_layer_types": ["dense", "sparse"], "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32, "logits_mup_width_multiplier": 2.0,
        "vocab_size": VOCAB + 8, "unpadded_vocab_size": VOCAB}),
    # Inkling 2: its relative position bias (projected and log-scaled by position_ids from 10), a sink per query,
    # short convolutions (its full layers' keys and values with taps per token), attention residuals over blocks of
    # layers (2 layers a block: its third layer reads the first block), experts; final logit softcapping, a padded
    # vocabulary
    "inkling2_text": ("Inkling2TextConfig", "Inkling2ForCausalLM", MORE_FAMILIES_INKLING2 := {
        "num_hidden_layers": 3, "head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
        "swa_head_dim": 16, "sliding_window_size": 5, "d_rel": 4, "rel_extent": 7, "log_scaling_n_floor": 10,
        "log_scaling_alpha": 0.5, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
        "n_layers_per_attn_res_block": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "final_logit_softcapping": 10.0, "vocab_size": VOCAB + 8,
        "unpadded_vocab_size": VOCAB}),
    # Inkling 2 Loop: Inkling 2's layers (a block each), its layers 2 and 3 run twice, the second pass taking messages
    # of the first pass's blocks through gates
    "inkling2_loop_text": ("Inkling2LoopTextConfig", "Inkling2LoopForCausalLM", {
        **{k: v for k, v in MORE_FAMILIES_INKLING2.items() if k not in ("num_hidden_layers", "layer_types")},
        "num_hidden_layers": 5, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
        "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2, "loop_gate_rank": 8,
        "n_layers_per_attn_res_block": 1}),
    # ModernBERT decoder (Ettin): windows of local_attention // 2, multi-head attention, a prediction head
    "modernbert-decoder": ("ModernBertDecoderConfig", "ModernBertDecoderForCausalLM",
                           {"local_attention": 12, "layer_types": _SLIDE_FULL["layer_types"], "num_key_value_heads": 4,
                            "cls_token_id": 3, "sep_token_id": 4}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {"moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1, "moe_intermediate_size": 32}),
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **_SLIDE_FULL}),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", {"logits_scaling": 2.0, **_SLIDE_FULL}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"head_dim": 16, "num_experts": 4, "moe_topk": 2}),
    "jais2": ("Jais2Config", "Jais2ForCausalLM", {"head_dim": 16}),
    "mellum": ("MellumConfig", "MellumForCausalLM", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **_SLIDE_FULL}),
    # Llama 3.2 Vision's text model: a cross-attention layer (1 of 3; skipped without image features)
    "mllama_text_model": ("MllamaTextConfig", "MllamaForCausalLM", {"num_hidden_layers": 3,
                                                                    "cross_attention_layers": [1]}),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", {"head_dim": 16, "sliding_window": 6}),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", {}),
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", {"head_dim": 16, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0, **_SLIDE_FULL}),
    # multi-head latent attention: values with their own head_dim (smaller, or larger for GLM-4.7-Flash)
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {**_MLA, "q_lora_rank": None, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", {**_MLA, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    # DeepSeek sparse attention: each query sees the 6 keys its indexer scores best (of up to 45)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", {**_MLA, **_DSA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}),
    # and its second layer reuses the first one's top-k
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {**_MLA, **_DSA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "indexer_types": ["full", "shared"]}),
    "axk2": ("AXK2Config", "AXK2ForCausalLM", {**_MLA, **_DSA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}),
    # Dots3 Note: a sparse-attention layer (indexer) and a sliding-window layer of its own sizes (swa_*: 2 heads, other
    # latent ranks, a rotary part of 12, values of 10), both latent attention with a per-head output gate
    "dots3_note_text": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM", {**_MLA, **_DSA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_experts_intermediate_size": 32, "layer_types": ["indexed_attention", "sliding_attention"], "sliding_window": 5, "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 20, "swa_kv_lora_rank": 12, "swa_head_dim": 20, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 10}),
    # with hyper-connections, learned sinks, and its second layer reusing the first one's top-k
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", {**_MLA, **_DSA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "hc_mult": 2, "learnable_sink_init": 0.5, "indexer_types": ["full", "shared"]}),
    # Gemma 4: layers that reuse an earlier layer's keys/values, keys as values on full layers, a wider head_dim on
    # full layers, per-layer token embeddings, final logit softcapping
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", {"head_dim": 16, "global_head_dim": 32, "num_hidden_layers": 4, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2, "attention_k_eq_v": True, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "final_logit_softcapping": 2.0, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", _MLA),  # scaled embeddings and residuals
    # MiniCPM 5 MoE: a sigmoid gate per query head on the attention output (q_gate_proj), a dense first layer
    "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"]}),
    # Ergo: sliding layers and full ones whose queries and keys are scaled (global_attention_scale), QK norm, experts
    "ergo": ("ErgoConfig", "ErgoForCausalLM", {"sliding_window": 6, "global_attention_every_n_layers": 2, "global_attention_scale": 2.0, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_intermediate_size": 32, "first_dense_intermediate_size": 96, "num_dense_blocks": 1}),
    "youtu": ("YoutuConfig", "YoutuForCausalLM", _MLA),
    "axk1": ("AXK1Config", "AXK1ForCausalLM", {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32}),
    # sinks, sliding / full mix, values with their own head_dim, experts
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", {"head_dim": 16, "v_head_dim": 12, **_SLIDE_FULL, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32}),
    "laguna": ("LagunaConfig", "LagunaForCausalLM", {"head_dim": 16, **_SLIDE_FULL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 32}),
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", {"final_logit_softcapping": 2.0}),
    # families new in Transformers 5.24 (tested from that release on): QK norm and xIELU (Apertus 1.5), sinks with
    # sliding / full layers and shared experts (Flint), sliding / full layers with shared experts (Kolibri 1), layers
    # looped over recurrently with L2 QK norm (Dory)
    "apertus1p5_text": ("Apertus1p5TextConfig", "Apertus1p5TextForCausalLM", {"head_dim": 16}),
    "flint": ("FlintConfig", "FlintForCausalLM", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, **_SLIDE_FULL}),
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, **_SLIDE_FULL}),
    # HRM-Text: two stacks of 2 layers (config.num_hidden_layers becomes 2 x 2 x 3 cache slots), each run several
    # times per forward (2 high cycles of 2 low ones and the high stack), the first low cycle of the first high one
    # without gradient; multi-head attention (no num_key_value_heads) with a sigmoid output gate
    "hrm_text": ("HrmTextConfig", "HrmTextForCausalLM", {"head_dim": 16, "num_key_value_heads": ABSENT, "H_cycles": 2, "L_cycles": 2, "L_bp_cycles": [1, 2]}),
    # (a sliding layer, then indexed ones: layer 1 picks the pool, layer 2 reads its keys and values, layer 3 has its
    # own; windows and budgets the test sequences exceed: a pool of 4 blocks of 4 keys, 4 + 4 local + 2 sink keys)
    "kolibri1_1": ("Kolibri1_1Config", "Kolibri1_1ForCausalLM", {"head_dim": 16, "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "sliding_window": 6, "layer_types": ["sliding_attention", *["indexed_attention"] * 3], "index_layers": [1], "kv_source_layers": [0, 1, 1, 3], "mlp_only_layers": [0], "mlp_only_intermediate_size": 48, "index_topk": 4, "index_pool_size": 16, "index_compression": 4, "index_num_heads": 2, "index_num_local_tokens": 4, "index_num_sink_tokens": 2}),
    "dory": ("DoryConfig", "DoryForCausalLM", {"head_dim": 16, "num_hidden_layers": 4, "n_input_layers": 1, "n_output_layers": 1, "n_recurrent_loops": 2, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    # Mamba2 alone (no attention layer): its convolution and scan over the ranks
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", {"num_heads": 8, "head_dim": 16, "expand": 2, "state_size": 8, "n_groups": 2, "chunk_size": 8, "conv_kernel": 4}),
    # Mamba (Mamba1: a decay per channel and state entry) alone, and Falcon-Mamba's (weightless) norms of its step
    # sizes, B and C; Jamba: Mamba layers with norms beside attention without RoPE, experts
    "mamba": ("MambaConfig", "MambaForCausalLM", {"state_size": 8, "expand": 2, "conv_kernel": 4, "time_step_rank": 8}),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {"state_size": 8, "expand": 2, "conv_kernel": 4, "time_step_rank": 8}),
    "jamba": ("JambaConfig", "JambaForCausalLM", {"mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
              "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 0,
              "num_experts": 4, "num_experts_per_tok": 2}),
    # RecurrentGemma (Griffin): recurrent blocks (a width-4 convolution, the RG-LRU) around a sliding-window
    # multi-query attention layer with half-rotary heads, final logit softcapping
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", {"num_hidden_layers": 3, "num_key_value_heads": 1,
                        "lru_width": 64, "attention_window_size": 6, "conv1d_width": 4, "logits_soft_cap": 3.0,
                        "block_types": ["recurrent", "attention", "recurrent"]}),
    # MiniMax: lightning attention (a fixed decay per head, in blocks of 8 here) beside attention, experts
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", {"head_dim": 16, "block_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"]}),
    # Llama's modules under their own model_type (EXAONE 3.x, InternLM3, IQuest-Coder; Transformers 5.24)
    "exaone": ("ExaoneConfig", "LlamaForCausalLM", {}),
    "internlm3": ("InternLM3Config", "LlamaForCausalLM", {"head_dim": 16}),
    "iquestcoder": ("IQuestCoderConfig", "LlamaForCausalLM", {"head_dim": 16}),
    # Sarvam: DeepSeek-V3's latent attention, GLM-4-MoE's QK-norm attention (Transformers 5.24)
    "sarvam_mla": ("SarvamMLAConfig", "DeepseekV3ForCausalLM", {**_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "n_shared_experts": 1, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1,
                   "first_k_dense_replace": 1}),
    "param2moe": ("Param2MoeConfig", "Glm4MoeForCausalLM", {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM", {"head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                   "topk_group": 1}),
    "aria_text": ("AriaTextConfig", "AriaTextForCausalLM", {"moe_num_experts": 4, "moe_topk": 2, "moe_num_shared_experts": 1}),
    # DBRX: clipped q/k/v, experts (its attention config must name rope_theta on 5.24)
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", {"d_model": 64, "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 1e4},
             "ffn_config": {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2}}),
    "emu3_text_model": ("Emu3TextConfig", "Emu3ForCausalLM", {"attention_dropout": 0.0}),  # (its default: 0.1)
    # Gemma 3n: AltUp, Laurel, per-layer inputs, activation sparsity, layers reusing earlier layers' keys/values,
    # sliding / full mix, final logit softcapping
    "gemma3n_text": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 6,
                     "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
                     "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "laurel_rank": 8,
                     "altup_num_inputs": 2, "final_logit_softcapping": 2.0,
                     "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]}),
    "gemma4_unified_text": ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", {"head_dim": 16, "num_hidden_layers": 4,
                            "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2,
                            "num_kv_shared_layers": 2, "final_logit_softcapping": 2.0}),
    # Cohere Compass: sliding layers with (text-only) multimodal RoPE, full layers without RoPE, logit scale
    "cohere_compass_text": ("CohereCompassTextConfig", "CohereCompassForCausalLM", {"logit_scale": 0.5, **_SLIDE_FULL,
                            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                      "mrope_section": [4, 2, 2]},
                                                "full_attention": None}}),
    # MiniMax M3's text model: a sparse attention layer (its indexer keeps, per key/value head, 2 blocks of 4 keys:
    # the one ending at the query and the best other; 8 of up to 40 keys), then a dense one
    "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", {"head_dim": 16, "rotary_dim": 8,
                           "num_local_experts": 4, "num_experts_per_tok": 2, "dense_intermediate_size": 96,
                           "shared_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"],
                           "layer_types": ["minimax_m3_sparse", "full_attention"], "index_block_size": 4,
                           "index_topk_blocks": 2, "index_local_blocks": 1, "index_head_dim": 16,
                           "index_n_heads": 2}),
    # DeepSeek-V4: one key/value head (keys and values one tensor), sinks, a window of 5 in every layer; a sliding layer,
    # then compressed ones: CSA (entries of 3 tokens, windows overlapping the one before; its indexer keeps 3 of up to
    # 15 per query) and HCA (entries of 6 tokens); hyper-connections of 2 streams, hash-routed then routed experts
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", {"num_key_value_heads": 1, "head_dim": 16,
                    "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "moe_intermediate_size": 32,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "hc_mult": 2, "hc_sinkhorn_iters": 3,
                    "sliding_window": 5, "index_n_heads": 4, "index_head_dim": 8, "index_topk": 3,
                    "partial_rotary_factor": 0.5, "num_hidden_layers": 4,
                    "compress_rates": {"compressed_sparse_attention": 3, "heavily_compressed_attention": 6},
                    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention", "compressed_sparse_attention"],
                    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"]}),
    # Phi-3.5-MoE: its router samples experts in training mode (tested in eval mode: top-2 routing)
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # older code models: multi-query attention with learned positions (StarCoder 1 / SantaCoder), rotary on part of
    # the head, interleaved (GPT-J, CodeGen)
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"rotary_dim": 8, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", {"rotary_dim": 8, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    # Llama 4: chunked attention on its RoPE layers (chunks of 8 tokens), a layer without RoPE whose queries scale
    # with their index in the row (temperature tuning, floor_scale 4 so that the scale grows within 40 tokens), L2
    # QK norm, experts with a shared expert on every other layer
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", {"head_dim": 16, "num_hidden_layers": 4, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "attention_chunk_size": 8, "no_rope_layers": [1, 1, 0, 1], "floor_scale": 4, "attn_scale": 0.5, "use_qk_norm": True}),
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", {"head_dim": 16, "embedding_multiplier": 3.0, "logits_scaling": 0.5, "residual_multiplier": 0.5, "attention_multiplier": 0.2}),
    # more attention families: absolute learned positions (GPT-2),
    # mixtures of attention heads (JetMoE), differential attention (DiffLlama), shared experts, and sinks with
    # windows (Granite MoE variants)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    # BioGPT: learned positions (offset 2) from position_ids, scaled embeddings
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
               "activation_dropout": 0.0, "layerdrop": 0.0, "scale_embedding": True}),
    # attention computed in the modules' own forward (hf_ring.patches._own): Falcon's three query / key / value
    # layouts (grouped keys and values as Falcon 40B / 180B, one key / value head with parallel attention as Falcon
    # 7B, one per query head with sequential blocks), rotary positions; GPT-Neo's unscaled scores with global and local
    # (window 6) layers and learned positions
    "falcon": ("FalconConfig", "FalconForCausalLM", {"num_kv_heads": 2, "new_decoder_architecture": True,
               "alibi": False, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "falcon-multi-query": ("FalconConfig", "FalconForCausalLM", {"multi_query": True, "new_decoder_architecture": False,
                           "parallel_attn": True, "alibi": False, "hidden_dropout": 0.0}),
    "falcon-heads": ("FalconConfig", "FalconForCausalLM", {"multi_query": False, "new_decoder_architecture": False,
                     "parallel_attn": False, "bias": True, "alibi": False, "hidden_dropout": 0.0}),
    # ALiBi (hf_ring.patches._own, the ring's alibi_slopes): BLOOM (4 heads; 6, whose slopes mix two bases), MPT
    "bloom": ("BloomConfig", "BloomForCausalLM", {"attention_dropout": 0.0, "hidden_dropout": 0.0}),
    "bloom-six-heads": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 48, "num_attention_heads": 6,
                        "attention_dropout": 0.0, "hidden_dropout": 0.0}),
    "mpt": ("MptConfig", "MptForCausalLM", {"max_seq_len": 64}),
    "mpt-six-heads": ("MptConfig", "MptForCausalLM", {"max_seq_len": 64, "hidden_size": 48, "num_attention_heads": 6}),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", {"num_layers": 2, "num_heads": 4,
                "attention_types": [[["global", "local"], 1]], "window_size": 6, "attention_dropout": 0.0,
                "resid_dropout": 0.0, "embed_dropout": 0.0}),
    # positions numbered from the attention mask (padding in front shifts them): OPT as OPT-350m (post-norm layers,
    # embeddings projected from a narrower width)
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 96, "dropout": 0.0, "word_embed_proj_dim": 48,
                                            "do_layer_norm_before": False}),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 16}),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {"head_dim": 16}),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 32, "attention_multiplier": 0.2, "embedding_multiplier": 3.0,
                         "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                       "logits_scaling": 2.0, **_SLIDE_FULL}),
    # hybrids: Gated DeltaNet (linear attention) layers beside gated full-attention layers
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _LINEAR),
    # hybrids: gated short convolutions (kernel 3, with bias) beside full-attention layers
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention"], "conv_bias": True}),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1,
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**_LINEAR, **_MOE_SHARED}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**_LINEAR, **_MOE_SHARED}),  # fused projections
    # Qwen4-Exp: Gated DeltaNet, attention whose indexer picks 2 blocks of 4 keys (and the incomplete block of the
    # query), hyper-connections, a per-layer embedding on the first layer (hashed trigrams, a convolution of dilation
    # 3 looking 3 tokens back: QWEN4_LONG_HALO looks 9 back)
    "qwen4_exp_text": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", {**_LINEAR, **_MOE_SHARED, "layer_types": ["linear_attention", "indexed_attention"], "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 32, "heads_per_ngram": 2, "ngram_vocab_size_base": 101, "make_ngram_vocab_size_divisible_by": 8, "ple_conv_kernel_size": 2, "indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8, "indexer_compress_ratio": 4}),
    # Kimi Delta Attention (a decay per key channel) beside latent attention without RoPE, experts
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", {**_MLA, "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                    "mlp_layer_types": ["dense", "sparse", "sparse"], "linear_num_heads": 2, "linear_head_dim": 16,
                    "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32}),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", _LINEAR),  # q/k/v and gate projections, beta x 2
    # LFM3: short convolutions beside sliding and full attention layers (Transformers 5.24)
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 6,
             "layer_types": ["conv", "sliding_attention", "full_attention"], "conv_bias": True, "conv_L_cache": 3}),
    # Lara-Mini: Gated DeltaNet beside sliding layers and full layers without RoPE, shared + routed experts (5.24)
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", {**_LINEAR, **_MOE_SHARED, "num_hidden_layers": 3,
                  "sliding_window": 6, "layer_types": ["linear_attention", "sliding_attention", "full_attention"]}),
    # Bailing (Ling linear): Kimi-style delta attention with one output-gate projection beside gated latent attention
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", {**_MLA, "head_dim": 16,
                       "layer_types": ["linear_attention", "full_attention"], "linear_num_heads": 2,
                       "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "num_local_experts": 4,
                       "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32,
                       "first_k_dense_replace": 1}),
    # hybrids: Mamba2 layers (a [head_dim, d_state] state per head, heads sharing B and C in groups) beside attention
    "bamba": ("BambaConfig", "BambaForCausalLM", {**_MAMBA2, "attn_layer_indices": [1]}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {**_MAMBA2, "layer_types": ["mamba", "attention"],
                         "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32,
                         "position_embedding_type": "rope", "attention_multiplier": 0.2, "embedding_multiplier": 3.0,
                         "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {"num_hidden_layers": 3, "layers_block_type": ["mamba", "attention", "moe"],
                   "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8,
                   "conv_kernel": 4, "chunk_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}),
    # Mamba (Mamba1) layers of two heads, each with its own x_proj / dt_proj, and an attention block shared by its
    # hybrid layers, on the hidden states beside the embeddings (no positions)
    "zamba": ("ZambaConfig", "ZambaForCausalLM", {"num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
              "n_mamba_heads": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8}),
    # Mamba2 layers and a shared attention block (on the hidden states beside the embeddings, LoRA-like adapters
    # per call site) every few layers
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", {"num_hidden_layers": 4, "num_key_value_heads": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
               "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 1, "mamba_headdim": 16, "mamba_ngroups": 2,
               "n_mamba_heads": 4, "chunk_size": 8, "num_mem_blocks": 1, "use_shared_attention_adapter": True,
               "adapter_rank": 8, "use_mem_rope": True}),
    # attention and Mamba2 side by side in every layer, muP multipliers, the gated norm after the gate
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {**_MAMBA2, "mamba_d_ssm": 64, "mamba_rms_norm": True,
                  "mamba_norm_before_gate": False, "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0,
                  "key_multiplier": 0.7, "attention_in_multiplier": 1.3, "ssm_in_multiplier": 0.8, "ssm_out_multiplier": 1.2}),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", {**_MLA, "num_layers": 1, "ffn_hidden_size": 96, "expert_ffn_hidden_size": 32, "n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 2}),
}  # fmt: skip
"""The families covered by one line each: what their tiny config exercises (see patches/generic.py)."""


_MROPE_HALF = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
               "partial_rotary_factor": 0.5}  # fmt: skip
_QWEN3_5_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                   "patch_size": 14}  # fmt: skip

_GLM5_NEXT = {"num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 12, "linear_head_dim": 16,
              "linear_num_heads": 4, "linear_conv_kernel_dim": 4, "hc_mult": 2, "hc_sinkhorn_iters": 3,
              "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
              "mlp_layer_types": ["dense", "sparse", "dense"], **_DSA, "index_topk": 8, "index_kpool": 4,
              "layer_types": ["linear_attention", "indexed_attention", "indexed_attention"],
              "indexer_types": ["full", "full", "shared"]}  # fmt: skip
_GLM5_NEXT_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                     "projection_intermediate_size": 48, "patch_size": 14}  # fmt: skip

# Cohere2 text (sliding / full, a logit scale that Aya Vision's head applies from Transformers 5.25 on, Command A
# Vision's not); a SigLIP tower of 2 x 2
# patches per 28 x 28 image, pixel-shuffled 2 x 2 into one token (Aya Vision, Command A Vision)
_COHERE2_TEXT = {"model_type": "cohere2", "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
                 "logit_scale": 0.5}  # fmt: skip
_SIGLIP_PIXEL_SHUFFLE = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                         "patch_size": 14}  # fmt: skip
JANUS_VQ = {"embed_dim": 8, "num_embeddings": 16, "latent_channels": 32, "base_channels": 32,
            "channel_multiplier": [1, 1], "num_res_blocks": 1, "projection_dim": 64,
            "image_token_embed_dim": 64, "num_hidden_layers": 1}  # fmt: skip
SAM_HIGH_RES = {"model_type": "sam_vision_model", "hidden_size": 32, "output_channels": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "image_size": 64, "patch_size": 16, "window_size": 2, "mlp_dim": 48,
                "global_attn_indexes": [0], "num_pos_feats": 16}  # fmt: skip
"""DeepSeek-VL-Hybrid's SAM tower: 64 x 64 images in 4 x 4 patches, resized to 8 x 8, strided twice to 2 x 2: 4 tokens
as its 28 x 28 SigLIP images' 2 x 2 patches."""
_SIGLIP = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
           "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "vision_use_head": False}  # fmt: skip

_GLM_ROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
_GLM_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
               "patch_size": 14, "image_size": 28}  # fmt: skip

_GRANITE_TEXT = {"model_type": "granite", "attention_multiplier": 0.2, "embedding_multiplier": 3.0,
                 "residual_multiplier": 0.5, "logits_scaling": 2.0}  # fmt: skip

VISION_LANGUAGE = {  # model_type: (config class, model class, text config beyond the common sizes, vision config)
    # Gemma 3n: a convolutional tower stands in for its timm MobileNetV5 (timm is no test dependency; _Gemma3nTower), a
    # [batch, 32, 2, 2] map: 4 soft tokens per 28 x 28 image; its vision vocabulary VOCAB.. (MEDIA_TOKENS), its audio
    # one after it (GEMMA3N_AUDIO_TOKEN)
    "gemma3n": ("Gemma3nConfig", "Gemma3nForConditionalGeneration", MORE_FAMILIES["gemma3n_text"][2],
                {"hidden_size": 32, "vocab_size": 8, "vocab_offset": VOCAB}),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration", MORE_FAMILIES["gemma4_text"][2],
               {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 2, "head_dim": 16, "patch_size": 14, "pooling_kernel_size": 2}),
    "gemma4-audio": ("Gemma4Config", "Gemma4ForConditionalGeneration", MORE_FAMILIES["gemma4_text"][2],
                     {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "num_key_value_heads": 2, "head_dim": 16, "patch_size": 14, "pooling_kernel_size": 2}),
    # Gemma 4 Unified: no vision tower, each 8 x 8 x 3 patch projected to one token (16 per image, 4 x 4); a window
    # of 20, longer than an image (a longer image is refused) and shorter than the sequence
    "gemma4_unified": ("Gemma4UnifiedConfig", "Gemma4UnifiedForConditionalGeneration",
                       {**MORE_FAMILIES["gemma4_unified_text"][2], "sliding_window": 20},
                       {"patch_size": 4, "pooling_kernel_size": 2, "mm_embed_dim": 32, "mm_posemb_size": 8,
                        "output_proj_dims": 32}),
    # and its audio: frames of 16 features projected without a tower, one token per frame
    "gemma4_unified-audio": ("Gemma4UnifiedConfig", "Gemma4UnifiedForConditionalGeneration",
                       {**MORE_FAMILIES["gemma4_unified_text"][2], "sliding_window": 20},
                       {"patch_size": 4, "pooling_kernel_size": 2, "mm_embed_dim": 32, "mm_posemb_size": 8,
                        "output_proj_dims": 32}),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration",
               {"head_dim": 16, "query_pre_attn_scalar": 20, **_SLIDE_FULL},
               {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": 56, "patch_size": 14, "vision_use_head": False}),  # 16 tokens per image, as checkpoints
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
                   {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                    "patch_size": 14}),
    # HyperCLOVA X Vision V2: Qwen2.5-VL's tower (windowed attention) before a HyperCLOVA X text model (multipliers)
    "hyperclovax_vision_v2": ("HyperCLOVAXVisionV2Config", "HyperCLOVAXVisionV2ForConditionalGeneration",
                              {"model_type": "hyperclovax", **MORE_FAMILIES["hyperclovax"][2]},
                              {"model_type": "qwen2_5_vl_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 48,
                               "num_heads": 2, "out_hidden_size": 64, "patch_size": 14}),
    # Muse Spark: gated attention with QK norm, sliding layers and a full one without RoPE, experts, a logit multiplier
    # before the final softcap; a tower of 4 x 4 patches of 2 x 14 x 14 x 3 merged 2 x 2: 4 tokens per image
    "muse_spark": ("MuseSparkConfig", "MuseSparkForConditionalGeneration",
                   {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
                    "mlp_layer_types": ["dense", "sparse"], "num_local_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "moe_hidden_size": 32, "final_logit_softcapping": 2.0,
                    "output_multiplier": 0.5, "qk_scale_factor": 2.0},
                   {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4, "max_position_embeddings": 16}),
    # Muse Glimmer: Muse Spark's text model without experts (gated attention with QK norm, sliding layers and a full
    # one without RoPE, a logit multiplier before the final softcap), its tower without audio: 4 tokens per image
    "muse_glimmer": ("MuseGlimmerConfig", "MuseGlimmerForConditionalGeneration",
                     {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
                      "final_logit_softcapping": 2.0, "output_multiplier": 0.5, "qk_scale_factor": 2.0},
                     {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "patch_size": 14, "pos_emb_height": 4, "pos_emb_width": 4, "max_position_embeddings": 16}),
    # Dots3 Note: its text model (sparse-attention and sliding layers), a tower of 4 x 4 patches of 14 x 14 x 3 (with
    # experts) merged 2 x 2: 4 tokens per image
    "dots3_note": ("Dots3NoteConfig", "Dots3NoteForConditionalGeneration", MORE_FAMILIES["dots3_note_text"][2],
                   {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "patch_size": 14, "pyramid_num_routed": [4], "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "adapter_in_dim": 32, "adapter_out_dim": 64}),
    # Cohere Compass: Qwen3-VL's tower (deepstack features) before its text model's sliding layers with multimodal
    # RoPE and full layers without RoPE
    "cohere_compass": ("CohereCompassConfig", "CohereCompassForConditionalGeneration",
                       MORE_FAMILIES["cohere_compass_text"][2],
                       {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                        "patch_size": 14, "deepstack_visual_indexes": [0]}),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3],
                                                      "mrope_interleaved": True}},
                 {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 14, "deepstack_visual_indexes": [0]}),
    # Inkling 2 (5.24): its text model as MORE_FAMILIES' (the vision tower's merger: 2 x 2 patches of 8 pixels)
    "inkling2": ("Inkling2Config", "Inkling2ForConditionalGeneration",
                 {k: v for k, v in MORE_FAMILIES["inkling2_text"][2].items() if k != "vocab_size"},
                 {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 8,
                  "projection_hidden_dim": 48, "text_hidden_size": 64, "posemb_grid_size": 8}),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
                 {"depth": 1, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2, "patch_size": 14}),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}},
                     {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                      "patch_size": 14, "deepstack_visual_indexes": [0]}),
    "internvl": ("InternVLConfig", "InternVLForConditionalGeneration", {"model_type": "qwen3", "head_dim": 16},
                 {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}),
    "mistral3-ministral3": ("Mistral3Config", "Mistral3ForConditionalGeneration",  # a Ministral 3 text model
                            {"model_type": "ministral3", "head_dim": 16, "sliding_window": 6},
                            {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {**_LINEAR, "rope_parameters": _MROPE_HALF},
                _QWEN3_5_VISION),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                    {**_LINEAR, **_MOE_SHARED, "rope_parameters": _MROPE_HALF}, _QWEN3_5_VISION),
    "qwen4_exp": ("Qwen4ExpConfig", "Qwen4ExpForConditionalGeneration",
                  {**MORE_FAMILIES["qwen4_exp_text"][2], "rope_parameters": _MROPE_HALF}, _QWEN3_5_VISION),
    "lfm2_vl": ("Lfm2VlConfig", "Lfm2VlForConditionalGeneration", MORE_FAMILIES["lfm2"][2],
                {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "patch_size": 16}),
    # Mistral Large 4: DeepSeek sparse attention without a query latent (its indexer projects the hidden states),
    # layers without RoPE (1, 3), layer 2 reusing layer 0's latents and layer 1's top-k, layer 3 layer 1's latents with
    # an indexer of its own, queries scaled by log(position + 1) per head (randomized in make_model, as LeRoPE's
    # learned frequencies), final logit softcapping
    "mistral_large4": ("MistralLarge4Config", "MistralLarge4ForConditionalGeneration",
                       {"num_hidden_layers": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                        "qk_rope_head_dim": 8, "v_head_dim": 12, **_DSA, "n_routed_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                        "no_rope_layers": [1, 0, 1, 0], "kv_source_layers": [0, 1, 0, 1],
                        "indexer_types": ["full", "full", "shared", "full"], "final_logit_softcapping": 2.0,
                        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64, "attention_factor": 1.0}},
                       {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", {"head_dim": 16, "sliding_window": 7},
                 {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", {"model_type": "llama"},
              {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
               "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration", {"model_type": "mistral", "sliding_window": 7},
                   {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                    "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "vipllava": ("VipLlavaConfig", "VipLlavaForConditionalGeneration", {"model_type": "llama"},
                 {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "video_llava": ("VideoLlavaConfig", "VideoLlavaForConditionalGeneration", {"model_type": "llama"},
                    {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    # Perception LM: a CLIP tower standing in for its timm one (timm is no test dependency; 5.17's config builds timm's
    # always: SINCE), its width where the projector reads it (model_args)
    "perception_lm": ("PerceptionLMConfig", "PerceptionLMForConditionalGeneration", {"model_type": "llama"},
                      {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 56, "patch_size": 14,
                       "model_args": {"embed_dim": 32}}),
    # FastVLM: a one-stage ConvNeXt standing in for its timm FastViT-HD (a convolutional tower too: a [batch, width,
    # h, w] map whose 2 x 2 cells are the image tokens), its width where the projector reads it (hidden_size)
    "fast_vlm": ("FastVlmConfig", "FastVlmForConditionalGeneration", {"model_type": "qwen2"},
                 {"model_type": "convnext", "patch_size": 14, "num_stages": 1, "hidden_sizes": [32], "depths": [1],
                  "hidden_size": 32, "image_size": 28}),
    "llava_next_video": ("LlavaNextVideoConfig", "LlavaNextVideoForConditionalGeneration", {"model_type": "llama"},
                         {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    # a Qwen2 text model with its sliding layers (layer 0 full, layers 1-2 slide), a SigLIP tower
    "llava_onevision": ("LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration",
                        {"model_type": "qwen2", "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 5,
                         "max_window_layers": 1},
                        {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                         "vision_use_head": False}),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", {"model_type": "llama"},
                 {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}),
    # Llama 4 (Scout, Maverick): its text model is a causal LM inside the wrapper; 56 x 56 images in 14 x 14 patches,
    # pixel-shuffled 2 x 2: 4 tokens each
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration", MORE_FAMILIES["llama4_text"][2],
               {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": 56, "patch_size": 14, "vision_output_dim": 32, "projector_input_dim": 32,
                "projector_output_dim": 32}),
    # Kimi K2.5 / K2.6: a DeepSeek-V3 text model (latent attention, experts); images of 4 x 4 patches of 14 x 14,
    # merged 2 x 2: 4 tokens each
    "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration",
                 {"model_type": "deepseek_v3", **MORE_FAMILIES["deepseek_v3"][2]},
                 {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8}),
    # EXAONE 4.5: an EXAONE 4 text model (sliding / full layers, QK norm); Qwen2.5-VL-like images of 4 x 4 patches,
    # merged 2 x 2: 4 tokens each, numbered 0, 1, ... as text
    "exaone4_5": ("Exaone4_5_Config", "Exaone4_5_ForConditionalGeneration",
                  {"model_type": "exaone4", **MORE_FAMILIES["exaone4"][2]},
                  {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "num_key_value_heads": 2,
                   "out_hidden_size": 64, "patch_size": 14, "fullatt_block_indexes": [0]}),
    # MiniMax M3: its text model with a sparse and a dense attention layer, experts;
    # Qwen2.5-VL-like images of 4 x 4 patches, merged 2 x 2: 4 tokens each
    "minimax_m3_vl": ("MiniMaxM3VLConfig", "MiniMaxM3SparseForConditionalGeneration",
                      MORE_FAMILIES["minimax_m3_vl_text"][2],
                      {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "patch_size": 14, "image_size": 56}),
    # LFM3-VL (5.24): an LFM3 text model (short convolutions, sliding and full layers); images of 4 x 4 patches of
    # 2 x 16 x 16 x 3, merged 2 x 2: 4 tokens each
    "lfm3_vl": ("Lfm3VlConfig", "Lfm3VlForConditionalGeneration", {"model_type": "lfm3", **MORE_FAMILIES["lfm3"][2]},
                {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"]}),
    # Apertus 1.5 (5.24): images tokenized into discrete codes (a VQ encoder: 4 x 4 pixels, downsampled 2 x 2: 4 codes)
    # embedded by the text model's embeddings; its text model with the extended vocabulary
    "apertus1p5": ("Apertus1p5Config", "Apertus1p5ForConditionalGeneration", MORE_FAMILIES["apertus1p5_text"][2],
                   {"codebook_size": 8, "embed_dim": 8, "latent_channels": 8, "base_channels": 32,
                    "channel_multiplier": [1, 1], "num_res_blocks": 1, "attn_resolutions": [], "resolution": 4}),
    # LLaVA-OneVision-1.5: Qwen3 text, a RICE-ViT tower of 4 x 4 patches of 14 x 14 x 3 merged 2 x 2: 4 tokens
    "llava_onevision1_5": ("LlavaOnevision15Config", "LlavaOnevision15ForConditionalGeneration",
                           {"model_type": "qwen3", "head_dim": 16},
                           {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                            "out_hidden_size": 64, "patch_size": 14}),
    # Ovis2.5: Qwen3 text, a NaViT tower of 4 x 4 patches of 14 x 14 x 3 (a windowed layer: windows of 2 x 2 merged
    # patches, reordering the vision split test's 8 x 8 grid; a full one), merged 2 x 2 into visual tokens: 4 per image,
    # between start and end markers (their own embeddings)
    "ovis2_5": ("Ovis2_5Config", "Ovis2_5ForConditionalGeneration", {"model_type": "qwen3", "head_dim": 16},
                {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "patch_size": 14, "image_size": 56, "vocab_size": 24, "window_size": 56,
                 "layer_types": ["window_attention", "full_attention"]}),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", {"model_type": "llama"},
                {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "image_size": 28, "patch_size": 14}),
    "idefics2": ("Idefics2Config", "Idefics2ForConditionalGeneration", {"model_type": "mistral", "sliding_window": 7},
                 {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "image_size": 28, "patch_size": 14}),
    "lighton_ocr": ("LightOnOcrConfig", "LightOnOcrForConditionalGeneration", {"model_type": "qwen3", "head_dim": 16},
                    {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "got_ocr2": ("GotOcr2Config", "GotOcr2ForConditionalGeneration", {"model_type": "qwen2"},
                 {"hidden_size": 32, "output_channels": 16, "mlp_dim": 48, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 64, "patch_size": 8, "global_attn_indexes": [0]}),
    "ovis2": ("Ovis2Config", "Ovis2ForConditionalGeneration", {"model_type": "qwen2"},
              {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 14, "hidden_stride": 2, "vocab_size": 32,
               "num_visual_indicator_tokens": 2}),
    "qianfan_ocr": ("QianfanOCRConfig", "QianfanOCRForConditionalGeneration", {"model_type": "qwen3", "head_dim": 16},
                    {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "image_size": 28, "patch_size": 14, "drop_path_rate": 0.0}),  # (drop path: random in training)
    "aya_vision": ("AyaVisionConfig", "AyaVisionForConditionalGeneration", _COHERE2_TEXT, _SIGLIP_PIXEL_SHUFFLE),
    "cohere2_vision": ("Cohere2VisionConfig", "Cohere2VisionForConditionalGeneration", _COHERE2_TEXT,
                       _SIGLIP_PIXEL_SHUFFLE),
    "minicpmv4_6": ("MiniCPMV4_6Config", "MiniCPMV4_6ForConditionalGeneration",  # a Qwen3.5 text model
                    {"model_type": "qwen3_5_text", **_LINEAR, "rope_parameters": _MROPE_HALF},
                    {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "image_size": 112, "patch_size": 14}),
    "minicpm_ocr": ("MiniCPMOcrConfig", "MiniCPMOcrForConditionalGeneration",  # MiniCPM-V 4.6's architecture
                    {"model_type": "qwen3_5_text", **_LINEAR, "rope_parameters": _MROPE_HALF},
                    {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "image_size": 112, "patch_size": 14}),
    "minicpmv4_7": ("MiniCPMV4_7Config", "MiniCPMV4_7ForConditionalGeneration",  # as 4.6, its images on a canvas
                    # of multimodal RoPE positions
                    {"model_type": "qwen3_5_text", **_LINEAR, "rope_parameters": _MROPE_HALF},
                    {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "image_size": 112, "patch_size": 14}),
    "video_llama_3": ("VideoLlama3Config", "VideoLlama3ForConditionalGeneration",  # a Qwen2 text model, windows
                      {"model_type": "qwen2", "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 5,
                       "max_window_layers": 1},
                      {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "patch_size": 14}),
    "deepseek_vl": ("DeepseekVLConfig", "DeepseekVLForConditionalGeneration", {"model_type": "llama"}, _SIGLIP),
    "deepseek_vl_hybrid": ("DeepseekVLHybridConfig", "DeepseekVLHybridForConditionalGeneration",
                           {"model_type": "llama"}, _SIGLIP),  # and a SAM high-resolution tower (SAM_HIGH_RES)
    "janus": ("JanusConfig", "JanusForConditionalGeneration", {"model_type": "llama"},
              {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
               "projection_dim": 64, "num_image_tokens": 4, "mlp_ratio": 1.5}),
    # GLM-4.1V: Qwen2-VL-like images of 4 x 4 patches merged 2 x 2 (4 tokens), multimodal RoPE on half of each head
    "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", {"rope_parameters": _GLM_ROPE}, _GLM_VISION),
    # GLM-4.5V / 4.6V: GLM-4.1V's images, a MoE text model (layer 0 dense, layer 1 routed and shared experts)
    "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration",
                  {"rope_parameters": _GLM_ROPE, "n_routed_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "first_k_dense_replace": 1}, _GLM_VISION),
    # GLM-4.6V's class: GLM-4.1V's, its text model built by AutoModel (a GLM-4.1V one, or GLM-4.5V's with experts)
    "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration", {"rope_parameters": _GLM_ROPE}, _GLM_VISION),
    "glmga": ("GlmgaConfig", "Glm46VForConditionalGeneration", {"rope_parameters": _GLM_ROPE}, _GLM_VISION),
    "glm46v-moe": ("Glm46VConfig", "Glm46VForConditionalGeneration",
                   {"model_type": "glm4v_moe_text", "rope_parameters": _GLM_ROPE, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}, _GLM_VISION),
    # GLM-5.3-Flash: KDA layers beside latent attention without RoPE whose indexer picks pools of 4 keys (layer 2
    # reusing layer 1's picks), hyper-connections of 2 streams, a MoE layer; GLM-4.1V-like images (4 tokens each)
    "glm5_next": ("Glm5NextConfig", "Glm5NextForConditionalGeneration", _GLM5_NEXT, _GLM5_NEXT_VISION),
    # GLM-OCR: GLM-4.1V's images and multimodal RoPE, a text model of its own (no biases in its attention)
    "glm_ocr": ("GlmOcrConfig", "GlmOcrForConditionalGeneration", {"rope_parameters": _GLM_ROPE}, _GLM_VISION),
    "paligemma": ("PaliGemmaConfig", "PaliGemmaForConditionalGeneration", {"model_type": "gemma", "head_dim": 16},
                  _SIGLIP),
    # Granite 4 Vision: a Granite text model (attention, embedding, residual multipliers, logits scaling); a CLIP tower
    # whose features go through window Q-Formers (deepstack: two vision layers' features added to the image tokens'
    # hidden states before text layers 0 and 1, 4 spatial groups' before layers 2 to 5); LLaVA-NeXT tiles
    # Granite Docling: a Granite-like text model (multipliers, logits scaling) given deepstack features; tiles of 32 x 32
    # (4 x 4 patches of 8 x 8) pixel-shuffled 2 x 2: 4 tokens per tile, one tile per image here
    "granite_docling": ("GraniteDoclingConfig", "GraniteDoclingForConditionalGeneration",
                        {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5,
                         "attention_multiplier": 0.2},
                        {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "image_size": 32, "patch_size": 8, "scale_factor": 2, "deepstack_visual_indexes": [0],
                         "out_hidden_size": 64}),
    "granite4_vision": ("Granite4VisionConfig", "Granite4VisionForConditionalGeneration",
                        {"num_hidden_layers": 6, "attention_multiplier": 0.2, "embedding_multiplier": 3.0,
                         "residual_multiplier": 0.5, "logits_scaling": 2.0},
                        {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 48,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 56, "patch_size": 14}),
    # PaddleOCR-VL: an ERNIE-4.5-like text model with Qwen2-VL's multimodal RoPE; a NaViT SigLIP tower, 4 x 4 patches
    # of 14 x 14 per image merged 2 x 2: 4 tokens between vision start / end
    "paddleocr_vl": ("PaddleOCRVLConfig", "PaddleOCRVLForConditionalGeneration",
                     {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                          "mrope_section": [2, 3, 3]}},
                     {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "patch_size": 14, "image_size": 56}),
    # HunyuanOCR: a HunYuan dense text model (QK norm) with 4-axis multimodal RoPE (position, width, height, image);
    # images of 4 x 4 patches of 16 x 16 x 3, merged 2 x 2 by a convolution, a newline after each of the 2 rows and
    # begin / end tokens: 8 tokens each
    # HunYuan V4 VL: HunYuan V4's text model (DeepSeek sparse attention, hyper-connections, sinks) with multimodal RoPE
    # on its rotary half; images of 4 x 4 patches of 16 x 16 x 3 merged 2 x 2, a newline after each row: 6 tokens each
    "hy_v4_vl": ("HYV4VLConfig", "HYV4VLForConditionalGeneration",
                 {**MORE_FAMILIES["hy_v4"][2], "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                   "mrope_section": [2, 1, 1]}},
                 {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "patch_size": 16, "max_image_size": 64, "out_hidden_size": 64}),
    "hunyuan_vl": ("HunYuanVLConfig", "HunYuanVLForConditionalGeneration",
                   {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                        "mrope_section": [2, 2, 2, 2]}},
                   {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "patch_size": 16, "max_image_size": 64}),
    # Aria: its MoE text model (routed and shared experts); an Idefics3 tower of 2 x 2 patches per 28 x 28 image, whose
    # cross-attention projector reads them with 4 learned queries (projector_patch_to_query_dict): 4 tokens (its text
    # config's model_type given: 5.17 builds a text config only from a dict that names it, else keeps the dict)
    "aria": ("AriaConfig", "AriaForConditionalGeneration",
             {"model_type": "aria_text", **MORE_FAMILIES["aria_text"][2]},
             {"model_type": "idefics3_vision", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    # Molmo2 (5.24): its text model (QK norm per head; layer 0 with linearly scaled RoPE, layer 1 without), image tokens
    # seeing each other both ways (mm_token_type_ids); a ViT of 2 x 2 patches per 28 x 28 crop, pooled by its adapter's
    # cross-attention (image_token_pooling: the patches each token pools): 4 tokens
    "molmo2": ("Molmo2Config", "Molmo2ForConditionalGeneration",
               {"model_type": "molmo2_text", "head_dim": 16, "rope_scaling_layers": [0],
                "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
               {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 2, "head_dim": 16, "image_size": [28, 28], "patch_size": 14}),
    # Emu3: images tokenized by a VQ-VAE into discrete codes (4 x 4 pixels, downsampled 2 x 2: 2 x 2 codes, an end of
    # line after each row: 6 tokens), embedded by its text model's embeddings; the VQ-VAE as small as it goes
    "emu3": ("Emu3Config", "Emu3ForConditionalGeneration", {"model_type": "emu3_text_model", "attention_dropout": 0.0},
             {"codebook_size": 8, "embed_dim": 8, "latent_channels": 8, "base_channels": 32,
              "channel_multiplier": [1, 1], "num_res_blocks": 1, "attn_resolutions": [],
              "temporal_downsample_factor": 2, "hidden_size": 32}),
    # Chameleon: its model is the text model, which tokenizes images by its VQ-VAE (4 x 4 pixels, downsampled 2 x 2:
    # 4 codes) and embeds the codes' tokens (the vocabulary's last 8 ids: CHAMELEON_CODES); the VQ-VAE as small as it
    # goes; qk-norm per head
    "chameleon": ("ChameleonConfig", "ChameleonForConditionalGeneration", {"attention_dropout": 0.0},
                  {"embed_dim": 8, "num_embeddings": CHAMELEON_CODES, "latent_channels": 8, "base_channels": 32,
                   "channel_multiplier": [1, 1], "num_res_blocks": 1, "attn_resolutions": [], "resolution": 4}),
    # Fuyu: a Persimmon text model; image patches of 2 x 2 pixels x 3 channels projected into it by one linear layer
    "fuyu": ("FuyuConfig", "FuyuForCausalLM", {"model_type": "persimmon", "partial_rotary_factor": 0.5}, None),
    # Phi-4-multimodal (text-only): its phi3-like text model is the top model (the image and audio embeddings merge
    # inside it: no images under the ring); its vision and audio towers as small as they go, never run
    "phi4_multimodal": ("Phi4MultimodalConfig", "Phi4MultimodalForCausalLM", {"sliding_window": 7},
                        {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "image_size": 28, "crop_size": 28, "patch_size": 14}),
    # ERNIE-4.5-VL: its MoE text model (layer 0 dense, layer 1 experts: text tokens routed to text experts, image tokens
    # and their start / end to vision ones: moe_mm_token_type_ids; shared experts), 3-D multimodal RoPE; Qwen-VL-like
    # images of 4 x 4 patches merged 2 x 2: 4 tokens between image start / end
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeConfig", "Ernie4_5_VLMoeForConditionalGeneration",
                        {"moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1,
                         "moe_intermediate_size": [32, 24], "mlp_layer_types": ["dense", "sparse"],
                         "tie_word_embeddings": False,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}},
                        {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 14}),
    # Step 3.7: its text model (step3p5: sliding and full layers, the sliding ones with 2 query heads, the full one with
    # 4; head-wise output gates, QK norm, partial RoPE per layer type, layer 1 routed and shared experts); a ViT of
    # 2 x 2 patches per 28 x 28 image, downsampled twice by strided convolutions: 1 token
    "step3p7": ("Step3p7Config", "Step3p7ForConditionalGeneration",
                {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
                 "num_sliding_attention_heads": 2, "mlp_layer_types": ["dense", "sparse"], "moe_num_experts": 4,
                 "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32,
                 "partial_rotary_factors": [0.5, 1.0]},
                {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "image_size": 28, "patch_size": 14, "max_position_embeddings": 4}),
    "paligemma-gemma2": ("PaliGemmaConfig", "PaliGemmaForConditionalGeneration",  # PaliGemma 2: window, softcaps
                         {"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 20,
                          "attn_logit_softcapping": 3.0, "final_logit_softcapping": 2.0, "sliding_window": 16,
                          "layer_types": ["sliding_attention", "full_attention"]}, _SIGLIP),
    # Llama 3.2 Vision: images by cross-attention (text layer 1 of 3), one <|image|> token each; 28 x 28 tiles of
    # 2 x 2 patches and a CLS token, up to 2 tiles per image, its tower's layer 0 features beside its last
    "mllama": ("MllamaConfig", "MllamaForConditionalGeneration",
               {"model_type": "mllama_text_model", "num_hidden_layers": 3, "cross_attention_layers": [1]},
               {"hidden_size": 32, "num_hidden_layers": 1, "num_global_layers": 1, "attention_heads": 2,
                "intermediate_size": 48, "vision_output_dim": 64, "image_size": 28, "patch_size": 14,
                "max_num_tiles": 2, "intermediate_layers_indices": [0],
                "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]}),
    # audio-language models (no vision tower: None; their audio tower in make_config's ``top``)
    "qwen2_audio": ("Qwen2AudioConfig", "Qwen2AudioForConditionalGeneration", {"model_type": "qwen2"}, None),
    # (its text config's defaults are a checkpoint's: head_dim 128 unless given)
    "voxtral": ("VoxtralConfig", "VoxtralForConditionalGeneration", {"model_type": "llama", "head_dim": 16}, None),
    # MOSS-Transcribe-Diarize (5.24): a Whisper-like tower, 2 frames merged per token, a Qwen3 text model
    "moss_transcribe_diarize": ("MossTranscribeDiarizeConfig", "MossTranscribeDiarizeForConditionalGeneration",
                                {"model_type": "qwen3", "head_dim": 16}, None),
    # Granite Speech (its head applies no logits_scaling), Granite Speech Plus (intermediate encoder layers too)
    "granite_speech": ("GraniteSpeechConfig", "GraniteSpeechForConditionalGeneration", _GRANITE_TEXT, None),
    "granite_speech_plus": ("GraniteSpeechPlusConfig", "GraniteSpeechPlusForConditionalGeneration", _GRANITE_TEXT,
                            None),
    # Nemotron 3 Nano Omni (5.24): a Nemotron-H text model (Mamba2, attention and MoE layers) as a causal LM inside the
    # wrapper; a RADIO vision tower (unused by the audio batches), a Parakeet audio tower (make_config's ``top``)
    "nemotron_h_omni": ("NemotronH_Omni_Reasoning_V3_Config", "NemotronH_Omni_Reasoning_V3",
                        {"model_type": "nemotron_h", **MORE_FAMILIES["nemotron_h"][2]},
                        {"model_type": "radio", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "mlp_ratio": 1.5, "patch_size": 14, "image_size": 28, "max_img_size": 56, "num_cls_tokens": 1,
                         "num_registers": 0, "video_temporal_patch_size": 2}),
    # Qwen2.5-Omni's thinker: Qwen2.5-VL's vision tower and multimodal RoPE, a Whisper-like audio tower (OMNI_AUDIO)
    "qwen2_5_omni_thinker": ("Qwen2_5OmniThinkerConfig", "Qwen2_5OmniThinkerForConditionalGeneration",
                             {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                  "mrope_section": [2, 3, 3]}},
                             {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                              "out_hidden_size": 64, "patch_size": 14, "fullatt_block_indexes": [0]}),
    # Cosmos3 Edge: interleaved multimodal RoPE, ReLU-squared MLPs; a SigLIP2 tower of 4 x 4 patches of 16 x 16 x 3
    # merged 2 x 2: 4 tokens per image
    "cosmos3_edge": ("Cosmos3EdgeConfig", "Cosmos3EdgeForConditionalGeneration",
                     {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                          "mrope_section": [4, 2, 2]}},
                     {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "patch_size": 16, "num_patches": 16}),
    # Cosmos3 (its Reasoner): Qwen3-VL's architecture under a model type of its own
    "cosmos3_omni": ("Cosmos3OmniConfig", "Cosmos3OmniForConditionalGeneration",
                     {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
                     {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
                      "patch_size": 14, "deepstack_visual_indexes": [0]}),
    # Qwen3-Omni-MoE's thinker: Qwen3-VL-MoE's text model (experts, interleaved multimodal RoPE) and deepstack features
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerConfig", "Qwen3OmniMoeThinkerForConditionalGeneration",
                               {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                    "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
                               {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                                "out_hidden_size": 64, "patch_size": 14, "deepstack_visual_indexes": [0]}),
}  # fmt: skip
"""Vision-language models whose text model hf_ring patches (text-only batches); ``overrides`` of ``make_config``
apply to their text config."""


SINCE = {"apertus1p5_text": "5.24", "dory": "5.24", "flint": "5.24", "kolibri1": "5.24", "codegen": "5.24",
         "gptj": "5.24", "exaone": "5.24", "internlm3": "5.24", "iquestcoder": "5.24", "sarvam_mla": "5.24",
         "sarvam_moe": "5.24", "lfm3": "5.24", "lfm3_vl": "5.24", "apertus1p5": "5.24", "lara_mini": "5.24",
         "bailing_hybrid": "5.24", "perception_lm": "5.24", "nemotron_h_omni": "5.24",
         "molmo2": "5.24", "mistral_large4": "5.24",
         "hyperclovax_vision_v2": "5.24", "hy_v4_vl": "5.24", "granite_docling": "5.24",
         "minicpmv4_7": "5.24", "muse_spark": "5.24", "dots3_note_text": "5.24",
         "dots3_note": "5.24", "qwen4_exp_text": "5.24", "qwen4_exp": "5.24", "minicpm_ocr": "5.24",
         "opt": "5.24", "moss_transcribe_diarize": "5.24", "glm5_next": "5.24",
         "inkling_text": "5.24", "inkling2_text": "5.24", "inkling2": "5.24", "inkling2_loop_text": "5.24",
         "minicpm5_moe": "5.25", "ergo": "5.25", "param2moe": "5.25", "llava_onevision1_5": "5.25", "ovis2_5": "5.25",
         "glmga": "5.25", "kolibri1_1": "5.25", "hrm_text": "5.25"}  # fmt: skip
"""Families tested from a later Transformers release than the oldest one supported: new models, or models whose
attention went through Transformers' attention interface only later (GPT-J, CodeGen; hf_ring refuses them by name on
a release where they do not), OPT, whose 5.17 decoder builds an all-ones mask (refused by name there), and Perception LM, whose 5.17 config builds its timm vision tower whatever it is given
(the tiny model's stand-in tower needs 5.24)."""


DRAWN_PADDING_EMBEDDING = ("gemma3n_text", "gemma3n")
"""Families whose padding token's embedding (zero at initialisation, ``padding_idx``) ``make_model`` draws at random,
as a trained checkpoint has it: Gemma 3n's AltUp takes the square root of each token's mean square, whose gradient
at a zero embedding is NaN (in the unmodified model too), and ``shard_batch`` pads with token 0."""


SAMPLES_IN_TRAINING = ("phimoe",)
"""Families whose training-mode forward draws random numbers (Phi-3.5-MoE's router samples its experts):
``make_model`` returns them in eval mode, where they are deterministic."""


TOKEN_TYPES_IN_TRAINING = ("molmo2",)
"""Families whose training-mode forward requires ``mm_token_type_ids`` even for text (Molmo2's; all zero there, as
its processor gives them): ``with_token_types`` adds them to a text batch."""


def with_token_types(family: str, batch: dict) -> dict:
    """``batch`` with all-zero ``mm_token_type_ids`` for a family of ``TOKEN_TYPES_IN_TRAINING`` (else as given)."""
    if family not in TOKEN_TYPES_IN_TRAINING:
        return batch
    return {**batch, "mm_token_type_ids": torch.zeros_like(batch["input_ids"])}


@contextlib.contextmanager
def text_only(model_type: str):
    """While inside, the registry's patch of the vision-language ``model_type`` is a text-only one (``images``
    False): every wrapper hf_ring supports takes images, so the refusal of images by a text-only wrapper, and DDP's
    check for its unreached vision tower, are tested this way."""
    import dataclasses

    from hf_ring.patches import REGISTRY

    saved = REGISTRY[model_type]
    REGISTRY[model_type] = dataclasses.replace(saved, images=False)
    try:
        yield
    finally:
        REGISTRY[model_type] = saved


BROKEN = {"llama4": ("5.24",)}
"""Families whose unmodified model fails in a Transformers release (major.minor), so not tested there: 5.24's
``Llama4ForConditionalGeneration.forward`` reads ``image_outputs`` from its causal LM's output, which has none (every
call raises AttributeError, images or not)."""


def in_transformers(model_type: str) -> bool:
    """The installed Transformers runs ``model_type``'s model as hf_ring patches it (``SINCE``, ``BROKEN``)."""
    import transformers
    from packaging.version import Version

    release = Version(transformers.__version__)
    broken = f"{release.major}.{release.minor}" in BROKEN.get(model_type, ())
    return transformers_at_least(SINCE.get(model_type)) and not broken


def transformers_at_least(release: str | None) -> bool:
    """The installed Transformers is ``release`` or later (None: any)."""
    import transformers
    from packaging.version import Version

    return release is None or Version(transformers.__version__) >= Version(release)


def make_config(family: str, **overrides):
    """A tiny random config: hidden 64, 4 query / 2 KV heads, windows shorter than the test sequences."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=7)
    elif family == "qwen2":  # layer 0 full, layers 1-2 slide (max_window_layers=1)
        cfg = tf.Qwen2Config(**{**common, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=5,
                             max_window_layers=1)  # fmt: skip
    elif family == "qwen3":  # explicit layer types, sliding first
        cfg = tf.Qwen3Config(
            **common,
            head_dim=24,
            use_sliding_window=True,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
        )
    elif family == "phi3":  # fused qkv projection, every layer sliding
        cfg = tf.Phi3Config(**common, sliding_window=7)
    elif family == "olmo2":  # QK norm over the whole projection
        cfg = tf.Olmo2Config(**common)
    elif family == "qwen3_moe":  # sparse MoE MLPs, sliding and full layers
        cfg = tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                use_sliding_window=True, sliding_window=6,
                                layer_types=["full_attention", "sliding_attention"])  # fmt: skip
    elif family == "mixtral":  # sparse MoE MLPs, every layer sliding
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=7)
    elif family == "granite":  # attention multiplier (the scaling), embedding / residual / logit multipliers
        cfg = tf.GraniteConfig(**common, attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5,
                               logits_scaling=2.0)  # fmt: skip
    elif family == "smollm3":  # layer 1 without RoPE, layer 0 sliding
        cfg = tf.SmolLM3Config(**common, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    elif family == "cohere2":  # sliding / full mix, parallel attention + MLP block, logit scale
        cfg = tf.Cohere2Config(**common, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                               logit_scale=0.5)  # fmt: skip
    elif family == "gemma3_text":  # sliding / full mix, QK norm, query_pre_attn_scalar
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=20, sliding_window=6,
                                  layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    elif family == "gemma2":  # attention and final logit softcapping, sliding / full mix
        cfg = tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
                              final_logit_softcapping=2.0, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    elif family == "gpt_oss":  # learned attention sinks, sliding / full mix, MoE
        cfg = tf.GptOssConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    elif family in MORE_FAMILIES:
        config_class, _, extra = MORE_FAMILIES[family]
        cfg = getattr(tf, config_class)(**{k: v for k, v in {**common, **extra}.items() if v is not ABSENT})
    elif family in VISION_LANGUAGE:  # the image token lies outside the vocabulary the test batches draw from
        config_class, _, extra, vision = VISION_LANGUAGE[family]
        top = {"mm_tokens_per_image": GEMMA3_IMAGE_TOKENS} if family == "gemma3" else {}
        if family == "idefics2":  # a perceiver resampling each image to IDEFICS2_IMAGE_TOKENS latents
            top = {"perceiver_config": {"hidden_size": 64, "resampler_n_latents": IDEFICS2_IMAGE_TOKENS,
                                        "resampler_depth": 1, "resampler_n_heads": 2, "resampler_head_dim": 16,
                                        "num_key_value_heads": 1}}  # fmt: skip
        if family == "ovis2":  # its head's sizes, and the image's start and end markers (their embeddings its own)
            top = {"hidden_size": common["hidden_size"], "vocab_size": overrides.get("vocab_size", VOCAB),
                   "visual_indicator_token_ids": [MEDIA_TOKENS["vision_start_token_id"],
                                                  MEDIA_TOKENS["vision_end_token_id"]]}  # fmt: skip
        if family == "cohere2_vision":  # (36864 by default)
            top = {"alignment_intermediate_size": 64}
        if family == "muse_spark":  # its audio tower (always built); its vision adapter from the tower's merged 2 x 2
            # patches to the text model's width
            top = {"out_hidden_size": 4 * vision["hidden_size"], "projector_hidden_size": common["hidden_size"],
                   "audio_config": {"hidden_sizes": [16, 16, 16, 16], "depths": [1, 1, 1, 1], "patch_sizes": [2, 2, 2, 2],
                                    "out_hidden_size": common["hidden_size"]}}  # fmt: skip
        if family == "muse_glimmer":  # its vision adapter from the tower's merged 2 x 2 patches to the text width
            top = {"out_hidden_size": 4 * vision["hidden_size"], "projector_hidden_size": common["hidden_size"]}
        if family == "dots3_note":  # its audio tower (always built)
            top = {"audio_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "feature_size": 16, "downsample_hidden_size": 8,
                                    "adapter_input_size": 32, "adapter_out_dim": common["hidden_size"]}}  # fmt: skip
        if family == "granite_docling":  # its density router (its loss only with router_labels)
            top = {"density_router_hidden_size": 16}
        if family == "kimi_k25":  # its projector's norm: over the vision tower's width
            top = {"projection_hidden_size": vision["hidden_size"]}
        if family in ("minimax_m3_vl", "lfm3_vl"):
            top = {"projector_hidden_size": 64}
        if family == "apertus1p5":  # image codes map to ids 10..17 (text tokens), an audio codebook after them
            top = {"image_token_offset": 10, "audio_token_offset": 18,
                   "audio_config": {"model_type": "wavtokenizer_encoder", "num_filters": 32,
                                    "upsampling_ratios": [2, 2], "hidden_size": 32, "codebook_size": 8,
                                    "codebook_dim": 32, "num_lstm_layers": 1}}  # fmt: skip
        if family.startswith("paligemma"):  # the projector maps the vision features to the text hidden size
            top = {"projection_dim": common["hidden_size"]}
        if family in ("minicpmv4_6", "minicpmv4_7", "minicpm_ocr"):  # the window merger after the tower's only layer
            top = {"insert_layer_id": 0}
            if family == "minicpm_ocr":  # (merged 2 x 2 twice as MiniCPM-V 4.6's, not once: 4 tokens per image)
                top["downsample_mode"] = "16x"
        if family == "janus":  # its image-generation VQ-VAE, unused by the forward: as small as it goes
            top = {"vq_config": JANUS_VQ}
        if family == "deepseek_vl_hybrid":
            top = {"high_res_vision_config": SAM_HIGH_RES}
        if family == "granite4_vision":  # 4 x 4 patches in one window of 4 x 4, its 2 x 2 queries: 2 x 2 tokens per
            # tile; its Q-Former one layer (without dropout: random per rank); each text layer given one feature
            top = {"downsample_rate": "2/4", "deepstack_layer_map": [[-2, 0], [-1, 1]], "spatial_vision_layer": -1,
                   "spatial_target_layers": [2, 3, 4, 5], "projector_dropout": 0.0,
                   "qformer_config": {"hidden_size": 64, "num_attention_heads": 1, "encoder_hidden_size": 64,  # (5.17
                                      # takes them as given; 5.24 sets them from the vision tower's width)
                                      "num_hidden_layers": 1, "cross_attention_frequency": 1, "intermediate_size": 48,
                                      "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                                      "use_qformer_text_input": False}}  # fmt: skip
        if family == "gemma4_unified-audio":  # no audio tower: frames of 16 features, one token each
            top = {"audio_config": {"audio_embed_dim": 16}, "audio_token_id": AUDIO_TOKEN}
        if family == "gemma3n":  # a conformer audio tower: 32 frames of 16 mel bins, two stride-2 convolutions -> 8
            top = {"audio_config": {"vocab_size": 4, "vocab_offset": VOCAB + len(MEDIA_TOKENS), "input_feat_size": 16,
                                    "hidden_size": 32, "conf_num_attention_heads": 2, "conf_num_hidden_layers": 1,
                                    "sscp_conv_channel_size": [8, 8], "conf_attention_chunk_size": 4,
                                    "conf_attention_context_left": 5},
                   "vision_soft_tokens_per_image": 4, "audio_soft_tokens_per_image": 8,
                   "image_token_id": MEDIA_TOKENS["image_token_id"], "audio_token_id": GEMMA3N_AUDIO_TOKEN}  # fmt: skip
        if family == "gemma4-audio":  # a conformer audio tower: 32 frames of 128 mel bins -> 8 tokens
            top = {"audio_config": GEMMA4_AUDIO, "audio_token_id": AUDIO_TOKEN}
        if family in OMNI_AUDIO:  # its audio tower (always built); the vision start token its positions always read
            # (its checkpoints' configs carry it, the config class does not define it)
            top = {"audio_config": OMNI_AUDIO[family], "vision_start_token_id": MEDIA_TOKENS["vision_start_token_id"]}
        if family == "molmo2":  # its adapter: pools the vision tower's last layer into the text width
            top = {"adapter_config": {"vision_feature_layer": [-1], "hidden_size": 32, "num_attention_heads": 2,
                                      "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
                                      "text_hidden_size": common["hidden_size"]}}  # fmt: skip
        if family == "emu3":  # its VQ-VAE; the image token, the end of line and the 8 codes' tokens (ids 10..17)
            codes = {f"<|visual token{i:06d}|>": 10 + i for i in range(8)}
            top = {"vq_config": vision,
                   "vocabulary_map": {"<image>": MEDIA_TOKENS["image_token_id"], "<|extra_200|>": 9,
                                      **codes}}  # fmt: skip
        if family == "aria":  # its projector's learned queries per image, by the number of patches
            top = {"projector_patch_to_query_dict": {4: 4}}
        if family == "perception_lm":  # 4 x 4 patches pooled 2 x 2: 4 tokens per tile (checkpoints: 32 x 32 -> 16 x 16)
            top = {"projector_pooling_ratio": 2}
        if family == "video_llava":  # features of the one-layer towers' last hidden states (not the embeddings)
            top = {"vision_feature_layer": -1}
        if family == "vipllava":  # features of the one-layer tower's two hidden states (5.17 names the list ...layers)
            top = {"vision_feature_layer" if transformers_at_least("5.24") else "vision_feature_layers": [-2, -1]}
        if family == "qwen2_audio":  # a Whisper-like tower: 32 frames of 16 mel bins -> 8 tokens (AUDIO_CLIPS)
            top = {"audio_config": QWEN2_AUDIO, "audio_token_index": AUDIO_TOKEN}
        if family == "voxtral":  # a Whisper-like tower: 32 frames of 16 mel bins -> 16 frames of 32, 2 per token: 8
            top = {"audio_config": VOXTRAL_AUDIO, "audio_token_id": AUDIO_TOKEN}
        if family == "moss_transcribe_diarize":  # as Voxtral's: 8 tokens per clip (AUDIO_CLIPS)
            top = {"audio_config": MOSS_AUDIO, "audio_token_id": AUDIO_TOKEN, "audio_merge_size": 2}
        if family.startswith("granite_speech"):  # a conformer (dropout off: random per rank), a window Q-Former:
            # 16 frames of 16 bins in windows of 4, 2 queries each -> 8 tokens
            plus = family == "granite_speech_plus"
            encoder = {**GRANITE_SPEECH_ENCODER, "cat_hidden_layers": [1]} if plus else GRANITE_SPEECH_ENCODER
            top = {"encoder_config": encoder, "window_size": 4, "downsample_rate": 2, "has_lora_adapter": False,
                   "audio_token_index": AUDIO_TOKEN,
                   "projector_config": {**GRANITE_SPEECH_QFORMER,
                                        "encoder_hidden_size": 64 if plus else 32}}  # fmt: skip
        if family == "nemotron_h_omni":  # Parakeet: 32 frames of 16 mel bins subsampled 4 times -> 8 tokens
            top = {"audio_config": NEMOTRON_H_OMNI_AUDIO, "audio_token_id": AUDIO_TOKEN, "vision_hidden_size": 32,
                   "projector_hidden_size": 64}  # fmt: skip
        if family == "fuyu":  # its patches: 2 x 2 pixels x 3 channels, projected to its hidden size (5.17's
            # projection reads the top config's)
            top = {"patch_size": 2, "num_channels": 3, "image_token_id": MEDIA_TOKENS["image_token_id"],
                   "hidden_size": common["hidden_size"]}  # fmt: skip
        if family == "chameleon":  # its text config the top one; the image codes' tokens the vocabulary's last
            size = overrides.get("vocab_size", VOCAB)
            codes = {f"IMGIMG{chr(ord('A') + i)}Z": size - CHAMELEON_CODES + i for i in range(CHAMELEON_CODES)}
            vocabulary = {"<image>": MEDIA_TOKENS["image_token_id"], **codes}
            cfg = getattr(tf, config_class)(**{**common, "vocab_size": size}, **extra, vq_config=vision,
                                            vocabulary_map=vocabulary)  # fmt: skip
        elif family == "phi4_multimodal":  # its text config the top one, the towers' sub-configs beside it
            audio = {"hidden_size": 32, "intermediate_size": 48, "num_blocks": 1, "num_attention_heads": 2,
                     "ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32,
                     "nemo_conv_channels": 32}  # fmt: skip
            cfg = getattr(tf, config_class)(**common, **extra, vision_config=vision, audio_config=audio)
        else:
            towers = {"vision_config": vision, "image_token_index": VOCAB + 3} if vision is not None else {}
            cfg = getattr(tf, config_class)(text_config={**common, **extra}, **towers, **top)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg.get_text_config(), k, v)
    return cfg


MEDIA_TOKENS = {"image_token_id": VOCAB + 4, "video_token_id": VOCAB + 5, "vision_start_token_id": VOCAB + 6,
                "vision_end_token_id": VOCAB + 7}  # fmt: skip
"""The special tokens of image batches (``make_batch("images", ..., family=...)``): inside the vocabulary of a
model made with ``images=True`` (VOCAB + 8 tokens), outside the range the batches draw text from."""


KEEPS_FP32 = ("inkling_text", "inkling2_text", "inkling2_loop_text")
"""Families whose modules in ``_keep_in_fp32_modules_strict`` stay fp32 in a low-precision test model, as
``from_pretrained(dtype=...)`` keeps them (Inkling 2's router takes fp32 inputs only)."""


def make_model(family: str, *, seed: int = 0, dtype=torch.float32, images: bool = False, **overrides):
    """A tiny random model of ``family``; ``images``: a vision-language model that takes ``MEDIA_TOKENS``."""
    import transformers as tf

    if family == "chameleon":  # its image codes' tokens after the rest (never drawn as text, never a media token)
        overrides = {"vocab_size": VOCAB + len(MEDIA_TOKENS) + 4 + CHAMELEON_CODES, **overrides}
    if images:
        vocab = {} if family == "chameleon" else {"vocab_size": VOCAB + len(MEDIA_TOKENS) + 4}
        if family.startswith("gemma4"):  # its per-layer embeddings of every token (one it generates too)
            vocab["vocab_size_per_layer_input"] = vocab["vocab_size"]
        overrides = {**vocab, **overrides}

    classes = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
               "qwen3": tf.Qwen3ForCausalLM, "phi3": tf.Phi3ForCausalLM, "olmo2": tf.Olmo2ForCausalLM,
               "qwen3_moe": tf.Qwen3MoeForCausalLM, "mixtral": tf.MixtralForCausalLM,
               "granite": tf.GraniteForCausalLM, "smollm3": tf.SmolLM3ForCausalLM,
               "cohere2": tf.Cohere2ForCausalLM, "gemma3_text": tf.Gemma3ForCausalLM,
               "gemma2": tf.Gemma2ForCausalLM, "gpt_oss": tf.GptOssForCausalLM,
               **{f: m for f, (_, m, _) in MORE_FAMILIES.items()},
               **{f: m for f, (_, m, _, _) in VISION_LANGUAGE.items()}}  # fmt: skip
    cls = classes[family]
    cls = getattr(tf, cls) if isinstance(cls, str) else cls  # (by name: families of later releases too)
    torch.manual_seed(seed)
    config = make_config(family, **overrides)
    if family == "gemma3n":  # its vision tower built from the config is timm's: _Gemma3nTower in its place
        from unittest import mock

        from transformers.models.gemma3n import modeling_gemma3n

        build = modeling_gemma3n.AutoModel.from_config

        def tower(*args, **kwargs):  # (5.17 passes the config by keyword)
            cfg = args[0] if args else kwargs["config"]
            return _Gemma3nTower() if cfg.model_type == "gemma3n_vision" else build(*args, **kwargs)

        with mock.patch.object(modeling_gemma3n.AutoModel, "from_config", tower):
            model = cls(config).to(dtype)
    else:
        model = cls(config).to(dtype)
    if family in KEEPS_FP32 and dtype != torch.float32:  # as from_pretrained(dtype=...) keeps them
        strict = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if any(part in name for part in strict):
                t.data = t.data.float()
    model.config.use_cache = False
    if family in DRAWN_PADDING_EMBEDDING:
        with torch.no_grad():
            row = model.get_input_embeddings().weight[PAD_ID]
            row.copy_(torch.randn(row.shape, generator=torch.Generator().manual_seed(6)).to(row.dtype))
    if family in SAMPLES_IN_TRAINING:  # compared in eval mode (deterministic routing) unless a test says otherwise
        model.eval()
    if images:
        model.config.image_token_index = MEDIA_TOKENS["image_token_id"]  # LLaVA's name for it
        if family in ("llava_next", "llava_next_video", "llava_onevision"):
            model.config.image_grid_pinpoints = NEXT_PINPOINTS
        if family == "granite4_vision":  # LLaVA-NeXT's tiles, of its 56 x 56 tower
            model.config.image_grid_pinpoints = GRANITE4_VISION_PINPOINTS
        for key, value in MEDIA_TOKENS.items():
            setattr(model.config, key, value)
        if family in ("ernie4_5_vl_moe", "ovis2_5"):  # its image start / end tokens (other names than Qwen-VL's)
            model.config.image_start_token_id = MEDIA_TOKENS["vision_start_token_id"]
            model.config.image_end_token_id = MEDIA_TOKENS["vision_end_token_id"]
        if family == "molmo2":  # its image and video token one (both names map to image_patch_id): the image one
            model.config.image_patch_id = MEDIA_TOKENS["image_token_id"]
        if family in ("apertus1p5", "muse_spark", "dots3_note") or family in OMNI_AUDIO:  # its audio placeholder
            model.config.audio_token_id = AUDIO_TOKEN
    if family in EAGER_REFERENCE:  # the reference: SDPA has no softcapping or sinks (5.17 ignores them)
        model.set_attn_implementation("eager")
    for m in model.modules():  # Mllama's cross-attention gates start at 0 (tanh 0: the layer adds nothing): open them
        if isinstance(getattr(m, "cross_attn_attn_gate", None), torch.nn.Parameter):
            with torch.no_grad():
                m.cross_attn_attn_gate.fill_(0.7)
                m.cross_attn_mlp_gate.fill_(0.5)
    for m in model.modules():  # ZAYA's key scale starts at zero (every key 0, the attention uniform): draw it, so that
        # the keys (its convolved CCA projections) matter
        if type(m).__name__ == "ZayaQKNorm":
            with torch.no_grad():
                m.temp.copy_(1.0 + 0.3 * torch.randn(m.temp.shape, generator=torch.Generator().manual_seed(9)))
    for m in model.modules():  # Inkling 2's attention-residual queries and static convolution taps start at zero (the
        # residuals uniform over the blocks): draw them
        if type(m).__name__.replace("Loop", "") in (
            "Inkling2BlockAttentionResidual",
            "Inkling2MessageAttentionResidual",
            "Inkling2DynamicShortConvolution",
        ):
            with torch.no_grad():
                p = m.query if hasattr(m, "query") else m.static_weight
                p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(11)))
    for m in model.modules():  # learned sinks start at zero: give each head its own, which the ring must keep apart
        if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
            with torch.no_grad():
                m.sinks.normal_()
    for m in model.modules():  # Mistral Large 4 starts with no query scaling by position and LeRoPE's learned
        # frequencies at 1 (scale 0, bias 1, alpha 0): draw them, so that the ring must give each query its own position
        if type(m).__name__.endswith("SoftmaxScaling") or type(m).__name__ == "MistralLarge4TextRotaryEmbedding":
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(p + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    for m in model.modules():  # Qwen4-Exp's per-layer embedding starts with its convolution at zero (a no-op): draw
        # it, so that the ring must give each chunk the convolution inputs before it
        if type(m).__name__.endswith("PLELayer"):
            with torch.no_grad():
                m.conv1d.weight.copy_(
                    0.5 * torch.randn(m.conv1d.weight.shape, generator=torch.Generator().manual_seed(8))
                )
    for m in model.modules():  # DeepSeek-V4's hash routing table starts at zero (every token to expert 0, twice: its
        # gate's gradient 0 but for rounding): draw distinct experts per token, as a checkpoint's table has them
        if isinstance(getattr(m, "tid2eid", None), torch.Tensor):
            g = torch.Generator().manual_seed(10)
            table = torch.stack(
                [torch.randperm(m.num_experts, generator=g)[: m.top_k] for _ in range(m.tid2eid.shape[0])]
            )
            m.tid2eid.copy_(table)
    for m in model.modules():  # DeepSeek-V4's compressors start with no bias per window slot, and its hyper-connections
        # with projections of std 0.02 (every stream mixed alike, their scales' gradients down to rounding): draw both
        name = type(m).__name__
        if name.startswith("DeepseekV4") and name.endswith(("Compressor", "Indexer", "HyperConnection", "HyperHead")):
            g = torch.Generator().manual_seed(11)
            with torch.no_grad():
                for p_name, p in m.named_parameters(recurse=False):
                    if p_name in ("position_bias", "fn", "hc_fn"):
                        p.copy_(0.5 * torch.randn(p.shape, generator=g))
    for m in model.modules():  # a non-default attention scale, which the ring must honour
        if isinstance(getattr(m, "scaling", None), float):
            m.scaling *= SCALE_FACTORS.get(family, SCALE_FACTOR)  # the family's own scale (multipliers, ...), changed
    return model


def _takes_num_crops() -> bool:
    """Molmo2's image encoder takes ``image_num_crops`` (Transformers 5.25 on): its pooling indices are per image."""
    import inspect

    from transformers.models.molmo2.modeling_molmo2 import Molmo2Model

    return "image_num_crops" in inspect.signature(Molmo2Model.get_image_features).parameters


_IMAGE_SPOTS = ((0, 5), (0, 25), (1, 17))  # (row, first image token) of each image
GEMMA4_AUDIO = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                "subsampling_conv_channels": [128, 4], "output_proj_dims": 32}  # fmt: skip
QWEN2_AUDIO = {"model_type": "qwen2_audio_encoder", "num_mel_bins": 16, "encoder_layers": 1,
               "encoder_attention_heads": 2, "encoder_ffn_dim": 48, "d_model": 32,
               "max_source_positions": 16}  # fmt: skip
VOXTRAL_AUDIO = {"model_type": "voxtral_encoder", "num_mel_bins": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "intermediate_size": 64, "hidden_size": 32, "max_source_positions": 16}  # fmt: skip
MOSS_AUDIO = {"num_mel_bins": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 48,
              "hidden_size": 32, "max_source_positions": 16}  # fmt: skip
GRANITE_SPEECH_ENCODER = {"input_dim": 16, "num_layers": 2, "hidden_dim": 32, "feedforward_mult": 2, "num_heads": 2,
                          "output_dim": 8, "context_size": 8, "max_pos_emb": 8, "dropout": 0.0,
                          "conv_kernel_size": 3}  # fmt: skip
GRANITE_SPEECH_QFORMER = {"model_type": "blip_2_qformer", "hidden_size": 32, "num_attention_heads": 2,
                          "intermediate_size": 48, "num_hidden_layers": 1, "cross_attention_frequency": 1,
                          "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                          "use_qformer_text_input": False}  # fmt: skip
NEMOTRON_H_OMNI_AUDIO = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 48,
                         "conv_kernel_size": 3, "subsampling_factor": 4, "subsampling_conv_channels": 8,
                         "num_mel_bins": 16, "dropout": 0.0, "layerdrop": 0.0, "activation_dropout": 0.0,
                         "attention_dropout": 0.0, "projection_hidden_size": 48, "projection_bias": False}  # fmt: skip
AUDIO_TOKEN = VOCAB + 3  # Gemma 4's audio placeholder in models made with images=True (outside MEDIA_TOKENS)
GEMMA3N_AUDIO_TOKEN = VOCAB + len(MEDIA_TOKENS) + 1  # Gemma 3n's: inside its audio vocabulary, after the vision one


class _Gemma3nTower(torch.nn.Module):
    """A convolutional tower in place of Gemma 3n's timm MobileNetV5: 28 x 28 images in patches of 14, width 32 (a
    [batch, 32, 2, 2] map, as timm's [batch, width, h, w]), no ``PreTrainedModel`` inside (whose config Gemma 3n's would
    not know when setting the attention)."""

    def __init__(self):
        super().__init__()
        self.patches = torch.nn.Conv2d(3, 32, kernel_size=14, stride=14)
        self.mix = torch.nn.Conv2d(32, 32, kernel_size=1)

    def forward(self, pixel_values, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=self.mix(torch.nn.functional.gelu(self.patches(pixel_values))))


OMNI_AUDIO = {  # the Qwen-Omni thinkers' audio towers, 16 mel bins: Qwen2.5-Omni's two convolutions (one strided) and
    # pooling by 2 (32 frames of a clip -> 8 tokens), Qwen3-Omni's three strided 2-D convolutions (64 frames -> 8)
    "qwen2_5_omni_thinker": {"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2,
                             "encoder_ffn_dim": 48, "d_model": 32, "output_dim": 64, "max_source_positions": 64},
    "qwen3_omni_moe_thinker": {"num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2,
                               "encoder_ffn_dim": 48, "d_model": 32, "output_dim": 64, "max_source_positions": 64,
                               "downsample_hidden_size": 8},
}  # fmt: skip
OMNI_FRAMES = {"qwen2_5_omni_thinker": (32, 24), "qwen3_omni_moe_thinker": (64, 48)}
"""The frames of an Omni thinker's test clips (the third one shorter): 8, 8 and 6 audio tokens."""
GEMMA3_IMAGE_TOKENS = 16  # a 56 x 56 image in 14 x 14 patches: its tokens see each other both ways, across rank edges
IDEFICS2_IMAGE_TOKENS = 4  # the perceiver's latents per image (64 in checkpoints)
HUNYUAN_VL_IMAGE_TOKENS = 8  # a 4 x 4 patch grid merged 2 x 2, a newline after each row, begin and end: 2 * 3 + 2
NEXT_PINPOINTS = [[28, 28], [28, 56]]  # LLaVA-NeXT's tile layouts for the tiny 28 x 28 vision tower
GRANITE4_VISION_PINPOINTS = [[56, 56], [56, 112]]  # Granite 4 Vision's: a tile's 4 x 4 patches downsampled to 2 x 2


_FOUR_TOKENS = ("gemma3n", "granite_docling", "llava", "lfm2_vl", "idefics2", "got_ocr2", "vipllava", "video_llava", "perception_lm", "fast_vlm",
                "llama4", "kimi_k25", "exaone4_5", "minimax_m3_vl", "lfm3_vl", "apertus1p5", "minicpmv4_6",
                "minicpmv4_7", "minicpm_ocr",
                "video_llama_3", "janus", "deepseek_vl", "deepseek_vl_hybrid", "paligemma",
                "paligemma-gemma2", "aria", "molmo2")  # fmt: skip
"""Families whose test images give 4 tokens each (besides Qwen-VL's)."""


def _media_batch(kind: str, seq_len: int, family: str, g: torch.Generator) -> dict:
    """Two rows with three images (``kind`` "images", "images-padded": row 1 left-padded by 6) or, for Qwen-VL,
    an image and a video of 2 temporal patches ("video", Qwen2-VL and Qwen2.5-VL), as the family's processor lays them out: Qwen-VL a 4 x 4 patch grid
    (4 tokens after the 2 x 2 merge) between vision start / end tokens with ``mm_token_type_ids``; LLaVA a 28 x 28
    image (4 patch tokens), ViP-LLaVA's, FastVLM's and Video-LLaVA's too (``pixel_values_images``; for "video" 2
    frames of 4 patches and their CLS token: 10 tokens); Idefics2 one of 4 perceiver latents; GOT-OCR 2.0 a 64 x 64
    image (4 tokens); Perception LM one 56 x 56 tile per image, pooled to 4 tokens (a video's 2 frames: 8);
    LLaVA-NeXT images of 28 x 28 and 28 x 56 (a base image and 1 or 2 tiles: 10 and 14 tokens with the row ends,
    ``NEXT_PINPOINTS``), LLaVA-NeXT-Video's too, and for "video" 4 frames pooled to 1 token each; LLaVA-OneVision as
    LLaVA-NeXT, but a row's several images untiled (2 x 2 and a newline: 5 tokens; ``batch_num_images``) and, for
    "video", 4 frames pooled to 1 token each and a newline; InternVL, Qianfan-OCR, Mistral 3, LightOnOCR, Idefics3,
    SmolVLM, Aya Vision, Command A Vision and Ovis2 (between visual indicator tokens) one token per 28 x 28 image;
    Gemma 3 16 tokens per 56 x 56 image marked by ``token_type_ids`` (two images in a row: two blocks), Gemma 4
    16 per image of 8 x 8 patches (``mm_token_type_ids``); Llama 4 4 per 56 x 56 image (pixel-shuffled 2 x 2);
    PaliGemma 4 per 28 x 28 image, the images first in each row, then the prompt (the prefix: ``token_type_ids`` 0,
    14 and 16 tokens), then the suffix (1), the only tokens with labels."""
    ids = torch.randint(3, VOCAB, (2, seq_len), generator=g)
    types = torch.zeros_like(ids)
    qwen_like = (
        "paddleocr_vl",
        "cosmos3_omni",
        "cosmos3_edge",
        "ernie4_5_vl_moe",
        "cohere_compass",
        "hyperclovax_vision_v2",
        "muse_spark",
        "muse_glimmer",
        "dots3_note",
        "glm5_next",
        "llava_onevision1_5",
        "ovis2_5",
    )
    qwen = (
        family.startswith(("qwen", "glm4v", "glm46v", "glmga", "glm_ocr")) or family in qwen_like
    )  # (Qwen-VL's layout)
    gemma = ("gemma3", "gemma4", "gemma4_unified")
    per_image = 4 if qwen or family in _FOUR_TOKENS else GEMMA3_IMAGE_TOKENS if family in gemma else 1
    if family == "hunyuan_vl":  # 2 x 2 merged patches, a newline per row, begin and end
        per_image = HUNYUAN_VL_IMAGE_TOKENS
    if family == "hy_v4_vl":  # 2 x 2 merged patches, a newline per row
        per_image = 6
    if family == "emu3":  # 2 x 2 codes, an end of line after each row
        per_image = 6
    if family in ("chameleon", "fuyu"):  # 2 x 2 codes; 4 patches
        per_image = 4
    spots = _IMAGE_SPOTS if kind != "video" else _IMAGE_SPOTS[:1]
    if family in gemma:  # longer images: two in row 0 still inside 40 tokens
        spots = ((0, 3), (0, 21), (1, 17))
    if family.startswith("paligemma"):  # images at the start (row 1 after the padding of "images-padded")
        spots = ((0, 0), (0, 4), (1, 6))
    tiled = family.startswith("llava_next") or family == "granite4_vision"
    tokens = (10, 14, 10)[: len(spots)] if tiled else (per_image,) * len(spots)
    if family == "llava_onevision":  # row 0's two images untiled (batch_num_images): 2 x 2 + a newline each
        tokens = (10,) if kind == "video" else (5, 5, 14)
    for (b, p), n in zip(spots, tokens):
        ids[b, p : p + n] = MEDIA_TOKENS["image_token_id"]
        types[b, p : p + n] = 1
    extra = {}
    if qwen:
        patch = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch
        extra["pixel_values"] = torch.randn(16 * len(spots), patch, generator=g)
        extra["image_grid_thw"] = torch.tensor([[1, 4, 4]] * len(spots))
        if kind == "video":  # 2 temporal patches of 4 x 4: 8 tokens
            ids[1, 17:25] = MEDIA_TOKENS["video_token_id"]
            types[1, 17:25] = 2
            spots = (*spots, (1, 17))
            extra["pixel_values_videos"] = torch.randn(32, patch, generator=g)
            extra["video_grid_thw"] = torch.tensor([[2, 4, 4]])
            if family in OMNI_AUDIO:  # the seconds each temporal patch spans (its processor's, from the fps)
                extra["video_second_per_grid"] = torch.tensor([1.0])
        if family in ("dots3_note", "llava_onevision1_5", "ovis2_5"):  # each patch 3 x 14 x 14 flat (no temporal one)
            extra["pixel_values"] = torch.randn(16 * len(spots), 3 * 14 * 14, generator=g)
        if family == "paddleocr_vl":  # each patch 3 x 14 x 14 (no temporal patch)
            extra["pixel_values"] = torch.randn(16 * len(spots), 3, 14, 14, generator=g)
        if family == "ernie4_5_vl_moe":  # each patch 3 x 14 x 14 flat
            extra["pixel_values"] = torch.randn(16 * len(spots), 3 * 14 * 14, generator=g)
        if family == "cosmos3_edge":  # each patch 3 x 16 x 16 flat
            extra["pixel_values"] = torch.randn(16 * len(spots), 3 * 16 * 16, generator=g)
        if family not in (
            *OMNI_AUDIO,
            "hyperclovax_vision_v2",
            "muse_spark",
            "muse_glimmer",
            "dots3_note",
            "glm5_next",
            "llava_onevision1_5",
            "ovis2_5",
        ):  # (no token types from
            # their processors)
            extra["mm_token_type_ids"] = types
        for b, p in spots:
            ids[b, p - 1] = MEDIA_TOKENS["vision_start_token_id"]
            ids[b, p + (8 if b == 1 and kind == "video" else per_image)] = MEDIA_TOKENS["vision_end_token_id"]
        if family == "ernie4_5_vl_moe":  # its vision experts take the images' start and end tokens too
            ends = torch.tensor([MEDIA_TOKENS["vision_start_token_id"], MEDIA_TOKENS["vision_end_token_id"]])
            extra["moe_mm_token_type_ids"] = ((types != 0) | torch.isin(ids, ends)).long()
    elif family in ("exaone4_5", "minimax_m3_vl"):  # as Qwen2.5-VL's: 4 x 4 patches of 2 x 14 x 14 x 3, merged 2 x 2
        extra["pixel_values"] = torch.randn(16 * len(spots), 3 * 2 * 14 * 14, generator=g)
        extra["image_grid_thw"] = torch.tensor([[1, 4, 4]] * len(spots))
    elif family == "granite_docling":  # a tile of 32 x 32 per image: row 0's two, row 1's one and a padding tile
        extra["pixel_values"] = torch.randn(2, 2, 3, 32, 32, generator=g)
        extra["pixel_attention_mask"] = torch.tensor([[True, True], [True, False]])
    elif family in ("hunyuan_vl", "hy_v4_vl"):  # 4 x 4 patches of 16 x 16 x 3 (one temporal patch); token types 1
        extra["pixel_values"] = torch.randn(16 * len(spots), 3 * 16 * 16, generator=g)
        extra["image_grid_thw"] = torch.tensor([[1, 4, 4]] * len(spots))
        extra["mm_token_type_ids"] = types
    elif family == "lfm3_vl":  # 4 x 4 patches of 2 x 16 x 16 x 3, merged 2 x 2: 4 tokens
        extra["pixel_values"] = torch.randn(16 * len(spots), 3 * 2 * 16 * 16, generator=g)
        extra["image_grid_thw"] = torch.tensor([[1, 4, 4]] * len(spots))
    elif family == "apertus1p5":  # images of 4 x 4 pixels (their sizes), 2 x 2 codes each
        extra["pixel_values"] = torch.randn(len(spots), 3, 4, 4, generator=g)
        extra["image_sizes"] = torch.tensor([[4, 4]] * len(spots))
    elif family == "kimi_k25":  # patches of 3 x 14 x 14 on a 4 x 4 grid per image, merged 2 x 2: 4 tokens
        extra["pixel_values"] = torch.randn(16 * len(spots), 3, 14, 14, generator=g)
        extra["image_grid_thw"] = torch.tensor([[1, 4, 4]] * len(spots))
    elif family in ("idefics2", "idefics3", "smolvlm"):  # [batch, images per row, 3, h, w]; all-zero: padding
        extra["pixel_values"] = torch.randn(2, 2, 3, 28, 28, generator=g)
        extra["pixel_values"][1, 1] = 0
        if family == "idefics2":  # (as its processor gives it: the real pixels of each image, none of a padding one)
            extra["pixel_attention_mask"] = extra["pixel_values"][:, :, 0] != 0
    elif family in ("llava_next", "llava_next_video"):  # [images, base + up to 2 tiles, 3, h, w] (unused tiles
        # padded), their sizes
        extra["pixel_values"] = torch.randn(len(spots), 3, 3, 28, 28, generator=g)
        extra["image_sizes"] = torch.tensor([[28, 28], [28, 56], [28, 28]][: len(spots)])
        if kind == "video":  # row 1: 4 frames, each's 2 x 2 features pooled to 1 token (LLaVA-NeXT-Video)
            ids[1, 17:21] = MEDIA_TOKENS["video_token_id"]
            extra["pixel_values_videos"] = torch.randn(1, 4, 3, 28, 28, generator=g)
    elif family == "granite4_vision":  # as LLaVA-NeXT's, tiles of 56 x 56 (each 2 x 2 tokens after its Q-Formers)
        extra["pixel_values"] = torch.randn(len(spots), 3, 3, 56, 56, generator=g)
        extra["image_sizes"] = torch.tensor([[56, 56], [56, 112], [56, 56]][: len(spots)])
    elif family == "ovis2":  # a 28 x 28 image, its 2 x 2 patches in one token, between indicator tokens
        extra["pixel_values"] = torch.randn(len(spots), 3, 28, 28, generator=g)
        for b, p in spots:
            ids[b, p - 1] = MEDIA_TOKENS["vision_start_token_id"]
            ids[b, p + per_image] = MEDIA_TOKENS["vision_end_token_id"]
    elif family == "got_ocr2":  # a SAM tower: 8 x 8 patches, two stride-2 convolutions: 2 x 2 tokens
        extra["pixel_values"] = torch.randn(len(spots), 3, 64, 64, generator=g)
    elif family == "llava_onevision":  # as LLaVA-NeXT's; a row with several images has them untiled
        extra["pixel_values"] = torch.randn(len(spots), 3, 3, 28, 28, generator=g)
        extra["image_sizes"] = torch.tensor([[28, 28], [28, 28], [28, 56]][: len(spots)])
        extra["batch_num_images"] = torch.tensor([2, 1] if kind != "video" else [1, 0])
        if kind == "video":  # row 1: 4 frames, each pooled to 1 x 1, and a newline: 5 tokens
            ids[1, 17:22] = MEDIA_TOKENS["video_token_id"]
            extra["pixel_values_videos"] = torch.randn(1, 4, 3, 28, 28, generator=g)
    elif family == "perception_lm":  # [images, tiles, 3, h, w], one 56 x 56 tile each; a video's frames as tiles
        extra["pixel_values"] = torch.randn(len(spots), 1, 3, 56, 56, generator=g)
        if kind == "video":  # 2 frames: 8 tokens
            ids[1, 17:25] = MEDIA_TOKENS["video_token_id"]
            extra["pixel_values_videos"] = torch.randn(1, 2, 3, 56, 56, generator=g)
    elif family == "video_llava":  # images under its processor's name for them; 2 frames of 4 patches and CLS each
        extra["pixel_values_images"] = torch.randn(len(spots), 3, 28, 28, generator=g)
        if kind == "video":
            ids[1, 17:27] = MEDIA_TOKENS["video_token_id"]
            extra["pixel_values_videos"] = torch.randn(1, 2, 3, 28, 28, generator=g)
    elif family in ("gemma3", "llama4"):
        extra["pixel_values"] = torch.randn(len(spots), 3, 56, 56, generator=g)
        if family == "gemma3":
            extra["token_type_ids"] = types
    elif family == "lfm2_vl":  # 4 x 4 patches of 16 x 16 x 3 (NaFlex, their mask and grid), unshuffled 2 x 2: 4 tokens
        extra["pixel_values"] = torch.randn(len(spots), 16, 3 * 16 * 16, generator=g)
        extra["pixel_attention_mask"] = torch.ones(len(spots), 16, dtype=torch.bool)
        extra["spatial_shapes"] = torch.tensor([[4, 4]] * len(spots))
    elif family.startswith("paligemma"):  # images first, then the prompt: the prefix (token type 0); the suffix 1
        extra["pixel_values"] = torch.randn(len(spots), 3, 28, 28, generator=g)
        extra["token_type_ids"] = types
    elif family == "video_llama_3":  # 4 x 4 patches of 14 x 14 x 3 per image, merged 2 x 2 (bilinear): 4 tokens
        patch = 3 * 14 * 14
        extra["pixel_values"] = torch.randn(16 * len(spots), patch, generator=g)
        extra["image_grid_thw"] = torch.tensor([[1, 4, 4]] * len(spots))
        extra["image_merge_sizes"] = torch.tensor([2] * len(spots))
        if kind == "video":  # 2 frames of 4 x 4 patches, merged 2 x 2: 8 tokens
            ids[1, 17:25] = MEDIA_TOKENS["video_token_id"]
            extra["pixel_values_videos"] = torch.randn(32, patch, generator=g)
            extra["video_grid_thw"] = torch.tensor([[2, 4, 4]])
            extra["video_merge_sizes"] = torch.tensor([2])
    elif family == "fuyu":  # 4 patches of 2 x 2 pixels x 3 channels per image, all the batch's images in one tensor,
        # under the name its processor gives them by default (its model's pixel_values from Transformers 5.23 on)
        extra["image_patches"] = torch.randn(4 * len(spots), 12, generator=g)
    elif family == "chameleon":  # images of 4 x 4 pixels
        extra["pixel_values"] = torch.randn(len(spots), 3, 4, 4, generator=g)
    elif family == "emu3":  # images of 4 x 4 pixels (their sizes)
        extra["pixel_values"] = torch.randn(len(spots), 3, 4, 4, generator=g)
        extra["image_sizes"] = torch.tensor([[4, 4]] * len(spots))
    elif family == "molmo2":  # one crop of 2 x 2 patches of 14 x 14 x 3 per image, 2 x 2 tokens (image_grids), each
        # pooling two of its patches (image_token_pooling: indices into all crops' patches); the image tokens type 1
        # (from Transformers 5.25 the indices are each image's own, placed by image_num_crops: the same pooling)
        extra["pixel_values"] = torch.randn(len(spots), 4, 3 * 14 * 14, generator=g)
        index = torch.arange(4 * len(spots)).view(-1, 4)
        if _takes_num_crops():
            index = index % 4
            extra["image_num_crops"] = torch.ones(len(spots), dtype=torch.long)
        extra["image_token_pooling"] = torch.stack([index, index.roll(-1, 1)], -1).view(-1, 2)
        extra["image_grids"] = torch.tensor([[2, 2, 0, 0]] * len(spots))
        extra["mm_token_type_ids"] = types
    elif family == "deepseek_vl_hybrid":  # each image at two resolutions: SigLIP's, SAM's
        extra["pixel_values"] = torch.randn(len(spots), 3, 28, 28, generator=g)
        extra["high_res_pixel_values"] = torch.randn(len(spots), 3, 64, 64, generator=g)
    elif family in (
        "minicpmv4_6",
        "minicpmv4_7",
        "minicpm_ocr",
    ):  # NaViT-packed: every image's 8 x 8 patches of 14 x 14 side by side
        # in one row, merged 2 x 2 twice (the window merger, the merger): 4 tokens each
        extra["pixel_values"] = torch.randn(1, 3, 14, 14 * 64 * len(spots), generator=g)
        extra["target_sizes"] = torch.tensor([[8, 8]] * len(spots))
        if family == "minicpmv4_7":  # its token types place the images on its canvas of multimodal positions
            extra["mm_token_type_ids"] = types
    elif family == "mllama":  # [batch, images, tiles, 3, h, w]: row 0 an image of 2 tiles (aspect ratio 1 x 2), one
        # of 1; row 1 one of 1 and a padding image; each token sees the images from its <|image|> token to the next
        extra["pixel_values"] = torch.randn(2, 2, 2, 3, 28, 28, generator=g)
        extra["aspect_ratio_ids"] = torch.tensor([[2, 1], [1, 0]])
        tiles = torch.tensor([[[1, 1], [1, 0]], [[1, 0], [0, 0]]])
        extra["aspect_ratio_mask"] = tiles
        cross = torch.zeros(2, seq_len, 2, 2, dtype=torch.long)
        for row, starts in ((0, (spots[0][1], spots[1][1], seq_len)), (1, (spots[2][1], seq_len))):
            for image, (a, z) in enumerate(zip(starts[:-1], starts[1:])):
                cross[row, a:z, image] = tiles[row, image]
        extra["cross_attention_mask"] = cross
    elif family == "gemma4":  # patches of 14 x 14 x 3 on an 8 x 8 grid with their (x, y), pooled 2 x 2: 16 tokens
        extra["pixel_values"] = torch.rand(len(spots), 64, 3 * 14 * 14, generator=g)
        grid = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="xy"), -1).view(64, 2)
        extra["image_position_ids"] = grid.expand(len(spots), -1, -1).clone()
        extra["mm_token_type_ids"] = types
    elif family == "gemma4_unified":  # 4 x 4 patches of 8 x 8 x 3 with their (x, y), 4 padding patches (-1, -1)
        # after them as its processor pads to the longest image: 16 tokens
        extra["pixel_values"] = torch.rand(len(spots), 20, 3 * 8 * 8, generator=g)
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).view(16, 2)
        grid = torch.cat([grid, torch.full((4, 2), -1)])
        extra["image_position_ids"] = grid.expand(len(spots), -1, -1).clone()
        extra["mm_token_type_ids"] = types
    else:
        extra["pixel_values"] = torch.randn(len(spots), 3, 28, 28, generator=g)
        if family in ("mistral3", "mistral_large4", "lighton_ocr"):
            extra["image_sizes"] = torch.tensor([[28, 28]] * len(spots))
        if family == "aria":  # its processor's mask of each image's real pixels (all of them here)
            extra["pixel_mask"] = torch.ones(len(spots), 28, 28, dtype=torch.bool)
    if family.startswith("paligemma"):  # a prompt after the images; the rest, the suffix, is type 1 and learned
        types[:] = 1
        types[0, :14] = 0
        types[1, :16] = 0  # (its first 6 tokens: padding in "images-padded", of type 0 as the tokenizer pads)
    labels, mask = _labels_and_padding(ids, 6 if kind == "images-padded" else 0)
    if family.startswith("paligemma"):  # the processor's labels: the suffix only
        labels[types == 0] = -100
    batch = {"input_ids": ids, "labels": labels, **extra}
    # the Omni thinkers number multimodal positions only given an attention_mask (their processors always give one;
    # without it they number the tokens as text, and shard_batch adds one wherever it pads)
    if kind == "images-padded" or family in OMNI_AUDIO:
        batch["attention_mask"] = mask
    return batch


def _qwen2_audio_clips(g: torch.Generator) -> dict:
    """Three clips of 16 mel bins x 32 frames (the tower's fixed length: ``max_source_positions`` x 2), the second
    of 24 real frames (``feature_attention_mask``): 8, 6 and 8 tokens (two stride-2 stages: (n - 1) // 2 + 1, then
    (n - 2) // 2 + 1)."""
    frames = torch.ones(3, 32, dtype=torch.long)
    frames[1, 24:] = 0
    return {"input_features": torch.randn(3, 16, 32, generator=g), "feature_attention_mask": frames}


def _voxtral_clips(g: torch.Generator) -> dict:
    """Three clips of 16 mel bins x 32 frames (every clip padded to the tower's length, none masked): 8 tokens each
    (the 16 frames after the stride-2 convolution, 2 frames' features per token)."""
    return {"input_features": torch.randn(3, 16, 32, generator=g)}


def _moss_clips(g: torch.Generator) -> dict:
    """Three clips of 16 mel bins x 32 frames, the second of 24 real frames (``input_features_mask`` per frame): 8, 6
    and 8 tokens (the valid frames after the stride-2 convolution, 2 per token); the raw audio's ``padding_mask``
    (which the model takes unused)."""
    frames = torch.ones(3, 32, dtype=torch.long)
    frames[1, 24:] = 0
    return {"input_features": torch.randn(3, 16, 32, generator=g), "input_features_mask": frames,
            "padding_mask": torch.ones(3, 64, dtype=torch.long)}  # fmt: skip


def _granite_speech_clips(g: torch.Generator) -> dict:
    """Three clips of 16 frames x 16 features: 8 tokens each (4 windows of 4 frames, 2 queries per window), the
    second's last 2 dropped (``input_features_mask`` per token, as its processor marks a shorter clip): 8, 6, 8."""
    tokens = torch.ones(3, 8, dtype=torch.bool)
    tokens[1, 6:] = False
    return {"input_features": torch.randn(3, 16, 16, generator=g), "input_features_mask": tokens}


def _nemotron_h_omni_clips(g: torch.Generator) -> dict:
    """Three clips of 32 frames x 16 mel bins, the second of 24 real frames (``input_features_mask`` per frame): 8,
    7 and 8 tokens (its wrapper keeps a padded clip's first (n + 1) subsampled twice: 7 of 24 frames)."""
    frames = torch.ones(3, 32, dtype=torch.long)
    frames[1, 24:] = 0
    return {"input_features": torch.randn(3, 32, 16, generator=g), "input_features_mask": frames}


def _gemma4_unified_clips(g: torch.Generator) -> dict:
    """Three clips of 10 frames x 16 features, padded frames marked in ``input_features_mask`` (the first and last 8
    real frames, the second 6): 8, 6 and 8 tokens (one per real frame, Gemma 4 Unified's projection)."""
    frames = torch.zeros(3, 10, dtype=torch.bool)
    frames[:, :8] = True
    frames[1, 6:] = False
    return {"input_features": torch.randn(3, 10, 16, generator=g), "input_features_mask": frames}


def _muse_spark_clips(g: torch.Generator) -> dict:
    """Three waveforms of 128 samples (16 per token through its convolutions of strides 2, 2, 2, 2), the second of
    96 real samples (``input_values_mask``, right-padded as its feature extractor pads): 8, 6 and 8 tokens."""
    samples = torch.ones(3, 128, dtype=torch.long)
    samples[1, 96:] = 0
    return {"input_values": torch.randn(3, 128, generator=g), "input_values_mask": samples}


def _dots3_note_clips(g: torch.Generator) -> dict:
    """Three chunks of 64 frames x 16 mel bins (160 samples per frame, three stride-2 convolutions: 8 frames per
    token), the second of 7680 real samples (``chunk_sample_lengths``): 8, 6 and 8 tokens."""
    return {"input_features": torch.randn(3, 16, 64, generator=g),
            "chunk_sample_lengths": torch.tensor([10240, 7680, 10240])}  # fmt: skip


def _gemma3n_clips(g: torch.Generator) -> dict:
    """Three clips of 32 frames x 16 mel bins, the second of 24 real frames (``input_features_mask``): 8, 6 and 8
    audio tokens, each clip's padded by the model to its 8 placeholders."""
    frames = torch.ones(3, 32, dtype=torch.bool)
    frames[1, 24:] = False
    return {"input_features": torch.randn(3, 32, 16, generator=g), "input_features_mask": frames}


AUDIO_CLIPS = {"qwen2_audio": _qwen2_audio_clips, "voxtral": _voxtral_clips, "moss_transcribe_diarize": _moss_clips,
               "granite_speech": _granite_speech_clips,
               "granite_speech_plus": _granite_speech_clips, "nemotron_h_omni": _nemotron_h_omni_clips,
               "gemma4_unified-audio": _gemma4_unified_clips, "muse_spark": _muse_spark_clips,
               "dots3_note": _dots3_note_clips, "gemma3n": _gemma3n_clips}  # fmt: skip
"""Audio-language families: their clips in an "audio" batch (the others: Gemma 4's)."""
AUDIO_TOKENS = {"qwen2_audio": (8, 6, 8), "voxtral": (8, 8, 8), "moss_transcribe_diarize": (8, 6, 8),
                "granite_speech": (8, 6, 8),
                "granite_speech_plus": (8, 6, 8), "nemotron_h_omni": (8, 7, 8), "gemma4_unified-audio": (8, 6, 8),
                "muse_spark": (8, 6, 8), "dots3_note": (8, 6, 8)}  # fmt: skip
"""The audio tokens of each clip of ``AUDIO_CLIPS``, at ``_IMAGE_SPOTS``."""


def _labels_and_padding(ids: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, attention_mask)`` of a two-row batch with media: media tokens (ids >= VOCAB) and each row's first
    3 tokens ignored, row 1 left-padded by ``pad`` tokens (their ids set to PAD_ID in place). The last pad would
    predict the first token: shard_batch ignores a prediction made at padding, so that label is ignored too."""
    labels = ids.masked_fill(ids >= VOCAB, -100)
    labels[:, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[mask == 0] = PAD_ID
    labels[1, : pad + 1] = -100
    return labels, mask


def make_batch(kind: str, seq_len: int, *, seed: int = 1, family: str | None = None) -> tuple[dict, dict]:
    """``(batch for shard_batch, batch for the unmodified model)``; they differ only for padded batches. Kinds
    "images", "images-padded" and "video" are a vision-language ``family``'s (its model made with ``images=True``)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "audio":  # row 1 left-padded by 3
        ids = torch.randint(3, VOCAB, (2, seq_len), generator=g)
        apertus = family == "apertus1p5"  # waveforms of 64 and 48 samples (right-padded): 16 and 12 codes
        spans = ((0, 5, 16), (1, 9, 12)) if apertus else [(b, p, 8) for b, p in _IMAGE_SPOTS]  # Gemma 4: 32 frames
        if family in AUDIO_TOKENS:  # clip 1 shorter (its frames masked) where the family masks frames
            spans = [(b, p, n) for (b, p), n in zip(_IMAGE_SPOTS, AUDIO_TOKENS[family])]
        if family in OMNI_AUDIO:  # the last clip shorter (its feature_attention_mask, OMNI_FRAMES): 6 tokens
            spans[-1] = (*_IMAGE_SPOTS[-1], 6)
        for b, p, n in spans:
            ids[b, p : p + n] = GEMMA3N_AUDIO_TOKEN if family == "gemma3n" else AUDIO_TOKEN
        labels, mask = _labels_and_padding(ids, 3)
        if apertus:
            samples = torch.ones(2, 64, dtype=torch.long)
            samples[1, 48:] = 0
            media = {"input_values": torch.randn(2, 1, 64, generator=g), "padding_mask": samples}
        elif family in AUDIO_CLIPS:  # the family's clips (mel frames first or last, their masks)
            media = AUDIO_CLIPS[family](g)
        elif family in OMNI_AUDIO:  # three clips of 16 mel bins (the last shorter), as its feature extractor gives them
            (frames, short), clips = OMNI_FRAMES[family], len(_IMAGE_SPOTS)
            media = {"input_features": torch.randn(clips, OMNI_AUDIO[family]["num_mel_bins"], frames, generator=g),
                     "feature_attention_mask": torch.ones(clips, frames, dtype=torch.long)}  # fmt: skip
            media["feature_attention_mask"][-1, short:] = 0
        else:  # three clips of 32 frames of 128 mel bins (Gemma 4)
            clips = len(_IMAGE_SPOTS)
            media = {"input_features": torch.randn(clips, 32, 128, generator=g),
                     "input_features_mask": torch.ones(clips, 32, dtype=torch.bool)}  # fmt: skip
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, **media}
        return batch, batch
    if kind in ("images", "images-padded", "video"):
        batch = _media_batch(kind, seq_len, family, g)
        return batch, batch
    if kind == "plain":  # two rows, some ignored labels
        ids = torch.randint(1, VOCAB, (2, seq_len), generator=g)
        labels = ids.clone()
        labels[torch.rand(2, seq_len, generator=g) < 0.3] = -100
        labels[:, :3] = -100
        batch = {"input_ids": ids, "labels": labels}
        return batch, batch
    if kind == "packed":  # DataCollatorWithFlattening: 3 documents of unequal lengths in one row
        from transformers import DataCollatorWithFlattening

        cuts = [0, seq_len // 4, seq_len // 4 + seq_len // 2 - 1, seq_len]
        ids = torch.randint(1, VOCAB, (seq_len,), generator=g)
        feats = [{"input_ids": ids[a:b].tolist()} for a, b in zip(cuts[:-1], cuts[1:])]
        batch = DataCollatorWithFlattening(return_tensors="pt")(feats)
        return dict(batch), dict(batch)
    if kind == "padded":  # row 1 right-padded, row 2 left-padded; our labels even keep the pad ids
        ids = torch.randint(1, VOCAB, (3, seq_len), generator=g)
        mask = torch.ones(3, seq_len, dtype=torch.long)
        mask[1, seq_len - 11 :] = 0
        mask[2, :7] = 0
        ids[mask == 0] = PAD_ID
        ref_labels = ids.masked_fill(mask == 0, -100)
        # the unmodified model would also score the last left pad predicting the first real token;
        # shard_batch ignores a prediction made at a padding position, so the reference drops it too
        ref_labels[2, 7] = -100
        ours = {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}
        return ours, {"input_ids": ids, "labels": ref_labels, "attention_mask": mask}
    raise ValueError(kind)


def prepare(family, opts, dtype=None, images: bool = False):
    dtype = dtype or opts.get("dtype", torch.float32)
    model = make_model(family, dtype=dtype, images=images, **opts.get("config", {}))
    if opts.get("random_biases"):  # (zero at initialisation: padding would change nothing a mixer computes)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") and p.dim() == 1 and "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    if opts.get("pad_embedding"):  # (zero at initialisation: padding would carry nothing into a mixer)
        with torch.no_grad():
            row = model.get_input_embeddings().weight[PAD_ID]
            row.copy_(torch.randn(row.shape, generator=torch.Generator().manual_seed(6)).to(row.dtype))
    if opts.get("lora"):
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: random B as well as A, so that every LoRA gradient is non-zero; the attention's
        # projections, or the modules a case names
        targets = opts["lora"] if isinstance(opts["lora"], list) else ["q_proj", "k_proj", "v_proj", "o_proj"]
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
        model = get_peft_model(model, lora)
    if opts.get("checkpointing"):  # reentrant with LoRA (the usual PEFT setup), Transformers' default otherwise
        kwargs = {"use_reentrant": True} if opts.get("lora") else None
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if opts.get("lora"):
            model.enable_input_require_grads()
    model.train(not opts.get("eval"))  # eval: a family whose training-mode routing samples (Phi-3.5-MoE)
    return model


def grads(model) -> dict:
    from hf_ring.engines import outside_text_model, without_gradient

    # zeros for a vision-language model's vision tower (a text-only batch cannot reach it), for DeepSeek sparse
    # attention's indexers (Transformers runs them without gradients) and Chameleon's VQ-VAE (discrete codes);
    # elsewhere every trainable parameter must have a gradient
    unreached = set(outside_text_model(model)) | set(without_gradient(model))
    unreached |= {n for n, _ in model.named_parameters() if ".indexer." in n}
    cross = getattr(model.config.get_text_config(), "cross_attention_layers", None) or ()  # (Mllama: text-only
    # batches skip its cross-attention layers)
    unreached |= {n for n, _ in model.named_parameters() if any(f".layers.{i}." in n for i in cross)}
    # Phi-4-multimodal's image and audio embedding lies inside its text model (the top model), which
    # outside_text_model takes as reached whole
    unreached |= {n for n, _ in model.named_parameters() if ".embed_tokens_extend." in n}
    return {
        n: torch.zeros_like(p) if n in unreached and p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def error_of(fn) -> str:
    """The message of the ValueError ``fn()`` raises, or "no error" (the refusal tests assert on it, on every rank)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def one_document(model, batch: dict) -> dict:
    """``batch`` as the unmodified model reads it as one document per row. Transformers 5.17's Cosmos3 Edge, given no
    attention mask and no cache (``use_cache=False``, as under gradient checkpointing), builds its mask from the
    temporal axis of its multimodal positions, and reads their jumps at an image as the starts of packed documents
    (text after an image cannot see the text before it); with a cache, or an attention mask, or on 5.24 (which reads
    packing only from packed positions), it sees one document. There it gets an all-ones mask."""
    if model.config.model_type != "cosmos3_edge" or transformers_at_least("5.24") or "attention_mask" in batch:
        return batch
    return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}


def reference_step(model, batch, whole: bool = False):
    """Loss and gradients of the unmodified model; a packed batch as every document on its own (gpt-oss's
    eager attention, for one, does not see packing in position_ids), or with ``whole`` as one packed row (Llama 4
    scales a query by its token's index in the row, so each document alone is not what the model computes)."""
    model.zero_grad(set_to_none=True)
    pos = batch.get("position_ids")
    if pos is None or whole:
        loss = model(**one_document(model, batch), use_cache=False).loss
    else:  # the collator's labels start every document with -100: no target crosses a boundary
        starts = (pos[0] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
        total, count = 0.0, 0
        for a, e in zip(starts[:-1], starts[1:]):
            labels = batch["labels"][:, a:e]
            n = int((labels[:, 1:] != -100).sum())
            if n:
                total = total + n * model(input_ids=batch["input_ids"][:, a:e], labels=labels, use_cache=False).loss
                count += n
        loss = total / count
    loss.backward()
    return loss.detach().float(), {n: g.float() for n, g in grads(model).items()}


def per_document_step(model, batch):
    """Loss and gradients of a packed one-row batch (``make_batch("packed", ...)``) as the model gives them for
    each document alone: what keeping packed documents apart means in every layer (a hybrid's recurrence too)."""
    model.zero_grad(set_to_none=True)
    ids, labels, pos = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
    targets = sum(int((labels[a + 1 : b] != -100).sum()) for a, b in zip(starts[:-1], starts[1:]))
    total = 0.0
    for a, b in zip(starts[:-1], starts[1:]):
        loss = model(input_ids=ids[None, a:b], labels=labels[None, a:b], num_items_in_batch=targets).loss
        loss.backward()
        total = total + loss.detach()
    return total, grads(model)


def ring_step(model, batch, layout, ulysses_size=None):
    import torch.distributed as dist

    import hf_ring

    hf_ring.apply_ring_attention(model, layout=layout, ulysses_size=ulysses_size)
    if ulysses_size is not None:  # the hybrid really runs: U > 1 on every attention module
        configs = [m.hf_ring_config for m in model.modules() if hasattr(m, "hf_ring_config")]
        assert configs and all(c.ulysses is not None and c.ulysses.ulysses_size > 1 for c in configs)
    try:
        model.zero_grad(set_to_none=True)
        local = hf_ring.shard_batch(batch, layout=layout, chunk_multiple=hf_ring.chunk_multiple(model))
        loss = model(**local).loss
        loss.backward()
        total = hf_ring.reduce_loss(loss).float()
        mine = grads(model)
        names = list(mine)
        flat = torch.cat([mine[n].float().flatten() for n in names])
        dist.all_reduce(flat)
        summed, i = {}, 0
        for n in names:
            summed[n] = flat[i : i + mine[n].numel()].view_as(mine[n])
            i += mine[n].numel()
        return total, summed
    finally:
        hf_ring.revert_ring_attention(model)


DECAY_PARAMS = (
    "linear_attn.A_log",
    "linear_attn.dt_bias",
    "linear_attn.in_proj_a.weight",
    "mamba_decoder.mamba.A_log",
    "self_attn.lambda_q1",
    "self_attn.lambda_k1",
    "self_attn.lambda_q2",
    "self_attn.lambda_k2",
    "self_attn.qk_norm.temp",
    "self_attn.forget_gate.A_log",
    "hc.scale",
)
"""The Gated DeltaNet's decay parameters and the projections that feed the decay: their gradients are sums over
every token of terms that nearly cancel (norm 1e-4 for A_log in the tiny models), so any reordering of the
recurrence moves them far more than the others: Transformers' own kernel, its chunk size alone changed from 64 to
8, moves A_log's by 4e-5 and in_proj_a's by 6e-6. Zamba2's Mamba2 layers after its shared attention block: A_log's
gradient is 6e-10 there (its step sizes start at 0.001 to 0.1), beside 1e-2 for D, and moves by 7e-15 absolute
(1.2e-5 relative) at one rank, where only the padding added for the layout differs. DiffLlama's lambdas (the
weight of its second attention map): sums over every query of differences of two attentions, norm 6e-5 beside 1.5
for the largest, moved by 2e-9 absolute (2.7e-5 relative; 6.6e-5 at one rank, where the reference's SDPA sums in
another order). ZAYA's key scale (``qk_norm.temp``, one per key/value head): a sum over every query and key of
score gradients, which Transformers' own SDPA and eager attention give 1.7e-5 apart (fp32, a padded batch; the
ring measured up to 3.5e-5). Bailing hybrid's forget gate (``forget_gate.A_log``, the decay of its linear attention
layers): norm 5e-4 beside 1.1 for the largest, moved by 1.5e-5 relative by the chunked loss alone on an AMD EPYC
host (the same with the head run as a module or as one function), under 1e-5 on others. DeepSeek-V4's and HunYuan
V4's hyper-connection scales (``attn_hc.scale``, ``ffn_hc.scale``): sums over every token that nearly cancel (one
of three is 4e-10, beside 3e-4 for the others), moved by 1.04e-5 by the chunked loss alone on that host. Their
error is reported apart (``decay``)."""


RTOL_DECAY = 1e-3
"""fp32 bound on those gradients: the ring's reordering measured up to 2.2e-4 (2 and 4 ranks), the chunked loss's
6.5e-5 (one rank), against the 4e-5 of Transformers' own kernel at another chunk size."""


def grad_error(name: str, grad, ref, top: float) -> float:
    """``grad``'s relative error against ``ref``. A key bias before a softmax without RoPE (OPT's, a vision tower's, a
    Q-Former's attention.key.bias) has a gradient of zero but for rounding (the softmax does not see it; 7e-13 in
    Idefics3's), and HunYuan V4's hyper-connection scales one near it (2e-8 of the largest in its tiny model,
    measured), and so has a bias before a training-mode BatchNorm, which subtracts it again (Parakeet's
    depthwise_conv.bias: 8e-8 of the largest in Nemotron 3 Nano Omni's tiny audio tower): those are compared on the
    scale of ``top``, the largest gradient."""
    if (
        name.endswith(("k_proj.bias", "attention.key.bias", "hc.scale", "depthwise_conv.bias"))
        and float(ref.double().norm()) < 1e-6 * top
    ):
        return float((grad.double() - ref.double()).norm()) / max(top, 1e-30)
    return rel(grad, ref)


def errors(loss, grads, ref_loss, ref_grads) -> dict:
    names = [n for n in ref_grads if not n.endswith(DECAY_PARAMS)]
    decay = [n for n in ref_grads if n.endswith(DECAY_PARAMS)]
    top = max(float(g.double().norm()) for g in ref_grads.values())

    def err(n):
        return grad_error(n, grads[n], ref_grads[n], top)

    worst = max(names, key=err)
    return {
        "loss": rel(loss, ref_loss),
        "grad": err(worst),
        "worst": worst,
        "decay": max((rel(grads[n], ref_grads[n]) for n in decay), default=0.0),
        "n_grads": len(ref_grads),
    }
