"""The attention function hf_ring registers in Transformers' ``AttentionInterface`` (and its mask function).

``ring_attention_forward`` has the signature Transformers calls attention functions with
(``module, query, key, value, attention_mask, *, scaling, dropout, sliding_window, **kwargs``) and
turns the Hugging Face conventions into one ``hf_ring.ring_attention`` call:

- GQA: key/value keep their ``kv_heads`` heads (never repeated);
- ``scaling`` becomes the score scale, ``sliding_window`` the window (Transformers' semantics: a key
  is visible iff ``q - W < k <= q``), ``module.is_causal`` / ``is_causal`` the causal flag;
- documents: ``ring_document_ids`` (global document ids of the unsharded sequence, added by
  ``hf_ring.shard_batch``) or ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (global boundaries, as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` produces) or ``seq_idx``; with one
  rank also Transformers' own conventions: a 2-D padding mask, or ``position_ids`` that restart.

It returns ``[batch, local_seq, q_heads, head_dim]`` and no attention weights.

``ring_mask_function`` is registered under the same name in ``AttentionMaskInterface`` so that
Transformers never builds a dense ``[q, k]`` mask: it hands the 2-D padding mask (or None) through.

Checks against silent mistakes: ``shard_batch`` adds ``ring_shard_info`` (a ``ShardInfo``: layout, group
size, rank, padded length), which must agree with the module's ``RingConfig`` and the local length,
else a ValueError says what to change. Errors that only some ranks can see go through the ring's own
pre-flight exchange (``hf_ring.ring.raise_on_every_rank``), so every rank of the
group raises and none is left waiting in a collective.

Autocast: under ``torch.autocast`` q, k and v are cast to the autocast dtype (as SDPA is), since RoPE
leaves q/k in fp32 while v comes from a low-precision projection; the kernels accumulate in fp32.

Caveat: with more than one rank the batch should come from ``hf_ring.shard_batch``; the function cannot
see packing or padding of the unsharded sequence from the local shard alone, so a 2-D padding mask
is refused there. A batch sharded by hand (no ``ring_shard_info`` / ``ring_document_ids``) must carry
the global positions of its tokens: ``position_ids`` that restart (packing) or are local (missing)
raise. That check runs once per forward (in the first attention layer) and costs one small
device-to-host copy when ``position_ids`` live on a GPU; ``shard_batch`` users never pay it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .comm import UlyssesGroups, group_rank_and_size
from .kernels import BACKENDS
from .layout import (
    LAYOUTS,
    chunk_documents,
    documents_from_cu_seqlens,
    documents_from_positions,
    positions,
    several_documents,
    valid_cu_seqlens,
)
from .ring import PlanCache, raise_on_every_rank, ring_attention
from .sparse import IndexerCall, SparseMask, select, select_decode

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_ATTR",
    "BLOCK_IDS_KWARG",
    "DOCUMENT_IDS_KWARG",
    "LOCAL_ATTR",
    "RingBlocks",
    "RingConfig",
    "PACKED_WITH_MIXERS",
    "POSITIONS_KWARG",
    "QueryTemperature",
    "SHARD_INFO_KWARG",
    "TEMPERATURE_ATTR",
    "ShardInfo",
    "register",
    "ring_attention_forward",
    "scales_queries_itself",
    "ring_mask_function",
]

ATTN_IMPLEMENTATION = "hf_ring"
"""The key under which hf_ring is registered in ``AttentionInterface`` and ``AttentionMaskInterface``."""

DOCUMENT_IDS_KWARG = "ring_document_ids"
"""Model keyword argument carrying ``[1 or batch, full_seq]`` global document ids (-1 = padding)."""

BLOCK_IDS_KWARG = "ring_block_ids"
"""Model keyword argument carrying a ``RingBlocks``: the bidirectional blocks of the batch (Gemma 3's and Gemma 4's
image tokens), set by the family's hook on the vision-language model."""

POSITIONS_KWARG = "ring_position_ids"
"""Model keyword argument carrying the ``position_ids`` the model was called with (``[batch, local_seq]``), added by
the patched model's hook: the attention of a family whose decoder layers do not pass ``position_ids`` on reads them
there."""

SHARD_INFO_KWARG = "ring_shard_info"
"""Model keyword argument carrying the ``ShardInfo`` of a ``shard_batch`` output."""

DECODE_KWARG = "ring_cache"
"""Model keyword argument carrying ``hf_ring.ring_generate``'s sharded KV cache (decode steps attend through it)."""

CONFIG_ATTR = "hf_ring_config"
"""Attribute of each patched attention module holding its ``RingConfig``."""

