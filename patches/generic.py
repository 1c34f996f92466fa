"""Families whose attention needs nothing beyond what hf_ring implements: one generic patch for all of them.

Each listed family calls Transformers' attention interface with query/key/value after its own
projections, norms and rotary embedding, with its ``scaling``, per layer its ``sliding_window`` (from
``config.layer_types`` or ``config.sliding_window``), and the attention features the attention
function implements: logit softcapping (``softcap``: Gemma2, VaultGemma, optionally Gemma3) and learned
sinks (``s_aux``: gpt-oss, Granite-SWA, Flint). What else is special about these families happens outside the attention
function, on local tokens, and so is exact under context parallelism as it is: QK norm (OLMo2,
Gemma3, Cohere, StableLM, Phi, Exaone4/Exaone-MoE, HunYuan, Apertus, FlexOlmo, MiniMax-M2, AFMoE),
clipped projections (OLMo), partial or
interleaved rotary embeddings (GLM, Phi, StableLM, Nemotron, GPT-NeoX), layers without RoPE
(SmolLM3), learned absolute positions (GPT-2, StarCoder 1: from the global ``position_ids``), layers looped over
recurrently (Dory: each loop's attention call is a ring call of its own), a mixture of attention heads
(JetMoE), differential attention (DiffLlama: two maps through
the ring, combined after it), an attention multiplier (Granite, passed as ``scaling``), logit scales and final logit
softcapping (Granite, Cohere, Gemma2), parallel attention + MLP blocks (Cohere, GPT-NeoX, StableLM),
mixture-of-experts MLPs (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, dots1, GLM-4-MoE, gpt-oss, Ernie 4.5 MoE,
HunYuan MoE, Cohere2-MoE, Mellum, MiniMax-M2, AFMoE, Solar-Open, Exaone-MoE, FlexOlmo, DeepSeek-V2/V3,
GLM-4.7-Flash, LongCat-Flash, Mistral 4, A.X K1, MiMo-V2-Flash, Laguna, HunYuan V3), multi-head latent attention
(DeepSeek-V2/V3, Mistral 4, GLM-4.7-Flash, LongCat-Flash, MiniCPM3, Youtu, A.X K1:
latents expanded per token before the attention function; the values' own head_dim is taken by the ring as
it is, and ``ring_generate``'s cache keeps the latents). RoPE types whose
frequencies follow the largest position of the input (``dynamic``, ``longrope``) are given the whole sequence's
largest position (``_rope``), for every family. Llama 4's chunked-attention layers take their chunks as documents
of the ring (``hf_attention``), and its layers without RoPE have their queries scaled by the tokens' index in the
whole row (``_temperature``).

What the generic patch refuses (``check``): layer types other than full / sliding attention (and Llama 4's
chunked attention). Qwen2-MoE also refuses sliding layers (``CHECKS``). The MoE router's load-balancing loss
(``output_router_logits=True``) is the whole sequence's (``_router``).

Models of these families are switched by ``hf_ring.apply_ring_attention(model)`` (or
``hf_ring.patches.get_patch(model_type)``); they have no family-named entry points.
"""

from __future__ import annotations

from ..compressed import LAYER_TYPES as COMPRESSED_LAYER_TYPES
from ._family import FamilyPatch, LogitTransform, check_layer_types, check_window

__all__ = [
    "ALIASES", "CACHE_CLASSES", "CHECKS", "COMPRESSED", "CROSS_ATTENTION", "FAMILIES", "LENDS_ATTENTION_KWARGS",
    "NO_ULYSSES",
    "LENDS_MIXER_KWARGS", "LINEAR", "LOGIT_TRANSFORMS", "MAKES_A_MASK", "MASK_POSITIONS", "NO_GENERATE", "OWN_ATTENTION",
    "PATCHES", "REFUSES", "SPARSE", "check",
    "check_causal_mask_only", "check_decoder_only", "check_deepseek_v4", "check_gemma4", "check_gpt_neo", "check_linear", "check_linear_sliding",
    "check_llama4", "check_minimax", "check_minimax_m3", "check_no_layerdrop", "check_opt", "check_zaya", "check_sparse", "check_sparse_linear", "check_sparse_sliding",
    "check_without_windows", "refuse_prefix_types",
]  # fmt: skip

