"""Vision-language models whose text model is of a supported family: text-only batches, and for most of them
batches with images and video.

Transformers loads some of the most fine-tuned checkpoints as vision-language models even for text work:
``AutoModelForCausalLM`` maps Gemma 3 (4B, 12B, 27B; ``model_type`` ``gemma3``) to
``Gemma3ForConditionalGeneration``, Gemma 3n (``gemma3n``, vision and audio) to ``Gemma3nForConditionalGeneration``,
Gemma 4 (``gemma4``, with vision and audio towers) to ``Gemma4ForConditionalGeneration``, Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) are their
``...ForConditionalGeneration`` (text models that exist only inside them: ``INNER``), as are GLM-4.1V (``glm4v``),
GLM-4.5V / 4.6V (``glm4v_moe``, ``glm46v``) and GLM-OCR (``glm_ocr``), InternVL 3 / 3.5 holds a Qwen2,
Qwen3, Qwen3-MoE or Llama text model, LLaVA, LLaVA-NeXT and LLaVA-NeXT-Video a Llama, Mistral or Qwen2 one,
LLaVA-OneVision and FastVLM a Qwen2 one, ViP-LLaVA, Video-LLaVA, Perception LM, Idefics3 and SmolVLM a Llama one,
Idefics2 a Mistral one, Mistral Small 3.1 / 3.2 are ``Mistral3ForConditionalGeneration`` and Llama 4 Scout / Maverick
``Llama4ForConditionalGeneration`` (a ``llama4_text`` causal LM inside), Kimi K2.5 / K2.6
``Kimi_K25ForConditionalGeneration`` (a DeepSeek-V3 text model), EXAONE 4.5 ``Exaone4_5_ForConditionalGeneration``
(an EXAONE 4 one), MiniMax M3 ``MiniMaxM3SparseForConditionalGeneration`` (its text model's dense attention layers;
the sparse-indexer ones are refused), LFM3-VL ``Lfm3VlForConditionalGeneration`` (an LFM3 one), Apertus 1.5
``Apertus1p5ForConditionalGeneration`` (images as discrete codes its text model embeds), HunyuanOCR
``HunYuanVLForConditionalGeneration`` (a HunYuan dense text model with multimodal RoPE: ``INNER``), Granite 4
Vision ``Granite4VisionForConditionalGeneration`` (a Granite one, vision features added before several of its
layers: ``_family.ShardEmbeddings`` cuts them too), PaddleOCR-VL ``PaddleOCRVLForConditionalGeneration`` (an
ERNIE-4.5-like text model with multimodal RoPE: ``INNER``), Aria ``AriaForConditionalGeneration`` (its MoE
text model, ``aria_text``), Molmo2 ``Molmo2ForConditionalGeneration`` (its own text model: ``INNER``), Emu3
``Emu3ForConditionalGeneration`` (images as discrete codes its ``emu3_text_model`` embeds), Chameleon
``ChameleonForConditionalGeneration`` (its model tokenizes the images into codes of its vocabulary and merges them in
its own forward: ``MERGES`` does that merge before the cut; its head gives the codes the lowest logit), Fuyu
``FuyuForCausalLM`` (a Persimmon one; its image patches projected by one linear layer), Phi-4-multimodal
``Phi4MultimodalForCausalLM`` (text-only: its text model is the top model and merges images and audio in its own
forward; ``INNER``), ERNIE-4.5-VL ``Ernie4_5_VLMoeForConditionalGeneration`` (its MoE text model routes each token
to text or vision experts by ``moe_mm_token_type_ids``, which ``_family.ShardEmbeddings`` cuts with the embeddings;
``INNER``), Step 3.7 ``Step3p7ForConditionalGeneration`` (its ``step3p5`` text model, layers of their own query head
counts: ``INNER``), Qwen2.5-Omni's thinker
``Qwen2_5OmniThinkerForConditionalGeneration`` (``qwen2_5_omni_thinker``: a Qwen2.5-VL-like text model only inside it,
``INNER``; images, video and audio; the whole Omni model with its talker has no training forward) and Qwen3-Omni-MoE's
(``qwen3_omni_moe_thinker``: a Qwen3-VL-MoE-like text model with deepstack features, ``INNER``), Cosmos3's Reasoner
``Cosmos3OmniForConditionalGeneration`` (``cosmos3_omni``: Qwen3-VL's architecture, a ``qwen3_vl_text`` text model;
images and video, its generator, sound and action towers not part of it), and the audio-language Qwen2-Audio
``Qwen2AudioForConditionalGeneration`` (a Qwen2 one; its head's own loss replaced under the ring: ``OWN_LOSS``) and
Voxtral ``VoxtralForConditionalGeneration`` (a Llama one), Granite Speech and Granite Speech Plus
``GraniteSpeech(Plus)ForConditionalGeneration`` (a Granite one; their head applies no ``logits_scaling``, and
computes its own loss: ``OWN_LOSS``), and Nemotron 3 Nano Omni ``NemotronH_Omni_Reasoning_V3`` (a Nemotron-H causal
LM inside; audio tested, its RADIO images not). Their
language model is a plain decoder of a family hf_ring supports (``gemma3_text``; ``gemma4_text``; ``mistral`` or
``ministral3``); the vision (and audio) towers and projectors only run when images (or audio) are given.

The patch switches the text model's attention only (``set_attn_implementation`` for the text sub-config; the
vision tower keeps its own); the text config's family (``VisionLanguagePatch.text``) finds its attention modules
and checks the text config.

Images and video (``IMAGES``: LLaVA, LLaVA-NeXT, LLaVA-NeXT-Video, LLaVA-OneVision, ViP-LLaVA, Video-LLaVA,
Perception LM, FastVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, InternVL, Mistral 3,
Idefics2, Idefics3, SmolVLM, LFM2-VL, Aya Vision, Command A Vision, LightOnOCR, LLaVA-OneVision-1.5, GOT-OCR 2.0, Ovis2,
Ovis2.5, Qianfan-OCR,
Gemma 3, Gemma 3n, Gemma 4, Llama 4, Kimi K2.5, EXAONE 4.5, MiniMax M3, LFM3-VL, Apertus 1.5, PaliGemma, MiniCPM-V 4.6,
VideoLLaMA3, DeepSeek-VL, DeepSeek-VL-Hybrid, Janus, GLM-4.1V, GLM-4.5V / 4.6V, GLM-GA, GLM-OCR, HunyuanOCR, Granite 4
Vision, PaddleOCR-VL, Aria, Molmo2, Emu3, Chameleon, Fuyu, ERNIE-4.5-VL, Step 3.7, the Qwen2.5-Omni and Qwen3-Omni-MoE thinkers,
Cosmos3; audio: Gemma 3n, Qwen2-Audio, Voxtral, MOSS-Transcribe-Diarize, Granite Speech, Granite Speech Plus, Nemotron 3 Nano Omni). Their text model
attends causally over image tokens as over text, so the
ring needs nothing new, but for Gemma 3 and Gemma 4, whose image tokens also see each other both ways: their hook
(``BLOCKS``, ``_family.BlockIds``) numbers each image's tokens from ``token_type_ids`` (Gemma 3) or
``mm_token_type_ids`` (Gemma 4, with ``use_bidirectional_attention="vision"``) as Transformers does and passes them to
the attention layers (every layer for Gemma 3; Gemma 4's sliding layers only, its full layers stay causal), where the
ring adds those pairs to its causal masks (``ring_attention(block_ids=...)``, the window still applying on sliding
layers). PaliGemma (a Gemma or Gemma 2 text model) is a prefix LM: its images and prompt (``token_type_ids`` 0)
see each other both ways, one block per row, on every layer, the suffix causally; its text attention says
``is_causal=False`` (``use_bidirectional_attention``) while its mask is causal, so ``PaliGemmaPatch`` makes the ring
causal while patched. Molmo2's image tokens (``mm_token_type_ids`` 1) all see each other both ways, one block per
row (``_molmo2_blocks``), on every layer. What needs care is where the vision features land and how positions are
numbered.
``shard_batch`` hands such a batch to the model whole (``ShardInfo.whole_inputs``): the model runs its vision tower
on every image of the batch, merges the features into the embeddings of the whole sequence and numbers it
(Qwen-VL's and GLM-4V's multimodal RoPE), exactly as unsharded; then ``_family.ShardEmbeddings``, a pre-hook on the
text model
(the innermost module of the text config: for Llama 4 the text model inside its causal LM), cuts
the embeddings, positions, Gemma 4's per-layer inputs and Qwen3-VL's deepstack features to the rank's shard.
Gradients flow back through that cut, so each rank's vision tower gets the gradient of its own image tokens and the
usual CP gradient sum makes it whole. The families that encode each image by its grid (Qwen-VL, GLM-4V and their
kin), and those that encode a batch of images of one size (Gemma 3, PaliGemma, LLaVA, InternVL, Aya Vision), divide
the vision tower's work over the CP group (``_split_vision``: each rank encodes its share of the images, the
features all-gathered); the others run it on all the batch's images on every rank. The cost: every rank holds
the whole sequence's input embeddings ([batch, seq, hidden], e.g. 0.9 GiB at 128K tokens and hidden 3584 in bf16)
until the cut, and their gradient of that size in the backward.

A wrapper added text-only would refuse images: a call with them (``pixel_values``, ``input_features``, ``mm_encoder_outputs``,
``token_type_ids`` / ``mm_token_type_ids`` marking image tokens) raises on every rank before anything runs
(``_family.TextOnly``): Phi-4-multimodal (``image_pixel_values``, ``audio_input_features``), none of the others
(LFM2-VL takes images since its short convolutions run on the cut embeddings as on text). Gemma 4's audio
(``input_features``) goes as its images go: the batch whole, the audio features merged on the whole sequence, its
audio tokens attending causally; so do the clips of the audio-language models (``input_features``; Qwen2-Audio's
with their ``feature_attention_mask``, Granite Speech's with ``input_features_mask``; the Qwen-Omni thinkers' with a
``feature_attention_mask``). Gemma 4's head softcaps its logits with the text config's
``final_logit_softcapping`` (``LOGIT_TRANSFORMS``, for the chunked loss), Granite 4 Vision's divides them by its
``logits_scaling``; Gemma 3's and Mistral 3's apply nothing, nor does Command A Vision's (``cohere2_vision``), though its Cohere2 text
config has a ``logit_scale`` (which ``Cohere2ForCausalLM`` applies); Aya Vision's multiplies by it from Transformers 5.25
on, and not before (``LogitTransform.multiplied_by``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..hf_attention import SHARD_INFO_KWARG, RingBlocks, ShardInfo
from . import generic, llama, mistral, qwen2, qwen3
from ._family import FamilyPatch, LogitTransform
from ._hooks import remove_hooks

__all__ = ["BLOCKS", "DEDICATED", "EXTRA_LOSS", "ExtraLossPatch", "IMAGES", "INNER", "MEDIA", "OWN_LOSS", "OwnLossPatch",
           "MERGES", "PATCHES", "PaliGemmaPatch", "VisionLanguagePatch", "WRAPPERS"]  # fmt: skip

MEDIA = ("pixel_values", "pixel_values_videos", "pixel_values_images", "input_features", "input_values", "image_patches",
         "mm_encoder_outputs", "image_pixel_values", "audio_input_features")  # fmt: skip
"""Keywords that carry images, video or audio into these models' forward (Video-LLaVA's images
``pixel_values_images``, the name its processor gives them; Gemma 4's audio ``input_features``, Apertus 1.5's
``input_values``; Phi-4-multimodal's ``image_pixel_values`` and ``audio_input_features``; Fuyu's patches
``image_patches``, as its processor names them)."""

WRAPPERS = {  # model_type: the text config's model types it may hold (the first: its usual one)
    "gemma3": ("gemma3_text",),
    "gemma3n": ("gemma3n_text",),  # Gemma 3n (text, vision, audio)
    "gemma4": ("gemma4_text",),  # Gemma 4 (text, vision, audio)
    "gemma4_unified": ("gemma4_unified_text",),  # Gemma 4 Unified (encoder-free: patches and audio projected)
    "qwen2_vl": ("qwen2_vl_text",),
    "qwen2_5_vl": ("qwen2_5_vl_text",),
    "qwen3_vl": ("qwen3_vl_text",),
    "qwen3_vl_moe": ("qwen3_vl_moe_text",),  # Qwen3-VL-30B-A3B, 235B-A22B
    "cohere_compass": ("cohere_compass_text",),  # Cohere Compass (Qwen3-VL's tower and multimodal RoPE)
    "hyperclovax_vision_v2": ("hyperclovax",),  # HyperCLOVA X Vision V2 (Qwen2.5-VL's tower; Transformers 5.24)
    "muse_spark": ("muse_spark_text",),  # Muse Spark (images, video, audio; Transformers 5.24)
    "muse_glimmer": ("muse_glimmer_text",),  # Muse Glimmer (images; gated attention, sliding and full layers)
    "dots3_note": ("dots3_note_text",),  # Dots3 Note (images, audio; sparse and sliding layers; 5.24)
    "internvl": ("qwen2", "qwen3", "qwen3_moe", "llama"),  # InternVL 3 / 3.5
    "mistral3": ("mistral", "ministral3"),  # Mistral Small 3.x; Ministral 3 / Magistral checkpoints
    "mistral_large4": ("mistral_large4_text",),  # Mistral Large 4 (DeepSeek sparse attention; Transformers 5.24)
    "lfm2_vl": ("lfm2",),  # LFM2-VL
    "qwen3_5": ("qwen3_5_text",),  # Qwen3.5 (every checkpoint is this vision-language model)
    "qwen3_5_moe": ("qwen3_5_moe_text",),
    "qwen4_exp": ("qwen4_exp_text",),  # Qwen4-Exp (block-sparse attention, per-layer n-gram embeddings; 5.24)
    "glm5_next": ("glm5_next_text",),  # GLM-5.3-Flash (KDA layers, pooled sparse attention, hyper-connections; 5.24)
    "inkling2": ("inkling2_text",),  # Inkling 2 (its relative position bias, short convolutions; 5.24)
    "llava": ("llama", "mistral", "qwen2"),  # LLaVA 1.5 and checkpoints of its architecture
    "llava_next": ("llama", "mistral", "qwen2"),  # LLaVA-NeXT (1.6)
    "vipllava": ("llama",),  # ViP-LLaVA (7B, 13B): features of several vision layers
    "video_llava": ("llama",),  # Video-LLaVA: an image tower and a video tower
    "perception_lm": ("llama",),  # Perception LM (1B, 3B, 8B): tiles pooled by its projector, video frames as tiles
    "fast_vlm": ("qwen2",),  # FastVLM (0.5B, 1.5B, 7B): a convolutional vision tower
    "llava_next_video": ("llama", "mistral", "qwen2"),  # LLaVA-NeXT-Video: LLaVA-NeXT's images, pooled video frames
    "llava_onevision": ("qwen2",),  # LLaVA-OneVision (0.5B, 7B, 72B): any-resolution tiles, video frames pooled
    "idefics3": ("llama",),  # Idefics3
    "smolvlm": ("llama",),  # SmolVLM
    "aya_vision": ("cohere2",),  # Aya Vision 8B / 32B (its head applies logit_scale from Transformers 5.25 on)
    "cohere2_vision": ("cohere2",),  # Command A Vision
    "idefics2": ("mistral",),  # Idefics2
    "lighton_ocr": ("qwen3",),  # LightOnOCR
    "llava_onevision1_5": ("qwen3",),  # LLaVA-OneVision-1.5 (RICE-ViT tower by image grid; Transformers 5.25)
    "got_ocr2": ("qwen2",),  # GOT-OCR 2.0
    "ovis2": ("qwen2",),  # Ovis2
    "ovis2_5": ("qwen3",),  # Ovis2.5 (a NaViT tower by image grid, visual indicator tokens; Transformers 5.25)
    "qianfan_ocr": ("qwen3",),  # Qianfan-OCR
    "llama4": ("llama4_text",),  # Llama 4 Scout, Maverick (their text model: a causal LM inside the wrapper)
    "kimi_k25": ("deepseek_v3",),  # Kimi K2.5, K2.6
    "exaone4_5": ("exaone4",),  # EXAONE 4.5
    "minimax_m3_vl": ("minimax_m3_vl_text",),  # MiniMax M3 (dense and sparse attention layers)
    "lfm3_vl": ("lfm3",),  # LFM3-VL (Transformers 5.24)
    "apertus1p5": ("apertus1p5_text",),  # Apertus 1.5 (Transformers 5.24)
    "paligemma": ("gemma", "gemma2"),  # PaliGemma (Gemma), PaliGemma 2 (Gemma 2)
    "minicpmv4_6": ("qwen3_5_text",),  # MiniCPM-V 4.6
    "minicpm_ocr": ("qwen3_5_text",),  # MiniCPM-OCR (MiniCPM-V 4.6's architecture)
    "minicpmv4_7": ("qwen3_5_text",),  # MiniCPM-V 4.7 (its images on a canvas of multimodal RoPE positions; 5.24)
    "video_llama_3": ("qwen2",),  # VideoLLaMA3
    "deepseek_vl": ("llama",),  # DeepSeek-VL
    "janus": ("llama",),  # Janus, Janus-Pro (understanding: images in, text out)
    "deepseek_vl_hybrid": ("llama",),  # DeepSeek-VL 7B (SigLIP and SAM towers)
    "glm4v": ("glm4v_text",),  # GLM-4.1V
    "glm4v_moe": ("glm4v_moe_text",),  # GLM-4.5V, GLM-4.6V
    "glm46v": ("glm4v_text", "glm4v_moe_text"),  # GLM-4.6V's own class (any GLM-4V text model: AutoModel)
    "glmga": ("glm4v_text", "glm4v_moe_text"),  # GLM-GA: a config of its own over GLM-4.6V's classes (5.25)
    "glm_ocr": ("glm_ocr_text",),  # GLM-OCR
    "hy_v4_vl": ("hy_v4_vl_text",),  # HunYuan V4 VL (DeepSeek sparse attention, multimodal RoPE; Transformers 5.24)
    "hunyuan_vl": ("hunyuan_vl_text",),  # HunyuanOCR (a HunYuan dense text model, multimodal RoPE)
    "granite_docling": ("granite_docling_text",),  # Granite Docling (tiles, deepstack features; Transformers 5.24)
    "granite4_vision": ("granite4_vision_text",),  # Granite 4 Vision (a Granite text model, deepstack features)
    "paddleocr_vl": ("paddleocr_vl_text",),  # PaddleOCR-VL (an ERNIE-4.5-like text model, multimodal RoPE)
    "mllama": ("mllama_text_model",),  # Llama 3.2 Vision (images by cross-attention)
    "qwen2_audio": ("qwen2",),  # Qwen2-Audio (audio in, text out; its head's own loss: OWN_LOSS)
    "voxtral": ("llama",),  # Voxtral Mini / Small (audio in, text out)
    "moss_transcribe_diarize": ("qwen3",),  # MOSS-Transcribe-Diarize (audio in, transcript out; Transformers 5.24)
    "granite_speech": ("granite",),  # Granite Speech 3.x (its head's own loss: OWN_LOSS; no logits_scaling)
    "granite_speech_plus": ("granite",),  # Granite Speech 4.1 Plus (as Granite Speech)
    "nemotron_h_omni": ("nemotron_h",),  # Nemotron 3 Nano Omni (a Nemotron-H causal LM inside; 5.24)
    "qwen2_5_omni_thinker": ("qwen2_5_omni_text",),  # Qwen2.5-Omni's thinker (images, video, audio; multimodal RoPE)
    "qwen3_omni_moe_thinker": ("qwen3_omni_moe_text",),  # Qwen3-Omni-30B-A3B's thinker (experts, deepstack features)
    "cosmos3_omni": ("qwen3_vl_text",),  # Cosmos3 Reasoner (Qwen3-VL's architecture; its other towers not loaded)
    "cosmos3_edge": ("cosmos3_edge_text",),  # Cosmos3 Edge (interleaved multimodal RoPE, a SigLIP2 tower)
    "aria": ("aria_text",),  # Aria (its MoE text model; images through a cross-attention projector)
    "molmo2": ("molmo2_text",),  # Molmo2 (Transformers 5.24; its image tokens see each other both ways)
    "emu3": ("emu3_text_model",),  # Emu3 (understanding: images in as VQ codes its text model embeds, text out)
    # Chameleon: its model is the text model (its config the text config), which tokenizes the images by its VQ-VAE
    # and embeds their codes in its own forward (``MERGES``); its head never predicts an image code
    "chameleon": ("chameleon",),
    "fuyu": ("persimmon",),  # Fuyu (Persimmon text; image patches projected linearly, no vision tower)
    # Phi-4-multimodal, text-only: its phi3-like text model is the top model (its config the text config), and merges
    # the image and audio features inside its own forward, from the whole input_ids, where no hook can cut them
    "phi4_multimodal": ("phi4_multimodal",),
    "ernie4_5_vl_moe": ("ernie4_5_vl_moe_text",),  # ERNIE-4.5-VL (experts by token type: text or vision)
    "step3p7": ("step3p5",),  # Step 3.7 (its text model: sliding and full layers of their own head counts, gates)
}


IMAGES = (
    "llava",
    "llava_next",
    "llava_next_video",
    "llava_onevision",
    "vipllava",
    "video_llava",
    "perception_lm",
    "fast_vlm",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "cohere_compass",
    "hyperclovax_vision_v2",
    "muse_spark",
    "muse_glimmer",
    "dots3_note",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen4_exp",
    "glm5_next",
    "internvl",
    "mistral3",
    "mistral_large4",
    "idefics3",
    "smolvlm",
    "gemma3",
    "gemma3n",
    "gemma4",
    "gemma4_unified",
    "lfm2_vl",
    "aya_vision",
    "cohere2_vision",
    "idefics2",
    "lighton_ocr",
    "llava_onevision1_5",
    "got_ocr2",
    "ovis2",
    "ovis2_5",
    "qianfan_ocr",
    "llama4",
    "kimi_k25",
    "exaone4_5",
    "minimax_m3_vl",
    "lfm3_vl",
    "apertus1p5",
    "paligemma",
    "minicpmv4_6",
    "minicpm_ocr",
    "minicpmv4_7",
    "video_llama_3",
    "deepseek_vl",
    "janus",
    "deepseek_vl_hybrid",
    "glm4v",
    "glm4v_moe",
    "glm46v",
    "glmga",
    "glm_ocr",
    "hunyuan_vl",
    "hy_v4_vl",
    "granite4_vision",
    "granite_docling",
    "paddleocr_vl",
    "mllama",
    "qwen2_audio",
    "voxtral",
    "moss_transcribe_diarize",
    "granite_speech",
    "granite_speech_plus",
    "nemotron_h_omni",
    "qwen2_5_omni_thinker",
    "qwen3_omni_moe_thinker",
    "cosmos3_omni",
    "cosmos3_edge",
    "aria",
    "molmo2",
    "emu3",
    "chameleon",
    "fuyu",
    "ernie4_5_vl_moe",
    "step3p7",
)
"""Wrappers that take images and video under the ring: their text model attends causally over image tokens (as
over text; Gemma 3's and Gemma 4's also within each image both ways: ``BLOCKS``), so only the embeddings need cutting
after the vision features are merged (``_family.ShardEmbeddings``; ``shard_batch`` keeps such a batch whole)."""


def _runs(types, kinds: tuple) -> torch.Tensor | None:
    """Each run of tokens whose type is in ``kinds`` one block, numbered from 0 per row, -1 elsewhere (Transformers'
    ``get_block_sequence_ids_for_mask``); None without such tokens."""
    if not isinstance(types, torch.Tensor) or types.dim() != 2:
        return None
    inside = torch.isin(types, torch.tensor(kinds, device=types.device))
    if not bool(inside.any()):
        return None
    starts = inside & ~torch.nn.functional.pad(inside, (1, 0))[:, :-1]
    return torch.where(inside, starts.long().cumsum(1) - 1, -1)


def _text_sharded(arguments: dict) -> bool:
    """The forward's input_ids were sharded over several ranks (no images: ``shard_batch`` cut the batch), so a block
    spanning the whole sequence is on no rank whole."""
    info = arguments.get(SHARD_INFO_KWARG)
    return isinstance(info, ShardInfo) and info.world_size > 1 and not info.whole_inputs


def _gemma3_blocks(config, arguments: dict) -> RingBlocks | None:
    """Gemma 3's image blocks (``token_type_ids == 1`` marks image tokens), on every layer."""
    ids = _runs(arguments.get("token_type_ids"), (1,))
    return None if ids is None else RingBlocks(ids)