LOCAL_ATTR = "hf_ring_local_attention"
"""Attribute of an attention module that attends locally, not through the ring (Mllama's cross-attention, whose keys
are image features every rank holds whole), holding the implementation the model had before hf_ring, which runs it."""

TEMPERATURE_ATTR = "hf_ring_temperature"
"""Attribute of a patched attention module whose queries this function scales by their global index
(a ``QueryTemperature``: Llama 4's layers without RoPE, ``hf_ring.patches._temperature``)."""


@dataclasses.dataclass(frozen=True)
class QueryTemperature:
    """Llama 4's attention temperature tuning on its layers without RoPE: the query of the token at index ``i`` of
    its row (padding included) is multiplied by ``log1p(floor((i + 1) / floor_scale)) * attn_scale + 1``. The
    model computes ``i`` from the length of the hidden states it sees, a shard's under the ring; the patch turns
    that off and this function scales by the token's index in the whole row, with the same operations in the
    same order (so the same numbers)."""

    floor_scale: float
    attn_scale: float

    def apply(self, query: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``query`` [batch, heads, seq, dim] scaled for the row indices ``rows`` [seq] of its tokens."""
        scales = torch.log1p(torch.floor((rows.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (query * scales.view(1, 1, -1, 1)).to(query.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class RingBlocks:
    """The batch's bidirectional blocks for ``ring_attention(block_ids=...)``: ``ids`` [batch, full_seq] (one id per
    block, -1 elsewhere); ``sliding_only``: only the sliding-window layers see them (Gemma 4: its full-attention
    layers stay causal), else every layer (Gemma 3). One object per forward, shared by its layers (the ring's plan
    cache keys on the tensor's identity)."""

    ids: torch.Tensor
    sliding_only: bool = False

    def for_layer(self, sliding_window) -> torch.Tensor | None:
        """The ids a layer with this ``sliding_window`` (None: a full-attention layer) takes, or None."""
        return None if self.sliding_only and sliding_window is None else self.ids


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """How ``shard_batch`` cut a batch: layout, group size, this rank, full (padded) length.

    A plain frozen dataclass, so it passes through the model's ``**kwargs`` to the attention function
    unchanged: ``.to()`` / Accelerate's ``send_to_device`` / the Trainer's ``_prepare_inputs`` leave it alone.

    ``whole_inputs``: a batch with images or video. The model gets the whole (padded) ``input_ids``, merges
    the vision features into the token embeddings and computes its positions on the whole sequence, and the
    text model's pre-hook (``hf_ring.patches._family.ShardEmbeddings``) cuts its input embeddings and
    positions to this rank's shard; the labels are sharded and the document ids given as for text.
    """

    layout: str
    world_size: int
    rank: int
    seq_len: int
    whole_inputs: bool = False
    pad: int = 0  # the ignored tokens shard_batch appended to reach the layout's multiple (position 0)


class _Dropped(enum.Enum):
    """Stands for a process group that was dropped when its ``RingConfig`` was pickled."""

    GROUP = "process group dropped when pickled"


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """How one model's attention runs: process group, layout and kernel backend (validated), and the
    ``PlanCache`` its layers share (``apply_ring_attention`` gives every patched model one; without it
    each call plans and checks on its own, as with ``register_attention`` alone).

    ``copy.copy`` / ``copy.deepcopy`` return the same object (a process group is a shared handle, so a
    deep copy of a patched model, e.g. TRL's reference model or an EMA copy, runs on the same group).
    Pickling keeps layout and backend but drops an explicit group (it cannot be serialised), with a
    warning; a model unpickled that way raises on its first forward until ``apply_ring_attention(model,
    group=...)`` is called again.
    """

    group: Any = None
    layout: str = "zigzag"
    backend: str = "auto"
    plans: PlanCache | None = dataclasses.field(default=None, compare=False, repr=False)
    ulysses: UlyssesGroups | None = dataclasses.field(default=None, compare=False)  # the Ulysses x Ring hybrid
    timeout: float | None = None  # seconds a rank waits for its ring peers (gloo) before it raises
    # the model also has linear-attention or convolution layers (``hf_ring.patches.linear``), which see packed
    # documents only through the batch's keywords, not through position_ids (``PACKED_WITH_MIXERS``)
    mixers: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not float(self.timeout) > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {self.timeout!r}")
        if self.ulysses is not None and self.ulysses.cp_group is not self.group:
            raise ValueError("RingConfig: ulysses must be the Ulysses groups of this config's group")
        explicit = self.group is not None and self.group is not _Dropped.GROUP
        if explicit and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "a process group was passed but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first (or pass group=None for one rank)"
            )

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        group = self.group
        hybrid = self.ulysses is not None and self.ulysses.ulysses_size > 1  # its subgroups cannot be serialised
        if hybrid or (group is not None and group is not _Dropped.GROUP):
            warnings.warn(
                "hf_ring: pickling a model patched with an explicit process group drops the group (it cannot be "
                "serialised); after loading, call hf_ring.apply_ring_attention(model, group=...) again",
                stacklevel=2,
            )
            group = _Dropped.GROUP
        return (RingConfig, (group, self.layout, self.backend, self.plans, None, self.timeout))


