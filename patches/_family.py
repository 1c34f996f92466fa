"""What every model family patch does, written once: find the attention modules, switch them to hf_ring, revert.

A ``FamilyPatch`` describes one family (its ``config.model_type`` values, its attention class and a
config check). ``apply`` registers hf_ring in Transformers' ``AttentionInterface`` /
``AttentionMaskInterface``, gives every attention module its ``RingConfig`` and switches the model
with ``set_attn_implementation``; ``revert`` restores the implementation the model had before, so its
outputs are bit-identical to the unpatched model. A model that was already ``"hf_ring"`` when first
patched (loaded with ``attn_implementation="hf_ring"``) has no other implementation to go back to:
revert then switches it to ``"sdpa"``. Nothing private in Transformers is overwritten.

Plans: ``apply`` gives the model's ``RingConfig`` a ``PlanCache`` and registers a forward pre-hook
(``StartBatch``) on the model and on every ``PreTrainedModel`` inside it (a causal-LM head and its
base model), which calls ``new_batch()``: the first attention call of each forward checks the batch
across ranks, the other layers and the backward reuse its plan, and a forward hook (``EndBatch``, run even
when the forward raises) tells the plan cache how the forward ended (``hf_ring.guard``: a forward that fails
after its first ring exchange stops the CP group; a successful one watches for its backward). Revert removes
the hooks.

RoPE types whose frequencies follow the largest position id (``dynamic``, ``longrope``) get that position of the
whole CP group (``_rope``): their rotary modules' ``forward`` is replaced while the model is patched.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable

import torch

from ..batch import carries
from ..comm import group_rank_and_size
from ..guard import in_backward
from ..hf_attention import (
    ATTN_IMPLEMENTATION,
    BATCH_DOCUMENT_KWARGS,
    BLOCK_IDS_KWARG,
    CONFIG_ATTR,
    LOCAL_ATTR,
    POSITIONS_KWARG,
    SHARD_INFO_KWARG,
    RingConfig,
    ShardInfo,
    register,
)
from ..layout import shard
from ..ring import PlanCache
from . import (
    _compressed,
    _lend,
    _mask_positions,
    _own,
    _relative,
    _rope,
    _router,
    _shared_kv,
    _sparse,
    _split_vision,
    _temperature,
    linear,
)
from ._hooks import named_arguments, remove_hooks
from ._neftune import NoiseScale

__all__ = [
    "BlockIds",
    "EndBatch",
    "FamilyPatch",
    "LogitTransform",
    "ORIGINAL_ATTR",
    "ShardEmbeddings",
    "StartBatch",
    "TextOnly",
    "is_applied",
]

ORIGINAL_ATTR = "hf_ring_original_attn_implementation"
"""Attribute of a patched model holding the attention implementation to restore on revert."""

FALLBACK_ATTN_IMPLEMENTATION = "sdpa"
"""What revert switches to when the model was ``"hf_ring"`` before the first apply."""


def _class(path: str) -> type:
    """The class at dotted ``path`` ("transformers.models.llama.modeling_llama.LlamaAttention")."""
    module, _, cls = path.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def _reads(path: str, name: str) -> bool:
    """Whether the ``forward`` of the class at ``path`` (as it is now, unwrapped from its decorators) reads an attribute
    ``name``, in its own body or in code nested in it (a comprehension, a lambda)."""
    return name in _names(inspect.unwrap(_class(path).forward).__code__)


@functools.cache
def _names(code) -> frozenset:
    """The names a code object and the code objects nested in it read."""
    nested = (_names(c) for c in code.co_consts if isinstance(c, type(code)))
    return frozenset(code.co_names).union(*nested)


def _no_check(config) -> None:
    return None


def check_window(config, what: str) -> None:
    """ValueError unless ``config.sliding_window`` is None or a positive integer."""
    w = getattr(config, "sliding_window", None)
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
        raise ValueError(f"{what}: config.sliding_window must be None or a positive integer, got {w!r}")


def check_layer_types(config, what: str, allowed=("full_attention", "sliding_attention"), window: bool = True) -> None:
    """ValueError unless every ``config.layer_types`` entry is one hf_ring implements (and, with ``window``, the
    window is valid)."""
    if window:
        check_window(config, what)
    types = list(getattr(config, "layer_types", None) or [])
    unknown = sorted(set(types) - set(allowed))
    if unknown:
        raise ValueError(f"{what}: layer types {unknown} are not supported; hf_ring supports {list(allowed)}")
    if "sliding_attention" in types and getattr(config, "sliding_window", None) is None:
        raise ValueError(f"{what}: config.layer_types has sliding_attention layers but config.sliding_window is None")


def is_applied(model) -> bool:
    return hasattr(model, ORIGINAL_ATTR)


class StartBatch:
    """Forward pre-hook: a new forward begins, so its plans are checked across ranks again; notes whether the
    batch carries document ids or packing keywords (``PlanCache.batch_documents``) and its ``position_ids``
    (``ring_position_ids``, beside the model's keywords). ``top``: the hook of the
    outermost model, which sets the note anew (an interrupted forward leaves nothing behind); the inner
    models' hooks only add to it."""

    def __init__(self, plans: PlanCache, top: bool = False):
        self.plans = plans
        self.top = top

    def __call__(self, module, args, kwargs) -> None:
        if not in_backward():  # a checkpointed model recomputing inside the backward is not a new batch
            self.plans.new_batch()
            # (after new_batch: a forward it refuses never began; the outermost model starts the count anew, so a
            # forward interrupted without its closing hook leaves nothing behind)
            progress = self.plans.progress
            progress.depth = 1 if self.top else progress.depth + 1
            carried = any(kwargs.get(k) is not None for k in BATCH_DOCUMENT_KWARGS)
            self.plans.batch_documents = carried or (not self.top and self.plans.batch_documents)
        # the call's position_ids, also as a keyword of hf_ring's own that travels with the model's keywords to every
        # attention layer (recomputed ones too): a family whose layers do not pass position_ids on (Llama 4,
        # StarCoder 1, Dory) still shows the attention its positions. An inner model's (cut to the shard) replace
        # the outer one's.
        pos = named_arguments(module, args, kwargs).get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.dim() == 2 and _takes_keywords(type(module)):
            return args, {**kwargs, POSITIONS_KWARG: pos}
        return None


@functools.cache
def _takes_keywords(cls) -> bool:
    """``cls.forward`` takes ``**kwargs`` (a model that passes its keywords on to its layers)."""
    params = inspect.signature(cls.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class EndBatch:
    """Forward hook, run even when the forward raises: tells the plan cache's ``Progress`` how it ended."""

    def __init__(self, plans: PlanCache):
        self.plans = plans

    def __call__(self, module, args, output) -> None:
        if not in_backward():
            self.plans.batch_documents = False
            self.plans.progress.end_forward(output)


class BlockIds:
    """Forward pre-hook (with keywords) of a vision-language model whose image tokens attend to each other both ways
    (Gemma 3, Gemma 4): ``derive(config, arguments)`` gives the batch's ``RingBlocks`` (Transformers'
    ``block_sequence_ids``: one id per image, -1 for other tokens; the layers that take them) or None, and the hook
    passes them on as ``ring_block_ids``, which reach every attention layer with the model's keywords
    (``ring_attention``'s ``block_ids``). They number the whole sequence: ``shard_batch`` keeps an image batch whole. Derived once per
    forward, at the outermost level (the inner model receives them with the keywords)."""

    def __init__(self, derive: Callable):
        self.derive = derive

    def __call__(self, module, args, kwargs):
        if kwargs.get(BLOCK_IDS_KWARG) is not None:  # (also when recomputed in the backward: the ids are pure)
            return None
        ids = self.derive(module.config, named_arguments(module, args, kwargs))
        if ids is None:
            return None
        return args, {**kwargs, BLOCK_IDS_KWARG: ids}


class TextOnly:
    """Forward pre-hook of a vision-language model whose text model is patched: a call with images, video or audio
    (the family's ``media`` keywords, or ``token_type_ids`` / ``mm_token_type_ids`` marking image tokens) raises, on
    every rank alike, before anything runs.

    ``images``: the family takes images and video under the ring (its text model attends causally over image
    tokens, or both ways within an image: ``BlockIds``; ``ShardEmbeddings``); a batch carrying them must then come
    whole from ``shard_batch`` (``ShardInfo.whole_inputs``) whenever ``group`` (the ring's) has more than one rank,
    else it raises: inputs cut some other way would leave each rank's image tokens and features unmatched, and only
    some ranks would raise. Gemma 4's audio (``input_features``) goes the same way as its images.

    ``cross``: the images reach the text model by cross-attention (Mllama), not as tokens, so the text is sharded
    as any text (``shard_batch`` does so for a batch with a ``cross_attention_mask``) and the images go whole to
    every rank; a batch made whole for the model to cut (``ShardInfo.whole_inputs``) raises."""

    def __init__(self, name: str, media: tuple, images: bool = False, cfg=None, cross: bool = False):
        self.name = name
        self.media = media
        self.images = images
        self.cfg = cfg  # (the model's RingConfig, not its group: a deep copy shares it, pickling drops the group)
        self.cross = cross

    def __call__(self, module, args, kwargs) -> None:
        named = named_arguments(module, args, kwargs)
        given = [k for k in self.media if carries(named.get(k))]
        if self.images and self.cross:
            info = named.get(SHARD_INFO_KWARG)
            if given and isinstance(info, ShardInfo) and info.whole_inputs:
                raise ValueError(
                    f"{self.name}: the batch carries {', '.join(given)} without a cross_attention_mask, so shard_batch "
                    "kept its input_ids whole; this model's images enter by cross-attention: pass the batch as its "
                    "processor makes it, cross_attention_mask included, and shard_batch shards the text"
                )
            return
        if self.images:
            info = named.get(SHARD_INFO_KWARG)
            group = None if self.cfg is None else self.cfg.group
            whole = info.whole_inputs if isinstance(info, ShardInfo) else group_rank_and_size(group)[1] == 1
            if given and not whole:
                raise ValueError(
                    f"{self.name}: the batch carries {', '.join(given)} but its input_ids were sharded: pass the whole "
                    "batch, images included, to hf_ring.shard_batch (or the plugin's DataLoader), which keeps the "
                    "inputs of a batch with images whole for the model to shard after merging the image features"
                )
            return
        for key in ("token_type_ids", "mm_token_type_ids"):  # Gemma 3's; Gemma 4's
            types = named.get(key)
            if isinstance(types, torch.Tensor) and bool((types != 0).any()):
                given.append(f"{key} marking image tokens")
        if given:
            raise ValueError(
                f"hf_ring patches the text model of this {self.name} model and runs text-only batches; the batch "
                f"carries {', '.join(given)}: images, video or audio are not supported under ring attention for "
                "this family"
            )


class Refuse:
    """Forward pre-hook (with keywords) of a family's model levels: ``why(config, arguments)`` names what of the call
    the family does not support under ring attention (a keyword given, the same on every rank), raised before
    anything runs; None: nothing."""

    def __init__(self, why: Callable):
        self.why = why

    def __call__(self, module, args, kwargs) -> None:
        problem = self.why(module.config, named_arguments(module, args, kwargs))
        if problem:
            raise ValueError(problem)


class ShardEmbeddings:
    """Forward pre-hook (with keywords) of the text model of a vision-language model that takes images under the
    ring. For a batch ``shard_batch`` left whole (``ShardInfo.whole_inputs``: it has images or video) the model has
    merged the vision features into the embeddings of the whole sequence and computed its positions (multimodal
    RoPE) there; this cuts ``inputs_embeds`` and ``position_ids`` (arange when the model passes None, 0 for the
    layout's padding) to the rank's shard, drops ``attention_mask`` (the padding reaches the attention as document
    ids), cuts Gemma 4's ``per_layer_inputs``, Qwen4-Exp's ``ple_input_ids``, ERNIE-4.5-VL's ``moe_mm_token_type_ids`` (which experts each
    token goes to) and, for Qwen3-VL's deepstack, cuts ``visual_pos_masks`` and picks the
    rank's rows of ``deepstack_visual_embeds`` (Granite 4 Vision's: ``vision_mask`` and each layer's
    ``deepstack_features``).
    The cut is an index (``layout.shard``), so gradients flow back to the embeddings and the vision tower.
    ``merge``: a text model that merges the images into its embeddings in its own forward (Chameleon: images as
    codes of its own vocabulary) has that merge done here, on the whole sequence, before the cut."""

    def __init__(self, merge: Callable | None = None):
        self.merge = merge  # ``(text model, keywords) -> keywords``: the family's own merge, ahead of the cut

    def __call__(self, module, args, kwargs):
        info = kwargs.get(SHARD_INFO_KWARG)
        if not isinstance(info, ShardInfo) or not info.whole_inputs:
            return None
        if self.merge is not None and not args:
            kwargs = self.merge(module, dict(kwargs))
        embeds = kwargs.get("inputs_embeds")
        if args or not isinstance(embeds, torch.Tensor) or embeds.shape[1] != info.seq_len:
            got = "positional arguments" if args else getattr(embeds, "shape", None)
            raise ValueError(
                f"{type(module).__name__}: expected the whole sequence's inputs_embeds [batch, {info.seq_len}, hidden] "
                f"as a keyword from its vision-language model, got {got}"
            )

        def cut(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return shard(x, dim=dim % x.dim(), rank=info.rank, world_size=info.world_size, layout=info.layout)

        kwargs = dict(kwargs)
        pos = kwargs.get("position_ids")
        # None: arange, the layout's padding at position 0 as shard_batch gives it (the largest stays the batch's)
        if pos is None:
            pos = torch.arange(info.seq_len, device=embeds.device)
            pos[info.seq_len - info.pad :] = 0
            pos = pos.expand(embeds.shape[0], -1)
        kwargs["position_ids"] = cut(pos)  # [batch, seq] or multimodal [3 or 4, batch, seq]
        kwargs["inputs_embeds"] = cut(embeds, dim=1)
        kwargs["attention_mask"] = None
        routes = kwargs.get("moe_mm_token_type_ids")
        if isinstance(routes, torch.Tensor) and routes.dim() == 2:  # ERNIE-4.5-VL: each token's experts (text, vision)
            kwargs["moe_mm_token_type_ids"] = cut(routes)
        per_layer = kwargs.get("per_layer_inputs")
        if isinstance(per_layer, torch.Tensor):  # Gemma 4: [batch, seq, layers, dim], from the whole input_ids
            kwargs["per_layer_inputs"] = cut(per_layer, dim=1)
        ple_ids = kwargs.get("ple_input_ids")
        if isinstance(ple_ids, torch.Tensor):  # Qwen4-Exp: the whole input_ids, for its per-layer n-gram embeddings
            kwargs["ple_input_ids"] = cut(ple_ids)
        visual = kwargs.get("visual_pos_masks")
        if visual is not None:  # Qwen3-VL: rows of deepstack features, one per image token of the whole batch
            rows = (visual.flatten().long().cumsum(0) - 1).view(visual.shape)
            mine = cut(visual)
            kwargs["visual_pos_masks"] = mine
            take = cut(rows)[mine]
            kwargs["deepstack_visual_embeds"] = [e[take.to(e.device)] for e in kwargs["deepstack_visual_embeds"]]
        deepstack = kwargs.get("deepstack_features")
        if isinstance(deepstack, dict) and deepstack:  # Granite 4 Vision: {text layer: rows, one per image token}
            mask = kwargs["vision_mask"]  # [batch, seq, 1]
            tokens = mask[..., 0]
            rows = (tokens.flatten().long().cumsum(0) - 1).view(tokens.shape)
            take = cut(rows)[cut(tokens)]
            kwargs["vision_mask"] = cut(mask, dim=1)
            kwargs["deepstack_features"] = {layer: f[take.to(f.device)] for layer, f in deepstack.items()}
        return args, kwargs


def _switch(model, implementation: str, own: bool = False) -> None:
    """``set_attn_implementation`` for the text model only (a vision-language model's vision tower keeps its own;
    DBRX's attention and FFN sub-configs, parts of its own config, keep theirs). ``own``: a family whose attention
    modules compute attention themselves (``patches._own``), which Transformers does not switch: its config says
    the implementation, which its causal mask follows (``hf_attention.ring_mask_function``)."""
    config = model.config
    text = config.get_text_config()
    if own:
        text._attn_implementation = {"": implementation}  # (its sub-configs keep theirs: MPT's attention config)
        return
    if text is config:
        model.set_attn_implementation({"": implementation})
        return
    key = next((k for k in config.sub_configs if getattr(config, k, None) is text), None)
    if key is None:
        raise ValueError(
            f"{type(model).__name__}: its text config is not one of its sub-configs {list(config.sub_configs)}"
        )
    model.set_attn_implementation({key: implementation})


def _set_hooks(
    model, plans: PlanCache | None, text_only: TextOnly | None = None, blocks: BlockIds | None = None,
    merge: Callable | None = None, refuse: Refuse | None = None,
):  # fmt: skip
    """Remove hf_ring's pre-hooks from the model's ``PreTrainedModel`` modules; add new ones for ``plans`` (and
    ``text_only``, ``blocks`` and ``refuse`` on the outermost model and the inner ones sharing its config; for a
    family that takes images, ``ShardEmbeddings`` on its text model, with the family's ``merge``)."""
    from transformers import PreTrainedModel

    top = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    cuts = text_only is not None and text_only.images and not text_only.cross  # (cross-attention: the text sharded)
    text = top.config.get_text_config() if cuts else None
    # the innermost module of the text config inside the wrapper cuts (Llama 4: the text model inside its causal LM,
    # which passes the embeddings on by keyword), so the hidden states it returns are the shard's
    inner = [m for m in model.modules() if isinstance(m, PreTrainedModel) and m is not top and m.config is text]
    cutter = inner[-1] if text is not None and inner else None
    for m in model.modules():
        if not isinstance(m, PreTrainedModel):
            continue
        remove_hooks(m, (StartBatch, EndBatch, TextOnly, ShardEmbeddings, BlockIds, NoiseScale, Refuse))
        if plans is not None:
            m.register_forward_pre_hook(StartBatch(plans, top=m is top), with_kwargs=True)
            m.register_forward_hook(EndBatch(plans), always_call=True)
            if m is top:  # (NEFTune's noise: the unsharded batch's magnitude)
                scale = NoiseScale()
                m.register_forward_pre_hook(scale.before, with_kwargs=True)
                m.register_forward_hook(scale.after, always_call=True)
            if blocks is not None and m.config is top.config:  # (after TextOnly, prepended below: it runs first)
                m.register_forward_pre_hook(blocks, with_kwargs=True, prepend=True)
            if text_only is not None and m.config is top.config:  # every level that takes images (not the tower)
                m.register_forward_pre_hook(text_only, with_kwargs=True, prepend=True)
            if refuse is not None and m.config is top.config:
                m.register_forward_pre_hook(refuse, with_kwargs=True, prepend=True)
            if m is cutter:  # the text model inside the wrapper
                m.register_forward_pre_hook(ShardEmbeddings(merge), with_kwargs=True, prepend=True)


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """What a causal-LM head does to the lm_head output before the loss, named by config attributes:
    multiply by ``config.<multiply>``, divide by ``config.<divide>``, then ``cap * tanh(logits / cap)`` with
    ``cap = config.<softcap>`` when that is set; last, the logits of the token ids at ``model.<masked>`` set to the
    dtype's lowest value (Chameleon's image codes, which its head never predicts) (``hf_ring.apply_chunked_loss``
    applies it)."""

    multiply: str | None = None
    divide: str | None = None
    softcap: str | None = None
    # the head class whose forward must read ``multiply`` for it to apply (Aya Vision's: from Transformers 5.25 on;
    # before, its head left the logits unscaled though its text config has a scale); None: always applies
    multiplied_by: str | None = None
    masked: str | None = None  # a dotted attribute path on the causal LM: the token ids whose logits are masked

    def masked_ids(self, model) -> list | None:
        """The token ids whose logits the head masks, or None."""
        if not self.masked:
            return None
        for name in self.masked.split("."):
            model = getattr(model, name)
        return list(model)

    def scale(self, config) -> float:
        """The logit scale as one factor (1.0: none)."""
        applies = self.multiply and (self.multiplied_by is None or _reads(self.multiplied_by, self.multiply))
        factor = getattr(config, self.multiply, None) if applies else None
        factor = 1.0 if factor is None else float(factor)  # (a config may leave the scale unset: none)
        return factor / float(getattr(config, self.divide)) if self.divide else factor

    def cap(self, config) -> float | None:
        """The final softcap, or None."""
        return getattr(config, self.softcap, None) if self.softcap else None


@dataclasses.dataclass(frozen=True)
class FamilyPatch:
    """One model family: which configs it covers, which modules it patches, what it checks."""

    name: str
    model_types: tuple
    # "transformers.models.llama.modeling_llama.LlamaAttention"; None: a model without attention layers (Mamba2:
    # its ``linear_class`` modules only, and no attention implementation to switch)
    attention_class: str | tuple | None
    check_config: Callable = _no_check
    # what the family's causal-LM head does to the lm_head output before the loss (final logit softcapping,
    # logit scales); None: nothing (``hf_ring.apply_chunked_loss`` uses it)
    logit_transform: LogitTransform | None = None
    # the family's decoder layers call their attention without the model's keyword arguments (Nemotron, StableLM):
    # each layer lends its attention those of its own call (``patches._lend``), so the document ids, the shard and
    # ring_generate's sharded KV cache arrive
    lend_attention_kwargs: bool = False
    # a vision-language model (its text model of a supported family is patched, nothing else): the keywords that
    # carry images or video into its forward, refused (``TextOnly``) unless ``images``; () for text models
    media: tuple = ()
    # the vision-language model takes images and video under the ring: its text model attends causally over image
    # tokens (or both ways within an image: ``block_ids``), and its embeddings are cut to the shard after the merge
    # (``ShardEmbeddings``)
    images: bool = False
    # ``(config, arguments) -> [batch, seq] ids or None``: the bidirectional blocks of a batch (Gemma 3's images;
    # ``BlockIds``); None: the family's attention is causal over every token
    block_ids: Callable | None = None
    # ``(text model, keywords) -> keywords``: a text model that merges the images into its embeddings in its own
    # forward has it done by ``ShardEmbeddings`` before the cut (Chameleon); None: the wrapper merges them
    merge: Callable | None = None
    # the family's linear-attention, Mamba2 or short-convolution class (hybrid models: ``generic.LINEAR``; or a tuple
    # of them: Qwen4-Exp's Gated DeltaNet and per-layer embedding), whose modules' forward ``patches.linear``
    # replaces while the model is patched; None: attention layers only
    linear_class: str | tuple | None = None
    # where the family's linear-attention modules, called with the mask but without the batch's keywords, get them
    # (``patches.linear``): "layer", from the decoder layer holding each (Jamba); "model", from the model (the pure
    # Mamba models, whose backbone passes the mask on only); "base", from the model to its base model, which unpacks
    # them into its own call (Mamba2); None: their own call has them
    lend_mixer_kwargs: str | None = None
    # why ``ring_generate`` refuses the family (its model manages its KV cache in a way the sharded cache does not
    # follow), or None
    no_generate: str | None = None
    # the cache class the family's model takes and no other (MiniMax: MiniMaxCache), which ring_generate's sharded
    # cache then subclasses (behaving as the sharded cache); None: any Transformers Cache
    cache_class: str | None = None
    # DeepSeek sparse attention: the family's attention modules have an indexer, whose top-k the attention function
    # takes over the whole sequence (``patches._sparse``, ``hf_ring.sparse``)
    sparse: bool = False
    # DeepSeek-V4's compressed attention: the family's attention modules have a compressor, whose entries of the whole
    # sequence the attention function computes and gathers (``patches._compressed``, ``hf_ring.compressed``)
    compressed: bool = False
    # the family's cross-attention class (Mllama's, attending to image features that every rank holds whole): its
    # modules attend locally, by the implementation the model had (``hf_attention.LOCAL_ATTR``); a vision-language
    # family with one takes its images beside sharded text (``TextOnly.cross``); None: no cross-attention
    local_attention_class: str | tuple | None = None
    # the local modules are cross-attention to features every rank holds whole (Mllama's); False: attention of each
    # token over states of its own (Inkling 2's attention residuals over blocks of layers), nothing to do with images
    local_is_cross: bool = True
    # the family's head computes a loss of its own over the targets that are not padding (``attention_mask`` 0), a
    # plain mean (Qwen2-Audio, Granite Speech): ``hf_ring.apply_chunked_loss`` skips those targets too when the call
    # gives ``labels`` (``shard_batch``'s ``shift_labels`` have them ignored already)
    loss_skips_padding: bool = False
    # the family's decoder class, whose model numbers its tokens from the attention mask (OPT: padding in front
    # shifts them), given that numbering from the batch's document ids (``patches._mask_positions``); None:
    # its model numbers them 0, 1, ... as shard_batch does
    mask_positions: str | None = None
    # the family's model class, which makes an all-ones attention mask when given none (BioGPT): its attention
    # function drops a mask without padding, and the model refuses a caller's mask where that function would
    # (``patches._mask_positions.CallerMask``); None: the model passes a mask only when given one
    makes_a_mask: str | None = None
    # ``(config, arguments) -> str or None``: what of a call the family does not support under the ring (a keyword
    # given; ``Refuse``), raised on every rank before anything runs; None: nothing beyond the common checks
    refuse: Callable | None = None
    # the family's attention modules compute attention themselves (Falcon, GPT-Neo, BLOOM, MPT), not
    # through Transformers'
    # AttentionInterface: their ``forward`` is replaced while patched by ``patches._own.FORWARDS[own_attention]``, and
    # the model hands the batch's keywords to its layers through its causal mask (``patches._lend.HandOver``)
    own_attention: str | None = None

    def cache_type(self) -> type | None:
        return None if self.cache_class is None else _class(self.cache_class)

    def attention_type(self) -> type | tuple:
        """The attention class (or classes: Inkling 2's sliding and full ones)."""
        if isinstance(self.attention_class, tuple):
            return tuple(_class(path) for path in self.attention_class)
        return _class(self.attention_class)

    def attention_modules(self, model: torch.nn.Module) -> list:
        if self.attention_class is None:
            return []
        cls = self.attention_type()
        return [m for m in model.modules() if isinstance(m, cls)]

    def cross_modules(self, model: torch.nn.Module) -> list:
        """The model's cross-attention modules: its local modules, when they are cross-attention."""
        return self.local_modules(model) if self.local_is_cross else []

    def local_modules(self, model: torch.nn.Module) -> list:
        """The model's cross-attention modules (none for a family without ``local_attention_class``)."""
        if self.local_attention_class is None:
            return []
        paths = self.local_attention_class
        cls = tuple(_class(path) for path in ((paths,) if isinstance(paths, str) else paths))
        return [m for m in model.modules() if isinstance(m, cls)]

    def linear_modules(self, model: torch.nn.Module) -> list:
        """The model's linear-attention modules (none for a family without ``linear_class``)."""
        if self.linear_class is None:
            return []
        paths = (self.linear_class,) if isinstance(self.linear_class, str) else self.linear_class
        cls = tuple(_class(path) for path in paths)
        return [m for m in model.modules() if isinstance(m, cls)]

    def _check_model(self, model) -> None:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            raise TypeError(
                f"expected a transformers PreTrainedModel of the {self.name} family, got {type(model).__name__}"
            )
        model_type = getattr(model.config, "model_type", None)
        if model_type not in self.model_types:
            raise ValueError(
                f"the {self.name} patch covers model types {list(self.model_types)}, not {model_type!r}; "
                "use hf_ring.apply_ring_attention(model), which picks the family from config.model_type"
            )

    def apply(self, model: torch.nn.Module | None, cfg: RingConfig):
        """Switch ``model`` to ring attention (in place) and return it; with ``model=None`` only register.

        The implementation to restore on revert is remembered at the first apply; ``"sdpa"`` if the model
        was already ``"hf_ring"`` (loaded with ``attn_implementation="hf_ring"``).
        """
        register()
        if model is None:
            return None
        self._check_model(model)
        text = model.config.get_text_config()  # the model's own config, but for a vision-language model
        rotaries = _rope.check(model, self.name)
        self.check_config(text)
        _router.check(model)
        modules = self.attention_modules(model)
        mixers = self.linear_modules(model)
        if not (modules if self.attention_class else mixers):
            path = self.attention_class or self.linear_class
            what = (path if isinstance(path, str) else path[0]).rpartition(".")[2]
            raise ValueError(f"found no {what} module in {type(model).__name__}")
        linear.check(mixers)
        if self.own_attention:
            _own.check(model, modules, self.own_attention)
        original = getattr(model, ORIGINAL_ATTR, text._attn_implementation)
        if original == ATTN_IMPLEMENTATION:  # loaded with attn_implementation="hf_ring"
            original = FALLBACK_ATTN_IMPLEMENTATION
        if self.attention_class is not None:  # (a model without attention keeps its implementation)
            _switch(model, ATTN_IMPLEMENTATION, own=bool(self.own_attention))
            if text._attn_implementation != ATTN_IMPLEMENTATION:
                raise ValueError(
                    f"{type(model).__name__} did not accept attn_implementation={ATTN_IMPLEMENTATION!r} "
                    "(it does not dispatch attention through transformers.AttentionInterface)"
                )
        if cfg.plans is None or cfg.mixers != bool(mixers):
            cfg = dataclasses.replace(cfg, plans=cfg.plans or PlanCache(), mixers=bool(mixers))
        for m in (*modules, *mixers):  # (ring_generate finds the config on any of them)
            setattr(m, CONFIG_ATTR, cfg)
        for m in self.local_modules(model):
            setattr(m, LOCAL_ATTR, original)
        _rope.remove(model)
        _rope.install(rotaries, cfg)
        _temperature.remove(model)
        _temperature.install(modules)
        _relative.remove(model)
        _relative.install(modules)
        _shared_kv.install(model)
        _sparse.remove(model)
        if self.sparse:
            _sparse.install(modules)
        _compressed.remove(model)
        if self.compressed:
            _compressed.install(modules)
        _lend.remove(model)
        if self.lend_attention_kwargs:
            _lend.install(model, modules)
        _mask_positions.remove(model)
        if self.mask_positions:
            decoder = _class(self.mask_positions)
            _mask_positions.install([m for m in model.modules() if isinstance(m, decoder)])
        if self.makes_a_mask:
            maker = _class(self.makes_a_mask)
            _mask_positions.install_refusal([m for m in model.modules() if isinstance(m, maker)], cfg)
        linear.remove(model)
        linear.install(model, mixers, cfg, lend=self.lend_mixer_kwargs)  # (after _lend.remove: its hooks too)
        cross = bool(self.cross_modules(model))
        text_only = TextOnly(self.name, self.media, self.images, cfg, cross=cross) if self.media else None
        cfg.plans.progress.group = cfg.group  # (its refusals' reach: hf_ring.guard.Progress.refused)
        blocks = BlockIds(self.block_ids) if self.block_ids else None
        _set_hooks(model, cfg.plans, text_only, blocks, self.merge, Refuse(self.refuse) if self.refuse else None)
        _own.remove(model)
        if self.own_attention:  # (after _set_hooks: the hand-over sees the positions StartBatch adds)
            _own.install(modules, self.own_attention)
            _lend.hand_over(model)
        if self.images and not cross:  # (the images of a batch reach every rank whole: each encodes its share)
            _split_vision.install(model, cfg)  # (in place of the encoders an earlier apply installed)
        else:
            _split_vision.remove(model)
        _router.install(model, cfg)  # (last: its pre-hook reads the keywords the others leave)
        setattr(model, ORIGINAL_ATTR, original)
        return model

    def revert(self, model: torch.nn.Module):
        """Restore the attention ``model`` had before ``apply`` (in place) and return it."""
        self._check_model(model)
        if not is_applied(model):
            raise ValueError(
                f"{type(model).__name__} has no ring attention to revert (apply_ring_attention was not called "
                "on it, or it was reverted already)"
            )
        if self.attention_class is not None:
            _switch(model, getattr(model, ORIGINAL_ATTR), own=bool(self.own_attention))
        for m in (*self.attention_modules(model), *self.linear_modules(model)):
            if hasattr(m, CONFIG_ATTR):
                delattr(m, CONFIG_ATTR)
        for m in self.local_modules(model):
            if hasattr(m, LOCAL_ATTR):
                delattr(m, LOCAL_ATTR)
        _rope.remove(model)
        _temperature.remove(model)
        _relative.remove(model)
        _shared_kv.remove(model)
        _sparse.remove(model)
        _compressed.remove(model)
        _lend.remove(model)
        _mask_positions.remove(model)
        _own.remove(model)
        linear.remove(model)
        _split_vision.remove(model)
        _router.remove(model)
        _set_hooks(model, None)
        delattr(model, ORIGINAL_ATTR)
        return model