def _gemma4_blocks(config, arguments: dict) -> RingBlocks | None:
    """Gemma 4's image and video blocks (``mm_token_type_ids`` 1 or 2), on its sliding-window layers only (its
    full-attention layers stay causal, as Transformers masks them), for text configs with
    ``use_bidirectional_attention="vision"`` (the larger checkpoints); the others attend causally over them."""
    if getattr(config.get_text_config(), "use_bidirectional_attention", None) != "vision":
        return None
    ids = _runs(arguments.get("mm_token_type_ids"), (1, 2))
    return None if ids is None else RingBlocks(ids, sliding_only=True)


def _gemma4_unified_blocks(config, arguments: dict) -> RingBlocks | None:
    """Gemma 4 Unified's image and video blocks (``mm_token_type_ids`` 1 or 2) on every layer, for text configs with
    ``use_bidirectional_attention="vision"`` (its default): its forward builds its masks with Transformers'
    ``create_masks_for_generate``, which lets a block's tokens see each other on the full-attention layers too (Gemma
    4's stay causal there).

    Refused (ValueError, alike on every rank: every rank derives this from the same whole batch): a block longer than
    the sliding window. On the sliding layers Transformers lets a block's tokens see each other whatever their distance
    (it ORs the blocks onto the windowed causal mask), where the ring applies the window after the blocks."""
    text = config.get_text_config()
    if getattr(text, "use_bidirectional_attention", None) != "vision":
        return None
    ids = _runs(arguments.get("mm_token_type_ids"), (1, 2))
    if ids is None:
        return None
    beyond = _block_beyond_window(text, ids)
    if beyond is not None:
        raise ValueError(
            f"gemma4_unified: an image or video of {beyond[0]} tokens is longer than the sliding window "
            f"({beyond[1]}): Transformers lets its tokens attend to each other both ways beyond the window on the sliding "
            "layers, which ring attention does not reproduce (it applies the window to the image too); give the "
            "processor a smaller max_soft_tokens"
        )
    return RingBlocks(ids)