LOST_GROUP = (
    "this model's ring attention lost its process group when the model was pickled; call "
    "hf_ring.apply_ring_attention(model, group=...) again"
)


PACKED_WITH_MIXERS = (
    "packed documents marked only by restarting position_ids cannot reach this model's linear-attention or "
    "convolution layers (their decoder layers are not given position_ids), which would run across the documents; "
    "pass cu_seq_lens_q / cu_seq_lens_k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) or the batch "
    "through hf_ring.shard_batch"
)


def lost_group(cfg: RingConfig) -> bool:
    """True for a config whose process group was dropped by pickling (``LOST_GROUP`` says what to do)."""
    return cfg.group is _Dropped.GROUP


_DEFAULT = RingConfig()
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")
#: What tells the attention where documents and padding are: a model called with any of them must pass one on
#: to every attention layer (``_dropped_documents_error``).
BATCH_DOCUMENT_KWARGS = (DOCUMENT_IDS_KWARG, *_PACKING_KWARGS)

#: Keywords the attention function reads (``_PACKING_KWARGS`` too), and keywords Transformers passes
#: along that do not change what attention computes. Any other keyword with a value is refused: an
#: attention feature hf_ring does not implement (T5's ``position_bias``, ...) must raise, never be
#: dropped silently. ``softcap`` (Gemma2's attention logit softcapping) and ``s_aux`` (gpt-oss's learned
#: sinks) are implemented.
_READ_KWARGS = (
    "is_causal", "output_attentions", "position_ids", "softcap", "s_aux", DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG,
    DECODE_KWARG, BLOCK_IDS_KWARG, POSITIONS_KWARG, "indices",
)  # fmt: skip
_HARMLESS_KWARGS = (
    "max_length_q", "max_length_k",  # packing metadata; the boundaries come from cu_seq_lens
    "use_cache", "cache_position", "past_key_values", "past_key_value",  # a KV cache is refused by length
    "output_hidden_states", "return_dict", "position_embeddings", "layer_idx", "token_type_ids",
    "num_items_in_batch", "shift_labels", "labels",  # loss keywords the model's forward passes along (Gemma 4: labels)
    "logits_to_keep",  # the head's slice; some wrappers (GOT-OCR 2.0, LLaVA-OneVision) pass it to their text model
)  # fmt: skip


def _unknown_kwargs_error(kwargs: dict) -> str | None:
    """Why keywords this function does not implement were passed with a value, or None."""
    known = (*_READ_KWARGS, *_PACKING_KWARGS, *_HARMLESS_KWARGS)
    unknown = sorted(k for k, v in kwargs.items() if k not in known and v is not None and v is not False)
    if not unknown:
        return None
    return (
        f"hf_ring attention does not implement {unknown}: these keywords change what attention computes, and "
        "dropping them would give wrong numbers. hf_ring implements causal and sliding-window attention with "
        "scaling, GQA, packed documents, logit softcapping (softcap) and learned sinks (s_aux); use the model's "
        "own attention implementation for this model"
    )


def _sparse_error(indices, cfg: RingConfig) -> str | None:
    """Why the top-k ``indices`` of DeepSeek sparse attention cannot run here, or None (before any collective: the
    same on every rank)."""
    if indices is None:
        return None
    if not isinstance(indices, IndexerCall):
        return (
            "this model's sparse-attention indexer picked its top-k keys among one rank's tokens only (indices= "
            f"{type(indices).__name__}): switch the model with hf_ring.apply_ring_attention(model), which takes the "
            "top-k over the whole sequence (not only attn_implementation='hf_ring')"
        )
    if cfg.ulysses is not None and cfg.ulysses.ulysses_size > 1:
        return (
            "DeepSeek sparse attention runs on the pure ring: its top-k keys are per query of the ring; use "
            "ulysses_size=1"
        )
    return None