FAMILIES = {
    "afmoe": "transformers.models.afmoe.modeling_afmoe.AfmoeAttention",
    "apertus": "transformers.models.apertus.modeling_apertus.ApertusAttention",
    "apertus1p5_text": "transformers.models.apertus1p5.modeling_apertus1p5.Apertus1p5TextAttention",
    "arcee": "transformers.models.arcee.modeling_arcee.ArceeAttention",
    "aria_text": "transformers.models.aria.modeling_aria.AriaTextAttention",
    "axk1": "transformers.models.axk1.modeling_axk1.AXK1Attention",
    "axk2": "transformers.models.axk2.modeling_axk2.AXK2Attention",
    "bailing_hybrid": "transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridAttention",
    "bamba": "transformers.models.bamba.modeling_bamba.BambaAttention",
    "bitnet": "transformers.models.bitnet.modeling_bitnet.BitNetAttention",
    "bloom": "transformers.models.bloom.modeling_bloom.BloomAttention",
    "codegen": "transformers.models.codegen.modeling_codegen.CodeGenAttention",
    "cohere": "transformers.models.cohere.modeling_cohere.CohereAttention",
    "cohere2": "transformers.models.cohere2.modeling_cohere2.Cohere2Attention",
    "cohere2_moe": "transformers.models.cohere2_moe.modeling_cohere2_moe.Cohere2MoeAttention",
    "cohere_compass_text": "transformers.models.cohere_compass.modeling_cohere_compass.CohereCompassAttention",
    "cwm": "transformers.models.cwm.modeling_cwm.CwmAttention",
    "dbrx": "transformers.models.dbrx.modeling_dbrx.DbrxAttention",
    "deepseek_v2": "transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention",
    "deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention",
    "deepseek_v32": "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention",
    "deepseek_v4": "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Attention",
    "diffllama": "transformers.models.diffllama.modeling_diffllama.DiffLlamaAttention",
    "dory": "transformers.models.dory.modeling_dory.DoryAttention",
    "dots1": "transformers.models.dots1.modeling_dots1.Dots1Attention",
    "dots3_note_text": "transformers.models.dots3_note.modeling_dots3_note.Dots3NoteTextAttention",
    "emu3_text_model": "transformers.models.emu3.modeling_emu3.Emu3Attention",
    "ergo": "transformers.models.ergo.modeling_ergo.ErgoAttention",
    "ernie4_5": "transformers.models.ernie4_5.modeling_ernie4_5.Ernie4_5Attention",
    "ernie4_5_moe": "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeAttention",
    "exaone4": "transformers.models.exaone4.modeling_exaone4.Exaone4Attention",
    "exaone_moe": "transformers.models.exaone_moe.modeling_exaone_moe.ExaoneMoeAttention",
    "falcon": "transformers.models.falcon.modeling_falcon.FalconAttention",
    "falcon_h1": "transformers.models.falcon_h1.modeling_falcon_h1.FalconH1Attention",
    "falcon_mamba": None,  # no attention: its Mamba mixers only (``LINEAR``)
    "flex_olmo": "transformers.models.flex_olmo.modeling_flex_olmo.FlexOlmoAttention",
    "flint": "transformers.models.flint.modeling_flint.FlintAttention",
    "gemma": "transformers.models.gemma.modeling_gemma.GemmaAttention",
    "gemma2": "transformers.models.gemma2.modeling_gemma2.Gemma2Attention",
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3.Gemma3Attention",
    "gemma3n_text": "transformers.models.gemma3n.modeling_gemma3n.Gemma3nTextAttention",
    "gemma4_text": "transformers.models.gemma4.modeling_gemma4.Gemma4TextAttention",
    "gemma4_unified_text": "transformers.models.gemma4_unified.modeling_gemma4_unified.Gemma4UnifiedTextAttention",
    "glm": "transformers.models.glm.modeling_glm.GlmAttention",
    "glm4": "transformers.models.glm4.modeling_glm4.Glm4Attention",
    "glm4_moe": "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeAttention",
    "glm4_moe_lite": "transformers.models.glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteAttention",
    "glm_moe_dsa": "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention",
    "gpt2": "transformers.models.gpt2.modeling_gpt2.GPT2Attention",
    "biogpt": "transformers.models.biogpt.modeling_biogpt.BioGptAttention",
    "gpt_bigcode": "transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention",
    "gpt_neo": "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoSelfAttention",
    "gpt_neox": "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXAttention",
    "gpt_oss": "transformers.models.gpt_oss.modeling_gpt_oss.GptOssAttention",
    "gptj": "transformers.models.gptj.modeling_gptj.GPTJAttention",
    "granite": "transformers.models.granite.modeling_granite.GraniteAttention",
    "granite_swa": "transformers.models.granite_swa.modeling_granite_swa.GraniteSWAAttention",
    "granitemoe": "transformers.models.granitemoe.modeling_granitemoe.GraniteMoeAttention",
    "granitemoe_swa": "transformers.models.granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAAttention",
    "granitemoehybrid": "transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridAttention",
    "granitemoeshared": "transformers.models.granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedAttention",
    "helium": "transformers.models.helium.modeling_helium.HeliumAttention",
    "hunyuan_v1_dense": "transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1Attention",
    "hunyuan_v1_moe": "transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Attention",
    "hy_v3": "transformers.models.hy_v3.modeling_hy_v3.HYV3Attention",
    "hy_v4": "transformers.models.hy_v4.modeling_hy_v4.HYV4Attention",
    "hyperclovax": "transformers.models.hyperclovax.modeling_hyperclovax.HyperCLOVAXAttention",
    "jais2": "transformers.models.jais2.modeling_jais2.Jais2Attention",
    "jamba": "transformers.models.jamba.modeling_jamba.JambaAttention",
    "inkling_text": "transformers.models.inkling.modeling_inkling.InklingAttention",
    "inkling2_text": (
        "transformers.models.inkling2.modeling_inkling2.Inkling2SlidingAttention",
        "transformers.models.inkling2.modeling_inkling2.Inkling2FullAttention",
    ),
    "inkling2_loop_text": (
        "transformers.models.inkling2_loop.modeling_inkling2_loop.Inkling2LoopSlidingAttention",
        "transformers.models.inkling2_loop.modeling_inkling2_loop.Inkling2LoopFullAttention",
    ),
    "jetmoe": "transformers.models.jetmoe.modeling_jetmoe.JetMoeAttention",
    "kimi_linear": "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearAttention",
    "kolibri1": "transformers.models.kolibri1.modeling_kolibri1.Kolibri1Attention",
    "kolibri1_1": "transformers.models.kolibri1_1.modeling_kolibri1_1.Kolibri1_1Attention",
    "hrm_text": "transformers.models.hrm_text.modeling_hrm_text.HrmTextAttention",
    "laguna": "transformers.models.laguna.modeling_laguna.LagunaAttention",
    "lara_mini": "transformers.models.lara_mini.modeling_lara_mini.LaraMiniAttention",
    "lfm2": "transformers.models.lfm2.modeling_lfm2.Lfm2Attention",
    "lfm2_moe": "transformers.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeAttention",
    "lfm3": "transformers.models.lfm3.modeling_lfm3.Lfm3Attention",
    "llama4_text": "transformers.models.llama4.modeling_llama4.Llama4TextAttention",
    "longcat_flash": "transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashMLA",
    "mamba": None,  # no attention: its Mamba mixers only (``LINEAR``)
    "mamba2": None,  # no attention: its Mamba2 mixers only (``LINEAR``)
    "mellum": "transformers.models.mellum.modeling_mellum.MellumAttention",
    "mimo_v2_flash": "transformers.models.mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashAttention",
    "minicpm3": "transformers.models.minicpm3.modeling_minicpm3.MiniCPM3Attention",
    "minicpm5_moe": "transformers.models.minicpm5_moe.modeling_minicpm5_moe.MiniCPM5MoeAttention",
    "minimax": "transformers.models.minimax.modeling_minimax.MiniMaxAttention",
    "minimax_m2": "transformers.models.minimax_m2.modeling_minimax_m2.MiniMaxM2Attention",
    "minimax_m3_vl_text": "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLAttention",
    "ministral": "transformers.models.ministral.modeling_ministral.MinistralAttention",
    "ministral3": "transformers.models.ministral3.modeling_ministral3.Ministral3Attention",
    "mistral4": "transformers.models.mistral4.modeling_mistral4.Mistral4Attention",
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralAttention",
    "modernbert-decoder": "transformers.models.modernbert_decoder.modeling_modernbert_decoder.ModernBertDecoderAttention",
    "mllama_text_model": "transformers.models.mllama.modeling_mllama.MllamaTextSelfAttention",
    "mpt": "transformers.models.mpt.modeling_mpt.MptAttention",
    "nanochat": "transformers.models.nanochat.modeling_nanochat.NanoChatAttention",
    "nemotron": "transformers.models.nemotron.modeling_nemotron.NemotronAttention",
    "nemotron_h": "transformers.models.nemotron_h.modeling_nemotron_h.NemotronHAttention",
    "olmo": "transformers.models.olmo.modeling_olmo.OlmoAttention",
    "opt": "transformers.models.opt.modeling_opt.OPTAttention",
    "olmo2": "transformers.models.olmo2.modeling_olmo2.Olmo2Attention",
    "olmo3": "transformers.models.olmo3.modeling_olmo3.Olmo3Attention",
    "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridAttention",
    "olmoe": "transformers.models.olmoe.modeling_olmoe.OlmoeAttention",
    "persimmon": "transformers.models.persimmon.modeling_persimmon.PersimmonAttention",
    "phi": "transformers.models.phi.modeling_phi.PhiAttention",
    "phi3": "transformers.models.phi3.modeling_phi3.Phi3Attention",
    "phimoe": "transformers.models.phimoe.modeling_phimoe.PhimoeAttention",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeAttention",
    "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeAttention",
    "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5Attention",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextAttention",
    "qwen4_exp_text": "transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextAttention",
    "recurrent_gemma": "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaAttention",
    "seed_oss": "transformers.models.seed_oss.modeling_seed_oss.SeedOssAttention",
    "zaya": "transformers.models.zaya.modeling_zaya.ZayaAttention",
    "smollm3": "transformers.models.smollm3.modeling_smollm3.SmolLM3Attention",
    "solar_open": "transformers.models.solar_open.modeling_solar_open.SolarOpenAttention",
    "stablelm": "transformers.models.stablelm.modeling_stablelm.StableLmAttention",
    "starcoder2": "transformers.models.starcoder2.modeling_starcoder2.Starcoder2Attention",
    "vaultgemma": "transformers.models.vaultgemma.modeling_vaultgemma.VaultGemmaAttention",
    "youtu": "transformers.models.youtu.modeling_youtu.YoutuAttention",
    "zamba": "transformers.models.zamba.modeling_zamba.ZambaAttention",
    "zamba2": "transformers.models.zamba2.modeling_zamba2.Zamba2Attention",
}
"""``config.model_type`` -> the attention class the generic patch switches (None: a model without attention)."""