def _block_beyond_window(text, ids: torch.Tensor) -> tuple[int, int] | None:
    """``(span, window)`` when the text config has sliding layers and the longest block of ``ids`` (from its first token
    to its last, in one row; -1: no block) spans more tokens than their window, else None: Transformers ORs the blocks
    onto the windowed causal mask there, where the ring applies the window after the blocks."""
    window = getattr(text, "sliding_window", None)
    if window is None or "sliding_attention" not in (getattr(text, "layer_types", None) or ["sliding_attention"]):
        return None
    index = torch.arange(ids.shape[1], device=ids.device)
    longest = 0
    for block in ids.unique().tolist():
        if block >= 0:
            inside = ids == block
            span = torch.where(inside, index, -1).amax(1) - torch.where(inside, index, ids.shape[1]).amin(1) + 1
            longest = max(longest, int(span.max()))
    return (longest, window) if longest > window else None


def _paligemma_blocks(config, arguments: dict) -> RingBlocks | None:
    """PaliGemma's prefix: every token with ``token_type_ids == 0`` (its images and prompt; the suffix, 1, is what
    it learns to write) sees every other one both ways, as Transformers' ``block_sequence_ids`` (one block per row,
    contiguous or not); padding (``attention_mask`` 0) sees nothing. Without ``token_type_ids`` every token attends
    causally (Transformers' mask; ``PaliGemmaPatch`` makes the ring causal).

    Refused (ValueError, alike on every rank: every rank derives this from the same whole batch), where the ring
    would mask otherwise than Transformers: token types of input_ids that were sharded (a text-only batch over
    several ranks: its prefix spans the whole sequence, which no rank holds), and on PaliGemma 2's sliding layers
    a prefix longer than the window (Transformers lets the prefix see itself whatever the distance, OR-ing the
    blocks onto the windowed causal mask; the ring applies the window after the blocks)."""
    types = arguments.get("token_type_ids")
    if not isinstance(types, torch.Tensor) or types.dim() != 2:
        return None
    if _text_sharded(arguments):
        raise ValueError(
            "paligemma: token_type_ids of a batch without images, its input_ids sharded: PaliGemma's prefix "
            "(token_type_ids 0) attends both ways across the whole sequence, which the ring cannot show on shards; "
            "pass the images (shard_batch then keeps the batch whole), or drop token_type_ids for a causal batch"
        )
    prefix = types == 0
    mask = arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == types.shape:
        prefix = prefix & mask.bool()
    if not bool(prefix.any()):
        return None
    ids = torch.where(prefix, 0, -1)
    beyond = _block_beyond_window(config.get_text_config(), ids)
    if beyond is not None:
        raise ValueError(
            f"paligemma: a prefix (token_type_ids 0) of {beyond[0]} tokens is longer than the sliding "
            f"window ({beyond[1]}): Transformers lets it attend both ways beyond the window on the sliding layers, "
            "which ring attention does not reproduce (it applies the window to the prefix too); shorten the "
            "prefix (PaliGemma 2 at 896 px: its 4096 image tokens alone fill Gemma 2's window, so it cannot "
            "train under the ring)"
        )
    return RingBlocks(ids)


