"""What a patched model's attention is configured with, and what a batch carries to it.

``apply_ring_attention`` gives each attention module a ``RingConfig`` (``CONFIG_ATTR``): process group, layout,
kernel backend, the model's ``PlanCache``. ``shard_batch`` adds keyword arguments that travel with the model's own
keywords to every attention layer (``ring_shard_info``: a ``ShardInfo``; ``ring_document_ids``); family hooks add
others (``ring_block_ids``: a ``RingBlocks``; ``ring_position_ids``). The attention function
(``hf_ring.hf_attention``) reads them; ``hf_ring.batch_checks`` derives the documents and checks the sharding.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .comm import UlyssesGroups
from .kernels import BACKENDS
from .layout import LAYOUTS
from .plan import PlanCache

__all__ = [
    "BATCH_DOCUMENT_KWARGS", "BLOCK_IDS_KWARG", "CONFIG_ATTR", "DECODE_KWARG", "DISTANCE_BIAS_ATTR", "DOCUMENT_IDS_KWARG",
    "DistanceBias", "HANDED_OVER", "LOCAL_ATTR", "Lent", "LOST_GROUP", "PACKED_WITH_MIXERS", "PACKING_KWARGS", "POSITIONS_KWARG", "QueryTemperature", "RingBlocks",
    "RingConfig", "SHARD_INFO_KWARG", "ShardInfo", "TEMPERATURE_ATTR", "lost_group",
]  # fmt: skip

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


class Lent:
    """An ``attention_mask`` argument with the batch's keywords beside it, for a module whose caller does not pass
    them on (``hf_ring.patches._lend``)."""

    def __init__(self, mask, kwargs: dict):
        self.mask, self.kwargs = mask, kwargs

    def to(self, *args, **kwargs) -> Lent:
        """The mask converted (MPT's model casts its causal mask to bool), the keywords beside it."""
        return Lent(None if self.mask is None else self.mask.to(*args, **kwargs), self.kwargs)


HANDED_OVER = threading.local()
"""``HANDED_OVER.stack``: per thread, one entry ``(model, config, keywords)`` for each model level whose forward is
running, of a patched model whose layers are called without the batch's keywords (Falcon, GPT-Neo, BLOOM, MPT;
``hf_ring.patches._lend.HandOver``): ``hf_attention.ring_mask_function`` returns the mask of that config with the
innermost entry's keywords (a ``Lent``), and the mask reaches every layer."""


CONFIG_ATTR = "hf_ring_config"
"""Attribute of each patched attention module holding its ``RingConfig``."""

LOCAL_ATTR = "hf_ring_local_attention"
"""Attribute of an attention module that attends locally, not through the ring (Mllama's cross-attention, whose keys
are image features every rank holds whole), holding the implementation the model had before hf_ring, which runs it."""

TEMPERATURE_ATTR = "hf_ring_temperature"
DISTANCE_BIAS_ATTR = "hf_ring_distance_bias"  # an attention module's DistanceBias (its table comes per call)
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
class DistanceBias:
    """Inkling's relative position bias as its attention module hands it to the attention function while patched
    (``hf_ring.patches._relative``: the module holds one without a table under ``DISTANCE_BIAS_ATTR``, and its
    ``position_bias`` is the table): ``table`` [batch, heads, seq, E], each query's bias by backward distance 0 .. E - 1
    (``ring_attention(distance_bias=...)``), in place of the dense bias of the shard's own keys; ``log_scaling``:
    ``(n_floor, alpha)`` of the layer's logarithmic scaling, which the module would apply by the token's index in
    its shard and the attention function applies by its index in the whole row (in a row packing several documents,
    in its document), or None."""

    table: torch.Tensor | None = None
    log_scaling: tuple | None = None

    def scaled(self, query: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query, table)`` scaled for the indices ``rows`` ([seq], or [1 or batch, seq]) of their tokens, with the
        model's operations (``tau = 1 + alpha * log(max((i + 1) / n_floor, 1))``, in fp32, back to each one's
        dtype)."""
        if self.log_scaling is None:
            return query, self.table
        n_floor, alpha = self.log_scaling
        tau = 1.0 + alpha * torch.log(((rows + 1).float() / n_floor).clamp(min=1.0))
        tau = tau.view(-1, 1, rows.shape[-1], 1)
        return (query.float() * tau).to(query.dtype), (self.table.float() * tau).to(self.table.dtype)


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
    numbered: bool = False  # the batch gave no position_ids: shard_batch numbered its tokens 0, 1, ... (padding too)


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
        return (RingConfig, (group, self.layout, self.backend, self.plans, None, self.timeout, self.mixers))


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


PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")
"""Transformers' packing keywords (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, Mamba's
``seq_idx``)."""

BATCH_DOCUMENT_KWARGS = (DOCUMENT_IDS_KWARG, *PACKING_KWARGS)
"""What tells the attention where documents and padding are: a model called with any of them must pass one on to
every attention layer (``batch_checks.dropped_documents_error``)."""