def check(config, *, windows: bool = True) -> None:
    """ValueError for what these families can configure and hf_ring does not implement (``windows``: the family
    passes ``sliding_window`` to the attention function, so the window is checked)."""
    what = getattr(config, "model_type", "model")
    if windows:
        check_layer_types(config, what)
    else:
        check_layer_types(config, what, allowed=("full_attention",), window=False)


def check_gpt_neo(config) -> None:
    """``check`` for GPT-Neo: global and local layers, the local ones a window of ``config.window_size`` keys."""
    check(config, windows=False)
    kinds = sorted(set(getattr(config, "attention_layers", None) or []) - {"global", "local"})
    if kinds:
        raise ValueError(f"gpt_neo: attention layer types {kinds} are not supported; hf_ring supports global, local")
    w = getattr(config, "window_size", None)
    if "local" in config.attention_layers and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
        raise ValueError(f"gpt_neo: config.window_size must be a positive integer, got {w!r}")


def check_linear(config, sliding: bool = False) -> None:
    """``check`` for a hybrid family: full-attention layers (no windows; with ``sliding``, sliding-window layers
    too: LFM3, Lara-Mini) beside linear-attention, Mamba2 or short-convolution layers (``hf_ring.patches.linear``),
    attention and Mamba2 side by side (Falcon-H1's ``hybrid``), or MLP-only layers (Nemotron-H); no z-loss
    (Bamba)."""
    what = getattr(config, "model_type", "model")
    allowed = ("full_attention", "linear_attention", "conv", "hybrid", "mlp", "moe")
    check_layer_types(config, what, allowed=(*allowed, "sliding_attention") if sliding else allowed, window=sliding)
    if (getattr(config, "z_loss_coefficient", None) or 0) > 0:
        raise ValueError(
            f"{what}: config.z_loss_coefficient={config.z_loss_coefficient} adds a z-loss (the mean squared "
            "log-sum-exp of the logits) that each rank would compute over its own tokens only and that hf_ring's "
            "loss aggregation does not reproduce; set config.z_loss_coefficient=0 to train with context parallelism"
        )