def _molmo2_blocks(config, arguments: dict) -> RingBlocks | None:
    """Molmo2's image tokens (``mm_token_type_ids == 1``; its video frames share the image token, so its processor
    marks them 1 too) see each other both ways, all of a row's one block whether contiguous or not (Transformers'
    ``block_sequence_ids``), on every layer.

    Refused (ValueError, alike on every rank), where the ring would mask otherwise: token types marking image tokens
    in a batch whose input_ids were sharded (no pixels, so ``shard_batch`` cut it: the block spans the whole
    sequence, which no rank holds)."""
    types = arguments.get("mm_token_type_ids")
    if not isinstance(types, torch.Tensor) or types.dim() != 2 or not bool((types == 1).any()):
        return None
    if _text_sharded(arguments):
        raise ValueError(
            "molmo2: mm_token_type_ids marking image tokens in a batch without images, its input_ids sharded: "
            "Molmo2's image tokens attend both ways across the whole sequence, which the ring cannot show on shards; "
            "pass the images (shard_batch then keeps the batch whole)"
        )
    return RingBlocks(torch.where(types == 1, 0, -1))


BLOCKS = {"gemma3": _gemma3_blocks, "gemma4": _gemma4_blocks, "gemma4_unified": _gemma4_unified_blocks, "paligemma": _paligemma_blocks,
          "molmo2": _molmo2_blocks}  # fmt: skip
