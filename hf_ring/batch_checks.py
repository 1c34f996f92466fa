"""What the attention function learns from a call's keywords about the batch: where its documents and padding are,
and whether its sharding fits the module's ring.

Documents: ``shard_batch``'s ``ring_document_ids`` (global, -1 = padding), Transformers' packing keywords
(``cu_seq_lens_q`` / ``cu_seq_lens_k``, ``seq_idx``), and with one rank a 2-D padding mask or ``position_ids`` that
restart. Sharding: ``shard_batch``'s ``ShardInfo`` must agree with the module's ``RingConfig`` and the local length;
a batch sharded by hand must carry the global positions of its tokens. Each check returns the message of what to
change (or None): the caller raises it, on every rank when only some ranks can see it.
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import chunk_documents, documents_from_cu_seqlens, documents_from_positions, positions, valid_cu_seqlens
from .ring_config import (
    BATCH_DOCUMENT_KWARGS,
    DOCUMENT_IDS_KWARG,
    PACKING_KWARGS,
    POSITIONS_KWARG,
    SHARD_INFO_KWARG,
    RingConfig,
    ShardInfo,
)

__all__ = [
    "chunk_size", "chunked", "documents", "dropped_documents_error", "hand_sharded_error", "ids_from_cu_seqlens",
    "packed_documents", "positions_error", "refuse_mask", "shard_info_error", "sharding_error", "with_model_positions",
    "without_all_true",
]  # fmt: skip


def packed_documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[batch, seq] int32 document ids where ``position_ids`` restart (packing), or None where they don't."""
    docs = documents_from_positions(position_ids)
    return docs.to(torch.int32) if bool((docs[:, -1] > 0).any()) else None


def ids_from_cu_seqlens(cu, full: int) -> torch.Tensor:
    """[1, full] document ids from global boundaries ``cu`` (validated)."""
    if not valid_cu_seqlens(cu, full):
        raise ValueError(f"cu_seq_lens_q must rise from 0 to the sequence length {full}, got {cu.tolist()[:8]}")
    return documents_from_cu_seqlens(cu, full)[None].to(torch.int32)


def without_all_true(mask, plans=None):
    """``mask``, or None where it is a boolean 2-D mask with no padding (GLM-5.3-Flash's text model makes one of its
    local length when given none): one host read, once per forward with a plan cache."""
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.bool):
        return mask
    make = lambda: bool(mask.all())  # noqa: E731
    return None if (make() if plans is None else plans.derived((without_all_true, mask), make)) else mask


def refuse_mask(world_size: int, from_shard_batch: bool) -> None:
    """ValueError for a caller's 2-D ``attention_mask`` where the ring cannot take one: over several ranks, or next to
    ``shard_batch``'s output (padding reaches the attention as document ids)."""
    if world_size > 1 or from_shard_batch:
        raise ValueError(
            f"attention_mask cannot be passed to a ring-attention model over {world_size} ranks, nor next to "
            "shard_batch's output: padding of the unsharded sequence must reach the attention through "
            f"hf_ring.shard_batch (which turns it into {DOCUMENT_IDS_KWARG}); pass the full batch, "
            "attention_mask included, to shard_batch and its output alone to the model"
        )


def documents(attention_mask, kwargs: dict, full: int, world_size: int) -> tuple[Any, Any]:
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
        refuse_mask(world_size, from_shard_batch)
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
        docs = ids_from_cu_seqlens(cu_q, full)
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
        return (None if position_ids is None else packed_documents(position_ids)), None
    if attention_mask is not None:  # one rank: padding -> -1, on top of the documents
        valid = attention_mask.detach().cpu().bool()
        docs = torch.zeros_like(valid, dtype=torch.int32) if docs is None else docs.expand(valid.shape[0], -1)
        docs = torch.where(valid, docs, -1).to(torch.int32)
    return docs, None


def shard_info_error(info, cfg: RingConfig, rank: int, world_size: int, local_len: int) -> str | None:
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


def hand_sharded_error(
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
        return positions_error(pos, cfg, rank, world_size, local_len)
    return cfg.plans.derived((hand_sharded_error, pos), lambda: positions_error(pos, cfg, rank, world_size, local_len))


def positions_error(pos, cfg: RingConfig, rank: int, world_size: int, local_len: int) -> str | None:
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


def with_model_positions(kwargs: dict, local_len: int) -> dict:
    """``kwargs`` with the ``position_ids`` the model was called with (``ring_position_ids``) when its decoder layers
    did not pass them on (Llama 4, StarCoder 1, Dory): packing marked by restarting positions, and positions of a
    batch sharded by hand, are then seen as for the other families."""
    pos = kwargs.get(POSITIONS_KWARG)
    if kwargs.get("position_ids") is not None or not isinstance(pos, torch.Tensor) or pos.shape[-1] != local_len:
        return kwargs
    return {**kwargs, "position_ids": pos}


def chunk_size(module) -> int | None:
    """The attention chunk of a ``"chunked_attention"`` layer (Llama 4: its RoPE layers attend within chunks of
    ``config.attention_chunk_size`` tokens), else None."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not types or index is None or not 0 <= index < len(types) or types[index] != "chunked_attention":
        return None
    return config.attention_chunk_size


def chunked(document_ids, cu_seqlens, full: int, chunk: int) -> tuple[torch.Tensor, None]:
    """The documents of a chunked layer: every document (or row) cut into chunks (``layout.chunk_documents``)."""
    if cu_seqlens is not None:
        document_ids = ids_from_cu_seqlens(cu_seqlens, full)  # (validated: the global boundaries)
    return chunk_documents(document_ids, chunk, seq_len=full), None


def dropped_documents_error(module, kwargs: dict, cfg: RingConfig) -> str | None:
    """The model's forward was given document ids (padding or packing) but this layer was called without them
    (a family whose decoder layers do not pass the batch's keywords on), or None."""
    if cfg.plans is None or not cfg.plans.batch_documents:
        return None
    if any(kwargs.get(k) is not None for k in BATCH_DOCUMENT_KWARGS):
        return None
    return (
        f"the batch has padding or packed documents ({DOCUMENT_IDS_KWARG} from hf_ring.shard_batch, or "
        f"{'/'.join(PACKING_KWARGS)}), but "
        f"{type(module).__name__} was called without them: this model's decoder layers do not pass the batch's "
        "keyword arguments on to the attention, so the ring cannot see the padding or the document boundaries. "
        "Train this model on batches without padding or packing: rows of equal length (no attention_mask zeros), "
        "a multiple of the layout's (2 x CP size for zigzag) so that shard_batch adds no padding"
    )


def sharding_error(
    module, kwargs: dict, cfg: RingConfig, rank: int, world_size: int, local_len: int, positioned: bool = False
):
    """Why the batch does not fit this module's ring (shard_batch's ShardInfo, or hand-sharded positions), or None."""
    info = kwargs.get(SHARD_INFO_KWARG)
    if info is not None:
        return shard_info_error(info, cfg, rank, world_size, local_len)
    by_hand = DOCUMENT_IDS_KWARG not in kwargs and all(kwargs.get(k) is None for k in PACKING_KWARGS)
    if world_size > 1 and by_hand:
        return hand_sharded_error(module, kwargs, cfg, rank, world_size, local_len, positioned)
    return None