def check_linear_sliding(config) -> None:
    """``check_linear`` for hybrids with sliding-window attention layers beside their full ones (LFM3, Lara-Mini)."""
    check_linear(config, sliding=True)


def check_zaya(config) -> None:
    """``check`` for ZAYA: its layer types name full and sliding-window attention layers ``hybrid`` and
    ``hybrid_sliding`` (each with its CCA projection: ``hf_ring.patches.linear``)."""
    check_layer_types(config, getattr(config, "model_type", "model"), allowed=("hybrid", "hybrid_sliding"))


def check_inkling(config) -> None:
    """``check`` for Inkling: full and sliding-window attention layers, named ``hybrid`` and ``hybrid_sliding`` (with
    a relative position bias: ``patches._relative``; and short convolutions: ``patches.linear``)."""
    check_layer_types(config, getattr(config, "model_type", "model"), allowed=("hybrid", "hybrid_sliding"))


def check_minimax(config) -> None:
    """``check_linear`` for MiniMax, whose attention layers all take ``config.sliding_window`` when it is set."""
    check_linear(config)
    check_window(config, getattr(config, "model_type", "model"))


def check_without_windows(config) -> None:
    """``check`` for a family whose attention is never given a window (Qwen2-MoE masks sliding layers but does
    not pass the window to the attention function, so its SDPA and FlashAttention paths disagree): sliding layers
    are refused, and ``config.sliding_window`` (0 when unused) is not read."""
    if "sliding_attention" in list(getattr(config, "layer_types", None) or []):
        raise ValueError(
            f"{config.model_type}: sliding-window layers (use_sliding_window=True) are not supported: this family "
            "does not pass its window to the attention function; set use_sliding_window=False"
        )
    check(config, windows=False)


