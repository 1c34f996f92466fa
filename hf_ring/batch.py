"""``shard_batch`` (a collator's full-sequence batch -> this rank's model kwargs) and ``reduce_loss``.

The loss contract: each rank's ``model(**shard_batch(batch)).loss`` is (sum of its token losses) /
(number of valid label tokens in the whole unsharded batch), so the shares summed over the
context-parallel group equal the unsharded loss and the parameter gradients summed over the group
equal the unsharded gradients. To get there, labels are shifted on the full sequence before sharding
(``shift_labels``; no target is lost at a chunk boundary) and the global count goes to the loss as
``num_items_in_batch`` (Transformers' ``ForCausalLMLoss`` divides the summed loss by it). The output's
``labels`` are therefore already shifted: whatever shifts labels again must use ``shift_labels`` as is.

Masks: packed documents (``position_ids`` that restart, as ``DataCollatorWithFlattening`` makes them,
or ``cu_seq_lens_q``) and padding (``attention_mask`` zeros, and the tokens ``pad_to_multiple`` adds)
become global document ids of the unsharded sequence (``ring_document_ids``, -1 = padding), which the
attention function hands to ``ring_attention``. They stay on the CPU: the ring classifies tiles on
the host, so a device copy would only cost a sync per layer.

Images and video (``pixel_values`` or ``pixel_values_videos`` in the batch): the vision features must land on the
image tokens of the whole sequence and multimodal RoPE (Qwen-VL) numbers the whole sequence, so ``input_ids`` (padded
to the layout's multiple at the end, with the batch's ``attention_mask`` when it has one) and the media keys
go to the model whole, and the model's text model cuts its input embeddings and positions to the rank's shard
(``ShardInfo.whole_inputs``; ``hf_ring.patches.multimodal``). Every key besides the sequence keys is per image
(``image_grid_thw``, ``image_sizes``, ...) and passes unchanged, but for the per-token type ids
(``mm_token_type_ids``), padded as ``input_ids``. Such a batch is not packed: no ``position_ids`` or packing keys. A
text batch's token types (a vision-language processor's, all zeros) are sharded as ``input_ids``.
A batch whose images enter by cross-attention (Llama 3.2 Vision: it carries a ``cross_attention_mask`` per token,
``CROSS_KEYS``) is sharded as text, its cross-attention mask with it; its images and their keys go whole to every
rank, where the cross-attention layers attend to them locally.

No communication happens here: every rank shards the same full batch (it must be identical on every
rank of the group), so every error is raised on every rank before any collective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from .comm import group_rank_and_size
from .hf_attention import DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG, ShardInfo
from .layout import (
    check_layout,
    documents_from_cu_seqlens,
    documents_from_positions,
    required_multiple,
    shard,
    valid_cu_seqlens,
)

__all__ = ["shard_batch", "shard_for", "reduce_loss", "carries", "multimodal", "per_token_key", "IGNORE_INDEX",
           "CROSS_KEYS", "MEDIA_KEYS", "PER_IMAGE_KEYS", "TOKEN_TYPE_KEYS", "check_chunk_multiple", "pad_tokens"]  # fmt: skip

IGNORE_INDEX = -100

MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "input_features", "pixel_values_images", "input_values",
              "image_patches")  # fmt: skip
"""Keys whose presence makes a batch multimodal (its inputs go to the model whole, see the module docstring):
images, video, and audio (Gemma 4's ``input_features``, Apertus 1.5's waveform ``input_values``); Video-LLaVA's
processor names its images ``pixel_values_images`` (on 5.17 always, later by default), Fuyu's its patches
``image_patches`` (its model's ``pixel_values`` from Transformers 5.23 on)."""

PER_IMAGE_KEYS = (*MEDIA_KEYS, "pixel_attention_mask", "spatial_shapes", "image_sizes", "image_grid_thw",
                  "video_grid_thw", "image_position_ids", "input_features_mask", "padding_mask",
                  "high_res_pixel_values", "feature_attention_mask", "pixel_mask", "image_token_pooling", "image_grids",
                  "image_num_crops", "video_token_pooling", "video_grids")  # fmt: skip
"""Keys processors give per image, video or clip, never per token, whatever their shape (LFM2-VL's patches
``[images, max patches, ...]`` may have the shape of ``input_ids`` in their first two dimensions; Qwen2-Audio's
``feature_attention_mask`` ``[clips, frames]``, Aria's ``pixel_mask`` ``[images, height, width]``, Molmo2's
``image_token_pooling`` ``[image tokens, pooled patches]``): passed on whole."""

CROSS_KEYS = ("cross_attention_mask",)
"""Per-token keys of a batch whose images enter by cross-attention (Mllama's ``[batch, seq, images, tiles]``: which
images each token sees): sharded with the sequence (padding sees no image), the batch's text too."""

ENCODED_KEY = "mm_encoder_outputs"
"""Transformers' vision features computed ahead of the forward (``generate()`` passes them in place of the pixels
since 5.24): a batch carrying them is multimodal too."""


def per_token_key(key: str, value, shape: tuple) -> bool:
    """A key of a batch with images that looks per-token (a tensor with the shape of ``input_ids`` in its first two
    dimensions) and is neither a token type (padded as ``input_ids``) nor a per-image key (``PER_IMAGE_KEYS``)."""
    known = key in TOKEN_TYPE_KEYS or key in PER_IMAGE_KEYS or key in CROSS_KEYS
    return not known and isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == shape


def carries(value) -> bool:
    """A media keyword's value carries something (Transformers' ``generate`` passes an empty dict)."""
    return value is not None and not (isinstance(value, (dict, list, tuple)) and len(value) == 0)


def multimodal(batch: Mapping) -> bool:
    """Whether ``batch`` (keyword arguments of a forward) carries images, video or audio: ``MEDIA_KEYS``, or
    non-empty ``mm_encoder_outputs``."""
    return carries(batch.get(ENCODED_KEY)) or any(batch.get(k) is not None for k in MEDIA_KEYS)


_SEQUENCE_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# per token in a multimodal batch: padded as input_ids (ERNIE-4.5-VL's moe_mm_token_type_ids route its experts)
TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids", "moe_mm_token_type_ids")


def _group(group) -> tuple[int, int]:
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "shard_batch: a process group was passed but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (or pass group=None for one rank)"
        )
    return group_rank_and_size(group)