"""Wrappers whose image tokens see each other both ways: how to number their blocks from the forward's arguments."""


LOGIT_TRANSFORMS = {
    "gemma3n": generic.LOGIT_TRANSFORMS["gemma3n_text"],
    "inkling2": generic.LOGIT_TRANSFORMS["inkling2_text"],
    "gemma4": generic.LOGIT_TRANSFORMS["gemma4_text"],
    "cohere_compass": generic.LOGIT_TRANSFORMS["cohere_compass_text"],  # the text config's logit_scale (None: none)
    "aya_vision": LogitTransform(  # the text config's logit_scale where its head applies it (Transformers 5.25 on)
        multiply="logit_scale",
        multiplied_by="transformers.models.aya_vision.modeling_aya_vision.AyaVisionForConditionalGeneration",
    ),
    "hyperclovax_vision_v2": generic.LOGIT_TRANSFORMS["hyperclovax"],  # the text config's logits_scaling
    "muse_spark": LogitTransform(multiply="output_multiplier", softcap="final_logit_softcapping"),
    "muse_glimmer": LogitTransform(multiply="output_multiplier", softcap="final_logit_softcapping"),
    "gemma4_unified": generic.LOGIT_TRANSFORMS["gemma4_unified_text"],
    "paligemma": generic.LOGIT_TRANSFORMS["gemma2"],  # (a Gemma text config has no softcap: none)
    "granite4_vision": generic.LOGIT_TRANSFORMS["granite"],  # its head divides by the text config's logits_scaling
    "granite_docling": generic.LOGIT_TRANSFORMS["granite"],  # (the same)
    "mistral_large4": generic.LOGIT_TRANSFORMS["gemma2"],  # its head softcaps with the text config's cap (always set)
    "chameleon": LogitTransform(masked="model.vocabulary_mapping.image_tokens"),  # image codes: the lowest logit
}
"""What a vision-language head does to the logits, read from the text config (Gemma 4's and PaliGemma 2's heads
softcap them as their text models' do; Gemma 3's does not)."""