def check_decoder_only(config) -> None:
    """``check``, and no cross-attention (GPT-2 as a decoder of an encoder-decoder model: its cross-attention
    modules are of the same class and would be switched too, over encoder states no rank shards)."""
    check(config)
    if getattr(config, "add_cross_attention", False):
        raise ValueError(
            f"{config.model_type}: config.add_cross_attention=True (a decoder attending to an encoder) is not "
            "supported under ring attention; hf_ring trains decoder-only language models"
        )


def check_causal_mask_only(config) -> None:
    """``check``, and no ``config.sliding_window``: OLMoE passes it to the attention function but masks causally
    only (its SDPA and FlashAttention paths would disagree); it has no such field unless one is added."""
    check(config)
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            f"{config.model_type}: config.sliding_window={config.sliding_window} is given to the attention but not "
            "to the model's mask (this family has no sliding-window layers); remove it from the config"
        )


def check_gemma4(config) -> None:
    """``check``, and no ``use_bidirectional_attention="all"`` (Gemma 4 as an encoder: its sliding layers then mask
    with a two-sided window of its own, which the ring's windows do not reproduce; ``"vision"`` only concerns image
    tokens, which the vision-language patch refuses)."""
    check(config)
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError(
            f"{config.model_type}: use_bidirectional_attention='all' (every token attending both ways, as an "
            "encoder) is not supported under ring attention; hf_ring trains Gemma 4 as a causal language model"
        )


def check_sparse(config) -> None:
    """``check`` for DeepSeek sparse attention: its layers are ``indexed_attention`` (``deepseek_sparse_attention``
    before Transformers 5.24: each query attends to the top-k keys its indexer picks, which the attention function
    takes over the whole sequence: ``hf_ring.sparse``); no windows."""
    what = getattr(config, "model_type", "model")
    allowed = ("full_attention", "indexed_attention", "deepseek_sparse_attention")
    check_layer_types(config, what, allowed=allowed, window=False)


def check_sparse_sliding(config) -> None:
    """``check`` for DeepSeek sparse attention beside sliding-window layers (Dots3 Note): its ``indexed_attention``
    layers (with an indexer, no window) as ``check_sparse``'s, and ``sliding_attention`` layers (no indexer) with
    their window."""
    what = getattr(config, "model_type", "model")
    check_layer_types(config, what, allowed=("full_attention", "indexed_attention", "sliding_attention"))


def check_sparse_linear(config) -> None:
    """``check_linear`` for Qwen4-Exp and GLM-5.3-Flash: Gated DeltaNet or Kimi Delta Attention layers
    (``linear_attention``) beside attention layers whose indexer picks blocks or pools of keys (``indexed_attention``:
    ``hf_ring.sparse``); no windows."""
    what = getattr(config, "model_type", "model")
    check_layer_types(config, what, allowed=("linear_attention", "indexed_attention"), window=False)


def refuse_prefix_types(config, arguments: dict) -> str | None:
    """``refuse`` for HRM-Text: ``token_type_ids`` under ``config.prefix_lm`` make the tokens of type 1 (the
    instruction) one block attending both ways (Transformers' ``block_sequence_ids``), which the ring would need for
    the whole sequence on every rank; refused by the keyword's presence (the same on every rank), not its values."""
    if getattr(config, "prefix_lm", False) and arguments.get("token_type_ids") is not None:
        return (
            f"{config.model_type}: token_type_ids with config.prefix_lm=True make the instruction tokens (type 1) "
            "attend to each other both ways, which hf_ring does not implement for this family yet; train it "
            "causally: drop token_type_ids from the batch (or set config.prefix_lm=False, which ignores them)"
        )
    return None


def check_opt(config) -> None:
    """``check`` for OPT: Transformers 5.24 or later (earlier OPT decoders build an all-ones attention mask when given
    none, which cannot pass beside ``shard_batch``'s document ids), and no LayerDrop (``config.layerdrop > 0`` skips
    each layer at random in training, a draw each rank makes on its own: a layer one rank skips, the others run, and
    their ring steps would wait on it)."""
    import transformers

    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 24):
        raise ValueError(
            f"opt: Transformers {transformers.__version__}'s OPT decoder builds an all-ones attention mask when given "
            "none, which hf_ring cannot tell from padding beside shard_batch's document ids; hf_ring supports OPT from "
            "Transformers 5.24"
        )
    check_no_layerdrop(config)


def check_no_layerdrop(config) -> None:
    """``check``, and no LayerDrop (``config.layerdrop > 0`` skips each layer at random in training, a draw each rank
    makes on its own: a layer one rank skips, the others run, and their ring steps would wait on it)."""
    check(config)
    if (getattr(config, "layerdrop", None) or 0) > 0:
        raise ValueError(
            f"{config.model_type}: config.layerdrop={config.layerdrop} skips layers at random in training, a draw of "
            "each rank's own under context parallelism (the other ranks' ring steps would wait for the skipped "
            "layer); set config.layerdrop=0.0"
        )