def _validate(batch) -> tuple:
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_batch expects a dict of tensors from a collator, got {type(batch).__name__}")
    media = multimodal(batch)
    unknown = sorted(set(batch) - set(_SEQUENCE_KEYS) - set(_PACKING_KEYS) - set(CROSS_KEYS))
    if not media:  # a vision-language processor's text batch carries its (all-zero) token types: sharded as input_ids
        unknown = [k for k in unknown if k not in TOKEN_TYPE_KEYS]
    if unknown and not media:
        raise ValueError(
            f"shard_batch does not know how to shard {unknown}; it takes {', '.join(_SEQUENCE_KEYS)}, "
            f"{', '.join(TOKEN_TYPE_KEYS)} (and the packing keys {', '.join(_PACKING_KEYS)}; with images or video "
            f"{', '.join(MEDIA_KEYS)} and their per-image keys); remove the others from the batch"
        )
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError("shard_batch needs input_ids: an integer tensor [batch, seq_len]")
    shape = tuple(input_ids.shape)
    if shape[1] == 0:
        raise ValueError("shard_batch: input_ids is empty (seq_len 0)")
    if media:
        for key in MEDIA_KEYS:
            value = batch.get(key)
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"shard_batch: {key} must be a tensor (as a processor returns it), got {type(value).__name__}"
                )
        packing = [k for k in ("position_ids", *_PACKING_KEYS) if batch.get(k) is not None]
        if packing:
            raise ValueError(
                f"shard_batch: a batch with images or video takes no {packing}: the model numbers the whole "
                "sequence itself (multimodal RoPE), and packed documents with images are not supported; pad "
                "instead (attention_mask)"
            )
        per_token = sorted(k for k in unknown if per_token_key(k, batch[k], shape))
        if per_token:  # the labels are sharded: a per-token tensor left whole would no longer line up with them
            raise ValueError(
                f"shard_batch does not know how to shard {per_token} (per-token, the shape of input_ids) in a batch "
                f"with images; it passes per-image keys on and pads {', '.join(TOKEN_TYPE_KEYS)}; remove the others"
            )
    labels, mask, pos = batch.get("labels"), batch.get("attention_mask"), batch.get("position_ids")
    for name in ("labels", "attention_mask", *TOKEN_TYPE_KEYS):
        t = batch.get(name)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"shard_batch: {name} must have the shape of input_ids {shape}, got {got}")
    for name in CROSS_KEYS:
        t = batch.get(name)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"shard_batch: {name} must be [batch, seq_len, ...] as input_ids {shape}, got {got}")
    if pos is not None:
        if not isinstance(pos, torch.Tensor):
            raise ValueError(
                f"shard_batch: position_ids must be a tensor [batch or 1, {shape[1]}], got {type(pos).__name__}"
            )
        if pos.dim() not in (1, 2) or pos.shape[-1] != shape[1]:
            raise ValueError(f"shard_batch: position_ids must be [batch or 1, {shape[1]}], got {tuple(pos.shape)}")
        pos = pos.reshape(-1, shape[1])
        if pos.shape[0] not in (1, shape[0]):
            raise ValueError(f"shard_batch: position_ids must be [batch or 1, {shape[1]}], got {tuple(pos.shape)}")
        pos = pos.expand(shape[0], -1)
    cu = batch.get("cu_seq_lens_q")
    if pos is None and cu is not None:
        if not isinstance(cu, torch.Tensor) or cu.dtype.is_floating_point:
            raise ValueError(f"shard_batch: cu_seq_lens_q must be an integer tensor, got {type(cu).__name__}")
        if shape[0] != 1:
            raise ValueError("shard_batch: cu_seq_lens_q describes a batch of one packed row; got batch size > 1")
        cu = cu.detach().cpu().long()
        if not valid_cu_seqlens(cu, shape[1]):
            raise ValueError(f"shard_batch: cu_seq_lens_q must rise from 0 to seq_len {shape[1]}, got {cu.tolist()}")
        doc = documents_from_cu_seqlens(cu, shape[1])
        pos = (torch.arange(shape[1]) - cu[doc])[None].to(input_ids.device)
    elif pos is None and batch.get("seq_idx") is not None:
        raise ValueError("shard_batch: a batch packed with seq_idx also needs position_ids (or cu_seq_lens_q)")
    return input_ids, labels, mask, pos, media