def _chameleon_merge(model, kwargs: dict) -> dict:
    """Chameleon's merge, which its text model does in its own forward: the images tokenized by its VQ-VAE, their
    codes embedded and put in place of the image tokens, by the model's own functions; here on the whole sequence,
    so that ``ShardEmbeddings`` cuts the merged embeddings (the images and the embeddings leave the keywords)."""
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if (ids is None) == (embeds is None):  # (neither or both: the model's own error)
        return kwargs
    pixels, encoded = kwargs.pop("pixel_values", None), kwargs.pop("mm_encoder_outputs", None)
    if pixels is not None and encoded is not None:  # (as the model's own forward)
        raise ValueError("You cannot specify both pixel_values and mm_encoder_outputs at the same time")
    kwargs.pop("input_ids", None)
    if embeds is None:
        embeds = model.get_input_embeddings()(ids)
    image = (encoded or {}).get("image")
    if image is None and pixels is not None:
        image = model.get_image_features(pixels, return_dict=True)
    if image is not None:
        features = image.pooler_output
        mask = model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=features)
        embeds = embeds.masked_scatter(mask, features)
    kwargs["inputs_embeds"] = embeds
    return kwargs


MERGES = {"chameleon": _chameleon_merge}
"""Wrappers whose text model merges the images into its embeddings in its own forward: that merge, done before the
cut (``_family.ShardEmbeddings``)."""


DEDICATED = {t: m.PATCH for m in (llama, mistral, qwen2, qwen3) for t in m.PATCH.model_types}
"""The families with a module of their own (``config.model_type`` -> patch): text models of some wrappers here, and
the first part of ``hf_ring.patches.REGISTRY``."""


def _check_step3p5(config) -> None:
    """``generic.check`` (its sparse-indexer layer types refused), and no ``use_bidirectional_attention`` (every token
    attending both ways on full layers, within the window both ways on sliding ones: not causal)."""
    generic.check(config)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "step3p5: use_bidirectional_attention=True (tokens attending both ways) is not supported by ring "
            "attention, which is causal; set it to False"
        )


INNER_CHECKS = {"step3p5": _check_step3p5}
"""Inner text models with a check of their own (else the generic table's: ``generic.CHECKS``, ``generic.check``)."""