def check_minimax_m3(config) -> None:
    """``check`` for MiniMax M3: full-attention layers beside sparse ones (``minimax_m3_sparse``: an indexer picks
    blocks of keys per key/value head, which the attention function takes over the whole sequence: ``hf_ring.sparse``);
    no windows; one indexer head per key/value head, as Transformers' eager path assumes."""
    what = getattr(config, "model_type", "model")
    check_layer_types(config, what, allowed=("full_attention", "minimax_m3_sparse"), window=False)
    heads, kv_heads = getattr(config, "index_n_heads", None), getattr(config, "num_key_value_heads", None)
    if "minimax_m3_sparse" in list(getattr(config, "layer_types", None) or []) and heads != kv_heads:
        raise ValueError(
            f"{what}: config.index_n_heads={heads} indexer heads for {kv_heads} key/value heads: each key/value head "
            "takes the blocks of its own indexer head, so hf_ring needs as many"
        )


def check_deepseek_v4(config) -> None:
    """``check`` for DeepSeek-V4: sliding-window layers, and compressed ones (``compressed_sparse_attention``,
    ``heavily_compressed_attention``: the same window, beside entries compressing the whole sequence, which the attention
    function computes and gathers: ``hf_ring.compressed``), all with the window."""
    what = getattr(config, "model_type", "model")
    allowed = ("sliding_attention", *COMPRESSED_LAYER_TYPES)
    check_layer_types(config, what, allowed=allowed)


def check_llama4(config) -> None:
    """``check`` for Llama 4: chunked-attention layers (its RoPE layers: ``hf_ring.hf_attention`` cuts their
    documents into chunks of ``config.attention_chunk_size``) beside full-attention layers; no windows."""
    what = getattr(config, "model_type", "model")
    check_layer_types(config, what, allowed=("full_attention", "chunked_attention"), window=False)
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = "chunked_attention" in list(getattr(config, "layer_types", None) or [])
    if chunked and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{what}: chunked-attention layers need a positive config.attention_chunk_size, got {chunk!r}")


LINEAR = {
    "bailing_hybrid": "transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridDeltaAttention",
    "bamba": "transformers.models.bamba.modeling_bamba.BambaMixer",
    "falcon_h1": "transformers.models.falcon_h1.modeling_falcon_h1.FalconH1Mixer",
    "falcon_mamba": "transformers.models.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer",
    "glm5_next_text": "transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextLinearAttention",
    "granitemoehybrid": "transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer",
    # Inkling: the short convolutions on its keys and values and after its attention and MLP
    "inkling_text": "transformers.models.inkling.modeling_inkling.InklingShortConvolution",
    "inkling2_text": (
        "transformers.models.inkling2.modeling_inkling2.Inkling2ShortConvolution",
        "transformers.models.inkling2.modeling_inkling2.Inkling2DynamicShortConvolution",
    ),
    "inkling2_loop_text": (
        "transformers.models.inkling2_loop.modeling_inkling2_loop.Inkling2LoopShortConvolution",
        "transformers.models.inkling2_loop.modeling_inkling2_loop.Inkling2LoopDynamicShortConvolution",
    ),
    "jamba": "transformers.models.jamba.modeling_jamba.JambaMambaMixer",
    "kimi_linear": "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",
    "lara_mini": "transformers.models.lara_mini.modeling_lara_mini.LaraMiniGatedDeltaNet",
    "lfm2": "transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv",
    "lfm2_moe": "transformers.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv",
    "lfm3": "transformers.models.lfm3.modeling_lfm3.Lfm3ShortConv",
    "mamba": "transformers.models.mamba.modeling_mamba.MambaMixer",
    "mamba2": "transformers.models.mamba2.modeling_mamba2.Mamba2Mixer",
    "minimax": "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention",
    "nemotron_h": "transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer",
    "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet",
    "qwen3_5_moe_text": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet",
    "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
    "qwen4_exp_text": (  # (and its per-layer embedding, which looks back by n-grams and a dilated convolution)
        "transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextGatedDeltaNet",
        "transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextPLELayer",
    ),
    "recurrent_gemma": "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock",
    "zamba": "transformers.models.zamba.modeling_zamba.ZambaMambaMixer",
    "zamba2": "transformers.models.zamba2.modeling_zamba2.Zamba2MambaMixer",
    # ZAYA: its attention's query/key convolutions and delayed values (CCA), computed before the attention function
    "zaya": "transformers.models.zaya.modeling_zaya.ZayaCCAProjection",
}
"""Hybrid families: their linear-attention (Gated DeltaNet, Kimi Delta Attention, MiniMax's lightning attention), Mamba,
Mamba2, short-convolution or RG-LRU (RecurrentGemma) class, whose modules' forward ``hf_ring.patches.linear`` replaces while the model is patched."""

SPARSE = ("axk2", "deepseek_v32", "dots3_note_text", "glm_moe_dsa", "glm5_next_text", "hy_v4", "hy_v4_vl_text", "mistral_large4_text",
          "minimax_m3_vl_text", "qwen4_exp_text", "kolibri1_1")  # fmt: skip