def register() -> None:
    """Register ``ring_attention_forward`` and ``ring_mask_function`` under ``"hf_ring"`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ring_mask_function)


def ring_mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """No dense mask: the 2-D padding mask ``[batch, kv_length]`` (bool) if one was given, else None.

    Masks are derived from global positions inside ``ring_attention``; like Transformers' flash-attention
    mask function, this only passes the padding information on (without a device sync).
    """
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]


def _documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[batch, seq] int32 document ids where ``position_ids`` restart (packing), or None where they don't."""
    docs = documents_from_positions(position_ids)
    return docs.to(torch.int32) if bool((docs[:, -1] > 0).any()) else None


def _ids_from_cu_seqlens(cu, full: int) -> torch.Tensor:
    """[1, full] document ids from global boundaries ``cu`` (validated)."""
    if not valid_cu_seqlens(cu, full):
        raise ValueError(f"cu_seq_lens_q must rise from 0 to the sequence length {full}, got {cu.tolist()[:8]}")
    return documents_from_cu_seqlens(cu, full)[None].to(torch.int32)


def _documents(attention_mask, kwargs: dict, full: int, world_size: int) -> tuple[Any, Any]:
    """``(document_ids, cu_seqlens)`` for the core call (at most one is not None).

    ``ring_document_ids`` present (even None) means shard_batch has resolved packing and padding. With
    one rank a 2-D padding mask is combined with ``cu_seq_lens`` / ``seq_idx`` (padding -> -1), and wins
    over restarting ``position_ids`` (as in Transformers, which ignores packing when a mask is given).
    """
    from_shard_batch = DOCUMENT_IDS_KWARG in kwargs
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError(
                "hf_ring attention takes no 4-D or block attention mask; pass padding as a 2-D "
                "attention_mask (one rank) or through hf_ring.shard_batch"
            )
        if world_size > 1 or from_shard_batch:
            raise ValueError(
                f"attention_mask cannot be passed to a ring-attention model over {world_size} ranks, nor next to "
                "shard_batch's output: padding of the unsharded sequence must reach the attention through "
                f"hf_ring.shard_batch (which turns it into {DOCUMENT_IDS_KWARG}); pass the full batch, "
                "attention_mask included, to shard_batch and its output alone to the model"
            )
    if from_shard_batch:
        return kwargs[DOCUMENT_IDS_KWARG], None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    seq_idx = kwargs.get("seq_idx")
    docs = None
    if cu_q is not None or cu_k is not None:
        if not (
            isinstance(cu_q, torch.Tensor)
            and isinstance(cu_k, torch.Tensor)
            and cu_q.shape == cu_k.shape
            and torch.equal(cu_q, cu_k)
        ):
            raise ValueError("hf_ring needs cu_seq_lens_q == cu_seq_lens_k (self-attention over packed documents)")
        if attention_mask is None:
            return None, cu_q
        docs = _ids_from_cu_seqlens(cu_q, full)
    elif seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.dim() != 2 or seq_idx.shape[-1] != full:
            raise ValueError(
                f"seq_idx must give the document of every token of the unsharded sequence ([batch, {full}]); "
                "pass the full batch through hf_ring.shard_batch instead"
            )
        if attention_mask is None:
            return seq_idx, None
        docs = seq_idx.detach().cpu().to(torch.int32)
    elif world_size == 1 and attention_mask is None:
        position_ids = kwargs.get("position_ids")
        return (None if position_ids is None else _documents_from_positions(position_ids)), None
    if attention_mask is not None:  # one rank: padding -> -1, on top of the documents
        valid = attention_mask.detach().cpu().bool()
        docs = torch.zeros_like(valid, dtype=torch.int32) if docs is None else docs.expand(valid.shape[0], -1)
        docs = torch.where(valid, docs, -1).to(torch.int32)
    return docs, None


def _shard_info_error(info, cfg: RingConfig, rank: int, world_size: int, local_len: int) -> str | None:
    """Why ``shard_batch``'s ``ShardInfo`` does not fit this module's ring (what to change), or None."""
    if not isinstance(info, ShardInfo):
        return f"{SHARD_INFO_KWARG} must be the ShardInfo hf_ring.shard_batch makes, got {type(info).__name__}"
    if info.layout != cfg.layout:
        return (
            f"the batch was sharded with layout={info.layout!r} but the model's ring attention uses "
            f"layout={cfg.layout!r}; pass the same layout to hf_ring.shard_batch and hf_ring.apply_ring_attention"
        )
    if (info.world_size, info.rank) != (world_size, rank):
        return (
            f"the batch was sharded for rank {info.rank} of a group of {info.world_size} but the model's ring "
            f"attention runs as rank {rank} of a group of {world_size}; pass the same (context-parallel) group "
            "to hf_ring.shard_batch(group=...) and hf_ring.apply_ring_attention(group=...)"
        )
    if info.seq_len != local_len * world_size:
        return (
            f"this rank's shard has {local_len} tokens but shard_batch cut {info.seq_len} tokens into "
            f"{world_size} shards of {info.seq_len // world_size}; pass shard_batch's output to the model unchanged"
        )
    return None