INNER = {
    model_type: FamilyPatch(
        name=model_type,
        model_types=(model_type,),
        attention_class=path,
        check_config=INNER_CHECKS.get(model_type, generic.CHECKS.get(model_type, generic.check)),
        sparse=model_type in generic.SPARSE,
        linear_class=generic.LINEAR.get(model_type),
        no_generate=generic.NO_GENERATE.get(model_type),
    )
    for model_type, path in {
        "qwen2_vl_text": "transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLAttention",
        "qwen2_5_vl_text": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLAttention",
        "qwen3_vl_text": "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextAttention",
        "qwen3_vl_moe_text": "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextAttention",
        "glm4v_text": "transformers.models.glm4v.modeling_glm4v.Glm4vTextAttention",
        "glm4v_moe_text": "transformers.models.glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextAttention",
        "glm_ocr_text": "transformers.models.glm_ocr.modeling_glm_ocr.GlmOcrTextAttention",
        "hunyuan_vl_text": "transformers.models.hunyuan_vl.modeling_hunyuan_vl.HunYuanVLDenseV1Attention",
        "paddleocr_vl_text": "transformers.models.paddleocr_vl.modeling_paddleocr_vl.PaddleOCRAttention",
        "qwen2_5_omni_text": "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniAttention",
        "qwen3_omni_moe_text": (
            "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextAttention"
        ),
        "molmo2_text": "transformers.models.molmo2.modeling_molmo2.Molmo2Attention",
        "phi4_multimodal": "transformers.models.phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAttention",
        "chameleon": "transformers.models.chameleon.modeling_chameleon.ChameleonAttention",
        "step3p5": "transformers.models.step3p7.modeling_step3p7.Step3p7Attention",
        "ernie4_5_vl_moe_text": (
            "transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeTextAttention"
        ),
        "granite4_vision_text": (
            "transformers.models.granite4_vision.modeling_granite4_vision.Granite4VisionTextAttention"
        ),
        "mistral_large4_text": "transformers.models.mistral_large4.modeling_mistral_large4.MistralLarge4TextAttention",
        "hy_v4_vl_text": "transformers.models.hy_v4_vl.modeling_hy_v4_vl.HYV4VLAttention",
        "granite_docling_text": "transformers.models.granite_docling.modeling_granite_docling.GraniteDoclingTextAttention",
        "muse_spark_text": "transformers.models.muse_spark.modeling_muse_spark.MuseSparkTextAttention",
        "muse_glimmer_text": "transformers.models.muse_glimmer.modeling_muse_glimmer.MuseGlimmerTextAttention",
        "cosmos3_edge_text": "transformers.models.cosmos3_edge.modeling_cosmos3_edge.Cosmos3EdgeTextAttention",
        "glm5_next_text": "transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextAttention",
    }.items()
}
"""Text models that exist only inside a vision-language model (no causal-LM class of their own): their patch, as
the generic patch's, for the wrapper to use."""


def text_patch(model_type) -> FamilyPatch:
    """The patch of a text family these models hold (its attention class, its config check)."""
    return INNER.get(model_type) or DEDICATED.get(model_type) or generic.PATCHES[model_type]


@dataclasses.dataclass(frozen=True)
class VisionLanguagePatch(FamilyPatch):
    """A vision-language model: the patch of its text config's family does the work, on the text model."""

    text_types: tuple = ()

    def text(self, config) -> FamilyPatch:
        """The text family's patch for the text ``config``; ValueError for a family this wrapper is not known with."""
        kind = getattr(config, "model_type", None)
        if kind not in self.text_types:
            raise ValueError(
                f"{self.name}: hf_ring supports its text model of types {list(self.text_types)}, not {kind!r}"
            )
        return text_patch(kind)

    def attention_modules(self, model) -> list:
        return self.text(model.config.get_text_config()).attention_modules(model)

    def linear_modules(self, model) -> list:
        return self.text(model.config.get_text_config()).linear_modules(model)

    def local_modules(self, model) -> list:
        return self.text(model.config.get_text_config()).local_modules(model)

    def cross_modules(self, model) -> list:
        return self.text(model.config.get_text_config()).cross_modules(model)


CAUSAL_ATTR = "hf_ring_original_is_causal"
"""Attribute of a PaliGemma text attention module holding its own ``is_causal``, restored on revert."""


@dataclasses.dataclass(frozen=True)
class PaliGemmaPatch(VisionLanguagePatch):
    """PaliGemma's config sets ``use_bidirectional_attention=True`` on its text config, so its text attention modules
    say ``is_causal=False``, yet the mask its model builds is causal (with the prefix block, ``_paligemma_blocks``):
    eager attention applies that mask, and SDPA too whenever it is built (token types or padding given; without
    either Transformers skips it and SDPA's flag makes every token attend both ways). The ring reads the flag, so
    while patched the modules say ``is_causal=True``; revert restores theirs."""

    def apply(self, model, cfg):
        model = super().apply(model, cfg)
        for m in self.attention_modules(model) if model is not None else ():
            if not hasattr(m, CAUSAL_ATTR):  # (applied again: the first apply saved the module's own)
                setattr(m, CAUSAL_ATTR, m.is_causal)
            m.is_causal = True
        return model

    def revert(self, model):
        model = super().revert(model)
        for m in self.attention_modules(model):
            if hasattr(m, CAUSAL_ATTR):
                m.is_causal = getattr(m, CAUSAL_ATTR)
                delattr(m, CAUSAL_ATTR)
        return model


OWN_LOSS = ("qwen2_audio", "granite_speech", "granite_speech_plus")
"""Wrappers whose head computes a loss of its own, not Transformers' causal-LM loss: the mean cross-entropy of
``labels`` it shifts itself (filtered by the whole batch's ``attention_mask``), blind to ``shift_labels`` and
``num_items_in_batch``. Under the ring that loss would shift ``shard_batch``'s labels, already shifted, once more
(or fail on the mask of the whole sequence) and average over the rank's own targets: ``OwnLossPatch`` computes
Transformers' causal-LM loss in its place whenever ``shift_labels`` are given."""