"""Families with DeepSeek sparse attention: an indexer beside each attention layer (``hf_ring.patches._sparse``;
Qwen4-Exp's picks blocks of keys, MiniMax M3's blocks of keys per key/value head, Kolibri 1.1's a mask of keys from
an earlier layer's pool: ``hf_ring.sparse``); HunYuan V4 VL's, Mistral Large 4's and MiniMax M3's text models exist
only inside their vision-language models (``multimodal.INNER``)."""

COMPRESSED = ("deepseek_v4",)
"""Families with DeepSeek-V4's compressed attention layers (``hf_ring.patches._compressed``, ``hf_ring.compressed``)."""

CHECKS = {
    "olmoe": check_causal_mask_only, "qwen2_moe": check_without_windows, "gemma4_text": check_gemma4,
    "gemma4_unified_text": check_gemma4,
    "llama4_text": check_llama4,
    "gpt2": check_decoder_only, "gpt_bigcode": check_decoder_only, "gpt_neo": check_gpt_neo, **{model_type: check_linear for model_type in LINEAR},
    "minimax": check_minimax, "lfm3": check_linear_sliding, "lara_mini": check_linear_sliding,
    "recurrent_gemma": check_linear_sliding, "zaya": check_zaya, "inkling_text": check_inkling,
    "inkling2_text": check_inkling, "inkling2_loop_text": check_inkling,
    **{model_type: check_sparse for model_type in SPARSE},
    "dots3_note_text": check_sparse_sliding, "kolibri1_1": check_sparse_sliding, "qwen4_exp_text": check_sparse_linear,
    "glm5_next_text": check_sparse_linear,
    "minimax_m3_vl_text": check_minimax_m3, "opt": check_opt, "biogpt": check_no_layerdrop, "deepseek_v4": check_deepseek_v4,
}  # fmt: skip
"""Families with a stricter config check than ``check``."""

LENDS_ATTENTION_KWARGS = {"nemotron", "stablelm"}
"""Families whose decoder layers call their attention without the model's keyword arguments (the document ids, the
shard, ring_generate's cache): each layer lends its attention those of its own call (``hf_ring.patches._lend``)."""

LENDS_MIXER_KWARGS = {"jamba": "layer", "mamba": "model", "falcon_mamba": "model", "mamba2": "base"}
"""Families whose mixers are not given the batch's keywords, and who lends them those of its own call
(``hf_ring.patches.linear``): Jamba's decoder layers and the pure Mamba models (whose backbone calls its blocks
with the mask alone) beside the mask (``Lent``); Mamba2's causal LM to its backbone, which unpacks them and passes
them on (``UnpackLent``)."""

CROSS_ATTENTION = {
    "mllama_text_model": "transformers.models.mllama.modeling_mllama.MllamaTextCrossAttention",
    # Inkling 2's attention residuals: each token's attention over the outputs of earlier blocks of layers
    "inkling2_text": "transformers.models.inkling2.modeling_inkling2.Inkling2BlockAttentionResidual",
    # (and Inkling 2 Loop's, with its residuals retrieving messages from the previous pass)
    "inkling2_loop_text": (
        "transformers.models.inkling2_loop.modeling_inkling2_loop.Inkling2LoopBlockAttentionResidual",
        "transformers.models.inkling2_loop.modeling_inkling2_loop.Inkling2LoopMessageAttentionResidual",
    ),
}
"""Families with cross-attention layers (Llama 3.2 Vision's text model, attending to the image features every rank
holds whole): their modules attend locally, by the model's own implementation
(``FamilyPatch.local_attention_class``)."""

NO_ULYSSES = dict.fromkeys(
    ("inkling_text", "inkling2_text", "inkling2_loop_text"),
    "its relative position bias (a table per query) and sinks per query do not travel the Ulysses all-to-all yet",
)
"""Families the Ulysses x Ring hybrid does not take, and why: ``ulysses_size="auto"`` gives them the pure ring, an
explicit ``ulysses_size`` above 1 is refused by name (``hf_ring.apply``)."""

LOCAL_PER_TOKEN = {"inkling2_text", "inkling2_loop_text"}
"""Families whose local modules (``CROSS_ATTENTION``) attend per token over states of their own, not to image
features (Inkling 2's attention residuals)."""

NO_GENERATE = {
    "inkling2_loop_text": "its loop layers copy their KV caches and convolution states for every pass, which the sharded "
    "cache does not follow",
    "dory": "its looped layers copy their KV cache for every loop, which the sharded cache does not follow",
    "deepseek_v4": "its compressed layers keep their compressors' windows in the model's own cache, which the sharded "
    "cache does not follow",
    "kolibri1_1": "its sparse layers' pools of candidate keys are not kept for decode steps by the sharded cache yet",
}
"""Families ``hf_ring.ring_generate`` refuses, and why."""