def _hand_sharded_error(
    module, kwargs: dict, cfg: RingConfig, rank: int, world_size: int, local_len: int, positioned: bool = False
):
    """Why this rank's ``position_ids`` are not the global positions of its tokens in the layout, or None.

    Only for batches sharded without ``shard_batch`` over several ranks: restarting positions (packing)
    or local positions would otherwise pass silently. Checked once per forward with a plan cache (the first
    attention layer: a hybrid's layer 0 may be a linear-attention layer, which gets no positions), else per call.
    ``positioned``: the caller is an attention layer, whose RoPE needs positions: none at all (not even given to
    the model: Llama 4's layers get none of their own) is an error too.
    """
    pos = kwargs.get("position_ids")
    if pos is None:  # neither the layer nor the model was given positions: the model numbered its shard 0..n-1
        if not positioned:
            return None
        return (
            f"rank {rank} got a shard of {local_len} tokens without position_ids, so the model numbers them from 0 as "
            "if its shard were the whole sequence; pass the batch through hf_ring.shard_batch (or the global "
            "position_ids of its tokens)"
        )
    if cfg.plans is None:
        return _positions_error(pos, cfg, rank, world_size, local_len)
    return cfg.plans.derived(
        (_hand_sharded_error, pos), lambda: _positions_error(pos, cfg, rank, world_size, local_len)
    )


def _positions_error(pos, cfg: RingConfig, rank: int, world_size: int, local_len: int) -> str | None:
    pos = pos.detach().cpu().long().reshape(-1, pos.shape[-1])  # one small copy per forward on a GPU
    if pos.shape[-1] != local_len:
        return None  # not per-token positions (Transformers would fail on them); nothing to compare
    want = positions(local_len * world_size, rank=rank, world_size=world_size, layout=cfg.layout)
    offset = pos - want
    if bool((offset == offset[:, :1]).all()) and bool((offset[:, 0] >= 0).all()):
        return None
    return (
        f"position_ids on rank {rank} are not the global positions of its tokens in the {cfg.layout} layout "
        "(they restart, as in a packed batch, or are local to the shard); tokens would attend across "
        "documents or get wrong rotary positions. Pass the batch through hf_ring.shard_batch (or pass "
        "cu_seq_lens_q/cu_seq_lens_k of the unsharded sequence for packing)"
    )


def _with_model_positions(kwargs: dict, local_len: int) -> dict:
    """``kwargs`` with the ``position_ids`` the model was called with (``ring_position_ids``) when its decoder layers
    did not pass them on (Llama 4, StarCoder 1, Dory): packing marked by restarting positions, and positions of a
    batch sharded by hand, are then seen as for the other families."""
    pos = kwargs.get(POSITIONS_KWARG)
    if kwargs.get("position_ids") is not None or not isinstance(pos, torch.Tensor) or pos.shape[-1] != local_len:
        return kwargs
    return {**kwargs, "position_ids": pos}


def _chunk_size(module) -> int | None:
    """The attention chunk of a ``"chunked_attention"`` layer (Llama 4: its RoPE layers attend within chunks of
    ``config.attention_chunk_size`` tokens), else None."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not types or index is None or not 0 <= index < len(types) or types[index] != "chunked_attention":
        return None
    return config.attention_chunk_size


def _chunked(document_ids, cu_seqlens, full: int, chunk: int) -> tuple[torch.Tensor, None]:
    """The documents of a chunked layer: every document (or row) cut into chunks (``layout.chunk_documents``)."""
    if cu_seqlens is not None:
        document_ids = _ids_from_cu_seqlens(cu_seqlens, full)  # (validated: the global boundaries)
    return chunk_documents(document_ids, chunk, seq_len=full), None


def scales_queries_itself(module) -> bool:
    """Llama 4's attention on a layer without RoPE, scaling its queries by the index it counts itself."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _generated_rows(cache, device) -> torch.Tensor:
    """In ``ring_generate``: the index in the whole row (what the unmodified model counts) of this rank's prompt
    tokens (prefill) or of the new tokens (decode): their positions less the padding it added."""
    st = cache.state
    rows = st.local if st.phase == "prefill" else st.q_pos
    return (rows - st.offset).clamp_min(0).to(device)  # (the padding ring_generate added: any index will do)