class CausalLMLoss:
    """Forward pre-hook and hook (with keywords) of a wrapper in ``OWN_LOSS``: a call with ``shift_labels`` (as
    ``shard_batch`` gives them) runs without its labels, and its output's loss is Transformers' ``ForCausalLMLoss``
    of its logits (the rank's shard of them), ``shift_labels`` and ``num_items_in_batch``: the unmodified model's
    mean loss for one rank's whole batch, its share of it for a rank of the ring. A model under hf_ring's chunked
    loss computes that loss itself, and TRL's fused LM head (``fused_lm_head=True``) scores ``shift_labels`` itself:
    the hook leaves them alone."""

    def __init__(self):
        self.pending = []  # (shift_labels, num_items_in_batch, ignore_index) of each call running

    def before(self, module, args, kwargs):
        from ..loss import is_chunked

        if kwargs.get("shift_labels") is None or kwargs.get("fused_lm_head") or is_chunked(module):
            self.pending.append(None)
            return None
        kwargs = dict(kwargs)
        shift = kwargs.pop("shift_labels")
        kwargs.pop("labels", None)
        count = kwargs.pop("num_items_in_batch", None)
        self.pending.append((shift, count, kwargs.pop("ignore_index", -100)))
        return args, kwargs

    def after(self, module, args, kwargs, output):
        saved = self.pending.pop() if self.pending else None
        if saved is None or output is None:
            return None
        from transformers.loss.loss_utils import ForCausalLMLoss

        shift, count, ignore = saved
        logits = output[0] if isinstance(output, tuple) else output.logits
        loss = ForCausalLMLoss(logits, None, logits.shape[-1], num_items_in_batch=count, ignore_index=ignore,
                               shift_labels=shift)  # fmt: skip
        if isinstance(output, tuple):  # (return_dict=False: no loss in front without labels)
            return (loss, *output)
        return type(output)(**{"loss": loss, **{k: v for k, v in output.items() if k != "loss"}})


@dataclasses.dataclass(frozen=True)
class OwnLossPatch(VisionLanguagePatch):
    """A wrapper in ``OWN_LOSS``: its loss computed by ``CausalLMLoss`` while patched."""

    def apply(self, model, cfg):
        model = super().apply(model, cfg)
        if model is not None:
            remove_hooks(model, CausalLMLoss)
            hook = CausalLMLoss()
            model.register_forward_pre_hook(hook.before, with_kwargs=True)
            model.register_forward_hook(hook.after, with_kwargs=True, always_call=True)
        return model

    def revert(self, model):
        model = super().revert(model)
        remove_hooks(model, CausalLMLoss)
        return model


EXTRA_LOSS = {"granite_docling": "router_labels"}
"""Wrappers whose head adds a loss of its own to the language-model loss when given these labels, computed on every
rank from the whole batch's images (Granite Docling's density router): each rank of the ring would add it to its
share of the loss, counting it once per rank. ``ExtraLossPatch`` refuses such a call over several ranks."""


class RefuseExtraLoss:
    """Forward pre-hook (with keywords) of a wrapper in ``EXTRA_LOSS``: a call given the labels of its extra loss
    raises when the batch was sharded over several ranks (or the ring has several), on every rank alike (each has the
    same whole batch), before anything runs."""

    def __init__(self, name: str, keyword: str, cfg):
        self.name = name
        self.keyword = keyword
        self.cfg = cfg  # (the model's RingConfig, not its group: a deep copy shares it, pickling drops the group)

    def __call__(self, module, args, kwargs) -> None:
        from ..comm import group_rank_and_size

        if kwargs.get(self.keyword) is None:
            return
        info = kwargs.get(SHARD_INFO_KWARG)
        world = info.world_size if isinstance(info, ShardInfo) else group_rank_and_size(self.cfg.group)[1]
        if world > 1:
            raise ValueError(
                f"{self.name}: {self.keyword} add a loss of the whole batch's images to the language-model loss on "
                f"every rank, which the ring's {world} ranks would count {world} times: train that loss without "
                f"context parallelism, or leave {self.keyword} out"
            )


@dataclasses.dataclass(frozen=True)
class ExtraLossPatch(VisionLanguagePatch):
    """A wrapper in ``EXTRA_LOSS``: a call with its extra loss's labels refused over several ranks while patched."""

    def apply(self, model, cfg):
        model = super().apply(model, cfg)
        if model is not None:
            remove_hooks(model, RefuseExtraLoss)
            model.register_forward_pre_hook(RefuseExtraLoss(self.name, EXTRA_LOSS[self.name], cfg), with_kwargs=True)
        return model

    def revert(self, model):
        model = super().revert(model)
        remove_hooks(model, RefuseExtraLoss)
        return model


INHERITED = ("lend_attention_kwargs", "no_generate", "cache_class", "sparse")
"""What a wrapper's patch takes from its text family's (every text type it may hold agrees on them: tested): how its
attention modules get the batch's keywords, whether ring_generate refuses it and which cache it takes, DeepSeek sparse
attention. (The mixers' lending, which depends on the model's nesting, is not inherited: no wrapper's text family
lends them.)"""


def _check(config, *, wrapper: str) -> None:
    """The text family's check, on the text config."""
    patch = PATCHES[wrapper]
    patch.text(config).check_config(config)


PATCHES = {
    model_type: (
        PaliGemmaPatch
        if model_type == "paligemma"
        else OwnLossPatch
        if model_type in OWN_LOSS
        else ExtraLossPatch
        if model_type in EXTRA_LOSS
        else VisionLanguagePatch
    )(
        name=model_type,
        model_types=(model_type,),
        attention_class=text_patch(types[0]).attention_class,  # (for messages; the text config's family decides)
        check_config=functools.partial(_check, wrapper=model_type),
        logit_transform=LOGIT_TRANSFORMS.get(model_type),
        media=MEDIA,
        images=model_type in IMAGES,
        block_ids=BLOCKS.get(model_type),
        merge=MERGES.get(model_type),
        text_types=types,
        loss_skips_padding=model_type in OWN_LOSS,
        **{field: getattr(text_patch(types[0]), field) for field in INHERITED},
    )
    for model_type, types in WRAPPERS.items()
}
"""``config.model_type`` of the vision-language model -> its ``VisionLanguagePatch``."""