CACHE_CLASSES = {"minimax": "transformers.models.minimax.modeling_minimax.MiniMaxCache"}
"""Families whose model takes no cache but its own class: ``hf_ring.ring_generate``'s sharded cache subclasses it."""

LOGIT_TRANSFORMS = {
    "cohere": LogitTransform(multiply="logit_scale"),
    "cohere2": LogitTransform(multiply="logit_scale"),
    "cohere2_moe": LogitTransform(multiply="logit_scale"),
    "cohere_compass_text": LogitTransform(multiply="logit_scale"),  # (None: no scale)
    "gemma2": LogitTransform(softcap="final_logit_softcapping"),
    "gemma3_text": LogitTransform(softcap="final_logit_softcapping"),
    "gemma3n_text": LogitTransform(softcap="final_logit_softcapping"),
    "gemma4_text": LogitTransform(softcap="final_logit_softcapping"),
    "gemma4_unified_text": LogitTransform(softcap="final_logit_softcapping"),
    "granite": LogitTransform(divide="logits_scaling"),
    "granite_swa": LogitTransform(divide="logits_scaling"),
    "granitemoe": LogitTransform(divide="logits_scaling"),
    "granitemoe_swa": LogitTransform(divide="logits_scaling"),
    "granitemoeshared": LogitTransform(divide="logits_scaling"),
    "granitemoehybrid": LogitTransform(divide="logits_scaling"),
    "falcon_h1": LogitTransform(multiply="lm_head_multiplier"),
    "hyperclovax": LogitTransform(multiply="logits_scaling"),
    "inkling_text": LogitTransform(divide="logits_mup_width_multiplier"),  # divides the hidden states (no head bias)
    "inkling2_text": LogitTransform(softcap="final_logit_softcapping"),
    "inkling2_loop_text": LogitTransform(softcap="final_logit_softcapping"),
    "minicpm3": LogitTransform(divide="logits_scaling"),  # divides the hidden states (the head has no bias)
    "nanochat": LogitTransform(softcap="final_logit_softcapping"),
    "recurrent_gemma": LogitTransform(softcap="logits_soft_cap"),
    "vaultgemma": LogitTransform(softcap="final_logit_softcapping"),
}
"""What these families' causal-LM heads do to the lm_head output before the loss (the others: nothing)."""

MASK_POSITIONS = {"opt": "transformers.models.opt.modeling_opt.OPTDecoder"}
MAKES_A_MASK = {"biogpt": "transformers.models.biogpt.modeling_biogpt.BioGptModel"}
"""The model class of the families that make an all-ones attention mask when given none (``hf_attention.MAKES_A_MASK``:
the attention function drops such a mask; the model refuses a caller's where the attention function would)."""
"""Families whose model numbers its tokens from the attention mask, and the module that does
(``hf_ring.patches._mask_positions``)."""

REFUSES = {"hrm_text": refuse_prefix_types}
"""Families refusing something of a call under the ring (``FamilyPatch.refuse``)."""

OWN_ATTENTION = {"falcon", "gpt_neo", "bloom", "mpt"}
"""Families whose attention modules compute attention themselves (not through Transformers' AttentionInterface):
their ``forward`` is replaced while patched (``hf_ring.patches._own``)."""

ALIASES = {"sarvam_mla": "deepseek_v3", "sarvam_moe": "glm4_moe", "param2moe": "glm4_moe"}
"""Model types whose checkpoints load another family's model classes (a config of their own, the modules of the
family named): that family's patch. (Llama's: ``hf_ring.patches.llama``.)"""

PATCHES = {
    model_type: FamilyPatch(
        name=model_type,
        model_types=(model_type, *(alias for alias, family in ALIASES.items() if family == model_type)),
        attention_class=path,
        check_config=CHECKS.get(model_type, check),
        logit_transform=LOGIT_TRANSFORMS.get(model_type),
        lend_attention_kwargs=model_type in LENDS_ATTENTION_KWARGS,
        linear_class=LINEAR.get(model_type),
        no_generate=NO_GENERATE.get(model_type),
        cache_class=CACHE_CLASSES.get(model_type),
        lend_mixer_kwargs=LENDS_MIXER_KWARGS.get(model_type),
        sparse=model_type in SPARSE,
        compressed=model_type in COMPRESSED,
        local_attention_class=CROSS_ATTENTION.get(model_type),
        local_is_cross=model_type not in LOCAL_PER_TOKEN,
        mask_positions=MASK_POSITIONS.get(model_type),
        makes_a_mask=MAKES_A_MASK.get(model_type),
        own_attention=model_type if model_type in OWN_ATTENTION else None,
        refuse=REFUSES.get(model_type),
    )
    for model_type, path in FAMILIES.items()
}
PATCHES.update({alias: PATCHES[family] for alias, family in ALIASES.items()})
"""``config.model_type`` -> its ``FamilyPatch``."""