def _block_ids(blocks, sliding_window) -> torch.Tensor | None:
    """The ``block_ids`` of this layer's ring call from the batch's ``ring_block_ids`` (a ``RingBlocks``, or None)."""
    if blocks is None:
        return None
    if not isinstance(blocks, RingBlocks):
        raise ValueError(f"{BLOCK_IDS_KWARG} must be a hf_ring.hf_attention.RingBlocks, got {type(blocks).__name__}")
    return blocks.for_layer(sliding_window)


def _dropped_documents_error(module, kwargs: dict, cfg: RingConfig) -> str | None:
    """The model's forward was given document ids (padding or packing) but this layer was called without them
    (a family whose decoder layers do not pass the batch's keywords on), or None."""
    if cfg.plans is None or not cfg.plans.batch_documents:
        return None
    if any(kwargs.get(k) is not None for k in BATCH_DOCUMENT_KWARGS):
        return None
    return (
        f"the batch has padding or packed documents ({DOCUMENT_IDS_KWARG} from hf_ring.shard_batch, or "
        f"{'/'.join(_PACKING_KWARGS)}), but "
        f"{type(module).__name__} was called without them: this model's decoder layers do not pass the batch's "
        "keyword arguments on to the attention, so the ring cannot see the padding or the document boundaries. "
        "Train this model on batches without padding or packing: rows of equal length (no attention_mask zeros), "
        "a multiple of the layout's (2 x CP size for zigzag) so that shard_batch adds no padding"
    )