def check_chunk_multiple(value, *, optional: bool = False) -> None:
    """ValueError unless ``value`` is a positive int (or, ``optional``, None): ``shard_batch``'s ``chunk_multiple``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"chunk_multiple must be a positive int{' or None' if optional else ''}, got {value!r}")


def pad_tokens(x: torch.Tensor, pad: int, *, left: bool = False) -> torch.Tensor:
    """``x`` [batch, seq, ...] (token types, a cross-attention mask) with ``pad`` zeros after its tokens along
    dimension 1, or before them (``left``: ``ring_generate``'s prompt padding)."""
    if not pad:
        return x
    zeros = x.new_zeros((x.shape[0], pad, *x.shape[2:]))
    return torch.cat([zeros, x] if left else [x, zeros], dim=1)


def shard_batch(
    batch, *, group=None, layout: str = "zigzag", pad_to_multiple: bool = True, chunk_multiple: int = 1
) -> dict:
    """This rank's shard of a full-sequence batch, as keyword arguments for ``model(**local)``.

    Args:
        batch: a collator's output: ``input_ids`` [batch, seq_len], optional ``labels`` (unshifted,
            -100 = ignore), ``attention_mask`` (1 = token, 0 = padding), ``position_ids`` (restarting
            at each document for packed batches), and optionally ``cu_seq_lens_q/k``,
            ``max_length_q/k``, ``seq_idx`` (superseded by ``position_ids`` when both are present); or
            a vision-language processor's batch with ``pixel_values`` / ``pixel_values_videos`` (not packed).
            Identical on every rank of ``group``.
        group: the context-parallel process group (None: the default group; none initialised: 1 rank).
        layout: must match the layout given to ``apply_ring_attention``.
        pad_to_multiple: pad seq_len to the layout's multiple (2 x group size for zigzag) with ignored
            tokens (position 0, so the largest position id stays the batch's own); if False, such a length
            raises ValueError.
        chunk_multiple: with more than one rank, pad to ``chunk_multiple`` times the layout's multiple, so that
            each chunk of the layout (a rank's two halves in zig-zag, its share in contiguous) holds a multiple of
            ``chunk_multiple`` tokens. DeepSeek-V4's compressed layers need the lcm of their compress rates
            (``hf_ring.chunk_multiple(model)`` says what a model needs, 1 for most; the Accelerate plugin and the
            ring Trainers pad by it themselves).

    Returns:
        ``input_ids`` and ``position_ids`` [batch, local_seq] (global positions, or per-document
        positions for packed batches); with labels: ``labels`` and ``shift_labels`` [batch, local_seq]
        and ``num_items_in_batch`` (valid targets in the whole batch); ``ring_document_ids``:
        [batch, padded seq_len] (CPU, int32) when the batch is packed or padded, else None;
        ``ring_shard_info``: a ``ShardInfo`` (layout, group size, rank, padded length) that the
        attention checks against ``apply_ring_attention``'s settings; ``use_cache=False``. A batch with
        images or video keeps ``input_ids`` [batch, padded seq_len] whole (with ``attention_mask`` when
        the batch has one; the padding added comes last), passes its media keys on and has no ``position_ids``; the
        labels are sharded. One with a
        ``cross_attention_mask`` (images by cross-attention) is sharded as text, that mask too, its media whole.

    Warning:
        ``labels`` in the output are ALREADY SHIFTED (``labels[:, i]`` is the target of token i, equal to
        ``shift_labels``). Anything that shifts labels again, e.g. a label smoother, a token-accuracy
        metric or a custom loss, must use ``shift_labels`` as is, else it drops one target per chunk
        boundary and pairs the others with the wrong token.
    """
    rank, world = _group(group)
    return shard_for(batch, rank, world, layout=layout, pad_to_multiple=pad_to_multiple, chunk_multiple=chunk_multiple)


def shard_for(
    batch, rank: int, world: int, *, layout: str = "zigzag", pad_to_multiple: bool = True, chunk_multiple: int = 1
) -> dict:
    """``shard_batch`` for the ``rank`` of ``world`` CP ranks given as numbers: it communicates nothing, so it runs
    where no process group exists (a DataLoader worker started with ``spawn`` or ``forkserver``)."""
    check_layout(layout)
    check_chunk_multiple(chunk_multiple)
    input_ids, labels, mask, pos, media = _validate(batch)
    whole = media and all(batch.get(k) is None for k in CROSS_KEYS)  # (images by cross-attention: the text sharded)
    b, s = input_ids.shape
    per_chunk = chunk_multiple if world > 1 else 1  # (one rank: no chunk meets another rank's)
    m = required_multiple(layout, world) * per_chunk
    pad = -s % m
    if pad and not pad_to_multiple:
        chunks = f", with chunks of a multiple of {per_chunk} tokens," if per_chunk > 1 else ""
        raise ValueError(
            f"sequence length {s} is not a multiple of {m} (the {layout} layout over {world} ranks{chunks} needs a "
            f"multiple of {m}); pass pad_to_multiple=True to shard_batch, or pad in the collator "
            f"(e.g. pad_to_multiple_of={m})"
        )
    dev = input_ids.device
    valid = torch.ones(b, s + pad, dtype=torch.bool)
    valid[:, s:] = False
    if mask is not None:
        valid[:, :s] = mask.detach().cpu().bool()
    numbered = pos is None
    if numbered:
        pos = torch.arange(s, device=dev).expand(b, -1)
        docs = torch.zeros(b, s + pad, dtype=torch.long)
    else:
        pos = pos.to(dev).long()
        docs = documents_from_positions(pos)
        docs = torch.cat([docs, docs[:, -1:].expand(-1, pad)], dim=1)  # the padding: masked below
    # padding takes position 0: it never raises the largest position id, which RoPE types dynamic / longrope read
    pos = torch.nn.functional.pad(pos, (0, pad), value=0)
    packed = bool((docs[:, -1] > 0).any())
    padded = not bool(valid.all())

    local = {"use_cache": False}  # ring attention never needs a KV cache; do not build one

    def put(name, x):
        local[name] = shard(x, dim=1, rank=rank, world_size=world, layout=layout)

    ids = torch.nn.functional.pad(input_ids, (0, pad), value=0) if pad else input_ids
    if whole:  # the whole inputs: the model's text model cuts its embeddings and positions (ShardInfo.whole_inputs)
        local["input_ids"] = ids
        # the model's multimodal positions skip padding as they do unsharded; a batch's own mask passes on even when
        # nothing is padding (the Qwen-Omni thinkers number multimodal positions only when given one), and a batch
        # without one gets none: the padding added here comes last, where the causal model never reads it, and the
        # ring masks it by the document ids (a mask would change the Omni thinkers' positions from the batch's)
        if mask is not None:
            local["attention_mask"] = valid.to(device=dev, dtype=mask.dtype)
        for key, value in batch.items():
            if key not in _SEQUENCE_KEYS:
                per_token = key in TOKEN_TYPE_KEYS and isinstance(value, torch.Tensor)
                local[key] = pad_tokens(value, pad) if per_token else value
    else:
        put("input_ids", ids)
        put("position_ids", pos)
        for key in (*TOKEN_TYPE_KEYS, *CROSS_KEYS):
            if batch.get(key) is not None:
                put(key, pad_tokens(batch[key], pad))
        if media:  # images by cross-attention: every rank's layers attend to all of them
            local.update((k, v) for k, v in batch.items() if k not in (*_SEQUENCE_KEYS, *TOKEN_TYPE_KEYS, *CROSS_KEYS))
    if labels is not None:
        full = torch.full((b, s + pad), IGNORE_INDEX, dtype=torch.long, device=labels.device)
        full[:, : s - 1] = labels[:, 1:]
        # a target is ignored when the predicting token or the predicted token is padding
        keep = (valid[:, :-1] & valid[:, 1:]).to(labels.device)
        full[:, :-1] = torch.where(keep, full[:, :-1], IGNORE_INDEX)
        put("shift_labels", full)
        local["labels"] = local["shift_labels"]
        local["num_items_in_batch"] = (full != IGNORE_INDEX).sum()
    # present even when None: tells the attention function that packing and padding are resolved
    local[DOCUMENT_IDS_KWARG] = torch.where(valid, docs, -1).to(torch.int32) if packed or padded else None
    local[SHARD_INFO_KWARG] = ShardInfo(
        layout=layout, world_size=world, rank=rank, seq_len=s + pad, whole_inputs=whole, pad=pad, numbered=numbered
    )
    return local


def reduce_loss(loss: torch.Tensor, *, group=None) -> torch.Tensor:
    """The global loss for logging: the sum of every rank's share (detached; no-op for one rank)."""
    _, world = group_rank_and_size(group)
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total