def _sharding_error(
    module, kwargs: dict, cfg: RingConfig, rank: int, world_size: int, local_len: int, positioned: bool = False
):
    """Why the batch does not fit this module's ring (shard_batch's ShardInfo, or hand-sharded positions), or None."""
    info = kwargs.get(SHARD_INFO_KWARG)
    if info is not None:
        return _shard_info_error(info, cfg, rank, world_size, local_len)
    by_hand = DOCUMENT_IDS_KWARG not in kwargs and all(kwargs.get(k) is None for k in _PACKING_KWARGS)
    if world_size > 1 and by_hand:
        return _hand_sharded_error(module, kwargs, cfg, rank, world_size, local_len, positioned)
    return None


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function backed by ``hf_ring.ring_attention``.

    Args:
        module: the calling attention module; its ``hf_ring_config`` (set by ``apply_ring_attention``)
            gives group, layout and backend (defaults: world group, zigzag, auto).
        query: [batch, q_heads, local_seq, head_dim]; key, value: [batch, kv_heads, local_seq, head_dim] (the
            values' head_dim may differ: multi-head latent attention).
        attention_mask: what ``ring_mask_function`` returned: None or a 2-D padding mask (one rank only).
        scaling: score scale (default ``head_dim ** -0.5``); dropout: must be 0 (no attention dropout).
        sliding_window: Transformers' window W (key visible iff ``q - W < k <= q``), or None.
        kwargs: ``ring_document_ids``, ``ring_shard_info``, ``cu_seq_lens_q`` / ``cu_seq_lens_k``,
            ``seq_idx``, ``position_ids``, ``is_causal``, ``output_attentions``, ``softcap`` (attention logit
            softcapping), ``s_aux`` (learned sinks, [q_heads]), ``ring_block_ids`` (bidirectional blocks), and
            keywords that do not change attention (``_HARMLESS_KWARGS``); any other keyword with a value raises
            ValueError (e.g. ``position_bias``): a feature hf_ring does not implement is never dropped silently.

    Returns:
        ``(out, None)``, out: [batch, local_seq, q_heads, v_head_dim] in query's dtype.
    """
    local = getattr(module, LOCAL_ATTR, None)
    if local is not None:
        return _attend_locally(local, module, query, key, value, attention_mask, scaling, dropout, kwargs)
    cfg: RingConfig = getattr(module, CONFIG_ATTR, _DEFAULT)
    unknown = _unknown_kwargs_error(kwargs) or _sparse_error(kwargs.get("indices"), cfg)
    if unknown:
        raise ValueError(unknown)  # from the model's code: the same on every rank, before any collective
    if isinstance(attention_mask, SparseMask):  # a DSA attention module's (hf_ring.patches._sparse)
        attention_mask = attention_mask.mask
    if lost_group(cfg):
        raise ValueError(LOST_GROUP)
    config = getattr(module, "config", None)
    output_attentions = kwargs.get("output_attentions")
    if output_attentions is None:
        output_attentions = getattr(config, "output_attentions", False)
    if output_attentions:
        raise ValueError(
            "hf_ring attention never materialises attention weights, so output_attentions=True is not "
            "supported; call the model with output_attentions=False (and config.output_attentions=False)"
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported by hf_ring in training mode; build the model with "
            "config.attention_dropout=0.0 (or set attention_dropout = 0.0 on its attention modules), or call "
            "model.eval()"
        )
    kwargs = _with_model_positions(kwargs, query.shape[2])
    cache = kwargs.get(DECODE_KWARG)
    if cache is not None and cache.state.phase == "decode":
        return _decode(module, query, key, value, cfg, cache, scaling, sliding_window, kwargs), None
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"hf_ring attention needs as many keys as queries (got {key.shape[2]} keys for {query.shape[2]} "
            "queries): a KV cache of its own is not supported; call the model with use_cache=False, and generate "
            "with hf_ring.ring_generate(model, inputs, ...) (or hf_ring.revert_ring_attention(model) first)"
        )
    causal = _is_causal(module, kwargs)
    if not causal and _masked_causally(module):  # (the same on every rank: before any collective)
        raise ValueError(
            f"{type(module).__name__} says is_causal=False (its config's use_bidirectional_attention) while its "
            "model masks it causally: switch a PaliGemma model with hf_ring.apply_ring_attention(model), which makes "
            "the ring causal there (not only attn_implementation='hf_ring'); for a Gemma model of its own set "
            "config.use_bidirectional_attention=False, as Transformers masks it anyway"
        )
    rank, world_size = group_rank_and_size(cfg.group)
    local_len = query.shape[2]
    error = _dropped_documents_error(module, kwargs, cfg)
    sharding = None if error else _sharding_error(module, kwargs, cfg, rank, world_size, local_len, positioned=True)
    if sharding and kwargs.get("use_cache") and cache is None:  # model.generate() on the full prompt, most likely
        sharding = (
            f"a ring-attention model over {world_size} ranks cannot run generate() on its own (the prompt must be "
            "sharded and the KV cache kept per rank): call hf_ring.ring_generate(model, inputs, **generate_kwargs) "
            "on every rank, or hf_ring.revert_ring_attention(model) first"
        )
    if error or sharding:
        raise_on_every_rank(error or sharding, group=cfg.group, device=query.device)
    full = local_len * world_size
    temperature = getattr(module, TEMPERATURE_ATTR, None)
    if temperature is None and world_size > 1 and scales_queries_itself(module):  # (the same on every rank)
        raise ValueError(
            f"{type(module).__name__} scales its queries by their index in the shard (Llama 4's temperature "
            "tuning) but hf_ring did not take that over: switch the model with hf_ring.apply_ring_attention(model) "
            "(not only attn_implementation='hf_ring')"
        )
    if temperature is not None:  # by the index in the whole row: the layout's positions, or ring_generate's
        if cache is None:
            rows = positions(full, rank=rank, world_size=world_size, layout=cfg.layout, device=query.device)
        else:
            rows = _generated_rows(cache, query.device)
        query = temperature.apply(query, rows)
    query, key, value = _autocast(query, key, value)
    if cfg.plans is None:
        document_ids, cu_seqlens = _documents(attention_mask, kwargs, full, world_size)
    else:  # the same batch tensors in every layer: derive the documents (a host copy) once per forward
        sources = (attention_mask, *(kwargs.get(k) for k in (DOCUMENT_IDS_KWARG, *_PACKING_KWARGS, "position_ids")))
        document_ids, cu_seqlens = cfg.plans.derived(
            sources, lambda: _documents(attention_mask, kwargs, full, world_size)
        )
    by_positions = DOCUMENT_IDS_KWARG not in kwargs and all(kwargs.get(k) is None for k in _PACKING_KWARGS)
    by_positions = by_positions and attention_mask is None
    if cfg.mixers and by_positions and several_documents(document_ids, cu_seqlens):
        raise_on_every_rank(PACKED_WITH_MIXERS, group=cfg.group, device=query.device)
    chunk = _chunk_size(module)
    if chunk is not None:  # (once per forward with a plan cache: the chunked layers share one plan)
        make = lambda: _chunked(document_ids, cu_seqlens, full, chunk)  # noqa: E731
        documents = (document_ids, cu_seqlens, module.config)
        document_ids, cu_seqlens = make() if cfg.plans is None else cfg.plans.derived((_chunked, *documents), make)
    if cfg.plans is not None:  # names the call in errors ("ring-attention call 3 (layer 2)")
        layer = getattr(module, "layer_idx", None)
        cfg.plans.progress.label = "" if layer is None else f"layer {layer}"
    selected = None
    if kwargs.get("indices") is not None:  # DeepSeek sparse attention: the indexer's top-k over the whole sequence,
        selected = functools.partial(  # resolved by the ring after its pre-flight check (it gathers keys)
            select, kwargs["indices"], group=cfg.group, layout=cfg.layout, causal=bool(causal), cu_seqlens=cu_seqlens,
            document_ids=document_ids, timeout=cfg.timeout, plans=cfg.plans,
        )  # fmt: skip
    out = ring_attention(
        query,
        key,
        value,
        group=cfg.group,
        layout=cfg.layout,
        causal=bool(causal),
        scale=scaling,
        sliding_window=sliding_window,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        cu_seqlens=cu_seqlens,
        document_ids=document_ids,
        block_ids=_block_ids(kwargs.get(BLOCK_IDS_KWARG), sliding_window),
        selected=selected,
        backend=cfg.backend,
        plans=cfg.plans,
        ulysses=cfg.ulysses,
        timeout=cfg.timeout,
    )
    return out.transpose(1, 2).contiguous(), None


def _attend_locally(implementation: str, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """A cross-attention call: the rank's queries against keys that are not the sequence's (image features, the same
    on every rank), as unsharded, by the implementation the model had (SDPA where that was eager: the same up to
    rounding; its cross-attention mask comes per local token, cut with the batch)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    run = ALL_ATTENTION_FUNCTIONS["sdpa" if implementation not in ALL_ATTENTION_FUNCTIONS else implementation]
    own = (DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG, POSITIONS_KWARG, BLOCK_IDS_KWARG, DECODE_KWARG)
    kwargs = {k: v for k, v in kwargs.items() if k not in own}
    return run(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _decode(module, query, key, value, cfg: RingConfig, cache, scaling, sliding_window, kwargs) -> torch.Tensor:
    """A decode step of ``ring_generate``: the new tokens' queries (alike on every rank) against every rank's
    cached keys (``decode_attention``); [batch, new, q_heads, v_head_dim]."""
    from .decode import decode_attention

    st = cache.state
    index = getattr(module, "layer_idx", None)
    if index in st.kv_source:  # Gemma 4: a KV-shared layer attends with its source layer's keys
        layer = cache.layers[st.kv_source[index]]
    elif index is None or index < 0:  # a block shared by several layers (Zamba2): the layer its call just updated
        layer = st.updated
    else:
        layer = cache.layers[index]
    causal = _is_causal(module, kwargs)
    temperature = getattr(module, TEMPERATURE_ATTR, None)
    if temperature is not None:
        query = temperature.apply(query, _generated_rows(cache, query.device))
    query, key, value = _autocast(query, key, value)
    docs = {}  # one document per row: only padding needs the document mask (costly tiles on the CPU)
    chunk = _chunk_size(module)
    if chunk is not None:  # chunks counted from each row's first token that is not padding, as Transformers does
        lead = ((st.docs >= 0).long().cumsum(-1) == 0).sum(-1, keepdim=True)
        k_doc = torch.where(layer.docs < 0, -1, (layer.positions[None] - lead) // chunk)
        docs = {"q_doc": (st.q_pos[None] - lead) // chunk, "k_doc": k_doc}
    elif layer.padded:
        docs = {"q_doc": torch.zeros(1, query.shape[2], dtype=torch.int32), "k_doc": layer.docs}
    selected = None
    if kwargs.get("indices") is not None:  # DeepSeek sparse attention: the step's top-k over the whole sequence
        selected = select_decode(kwargs["indices"], cache, q_pos=st.q_pos, prompt_docs=st.docs, causal=bool(causal))
    out = decode_attention(
        query,
        key,
        value,
        q_pos=st.q_pos,
        k_pos=layer.positions,
        group=cfg.group,
        causal=bool(causal),
        scale=scaling,
        sliding_window=sliding_window,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        backend=cfg.backend,
        check=False,  # ring_generate checked the step across ranks once, before the first layer
        selected=selected,
        **docs,
    )
    return out.transpose(1, 2).contiguous()


def _masked_causally(module) -> bool:
    """Gemma and Gemma 2 attention whose config asks for bidirectional attention (PaliGemma's text config): the
    module says ``is_causal=False``, yet Transformers' mask for these families is causal whatever the config says."""
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None) in ("gemma", "gemma2") and bool(
        getattr(config, "use_bidirectional_attention", False)
    )


def _is_causal(module, kwargs) -> bool:
    causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if causal is None else causal


def _autocast(query, key, value):
    """Like SDPA under autocast: attention runs in the autocast dtype (RoPE leaves q/k in fp32 while v comes from
    a bf16 projection); the kernels still accumulate in fp32."""
    if not torch.is_autocast_enabled(query.device.type):
        return query, key, value
    dtype = torch.get_autocast_dtype(query.device.type)
    return query.to(dtype), key.to(dtype), value.to(dtype)
