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

Caveat: with more than one rank the batch must come from ``hf_ring.shard_batch``; the function cannot
see packing or padding of the unsharded sequence from the local shard alone, so a 2-D padding mask
is refused there and restarting ``position_ids`` are read as positions only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .comm import group_rank_and_size
from .kernels import BACKENDS
from .layout import LAYOUTS
from .ring import ring_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONFIG_ATTR",
    "DOCUMENT_IDS_KWARG",
    "RingConfig",
    "register",
    "ring_attention_forward",
    "ring_mask_function",
]

ATTN_IMPLEMENTATION = "hf_ring"
"""The key under which hf_ring is registered in ``AttentionInterface`` and ``AttentionMaskInterface``."""

DOCUMENT_IDS_KWARG = "ring_document_ids"
"""Model keyword argument carrying ``[1 or batch, full_seq]`` global document ids (-1 = padding)."""

CONFIG_ATTR = "hf_ring_config"
"""Attribute of each patched attention module holding its ``RingConfig``."""


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """How one model's attention runs: process group, layout and kernel backend (validated)."""

    group: Any = None
    layout: str = "zigzag"
    backend: str = "auto"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "a process group was passed but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first (or pass group=None for one rank)"
            )


_DEFAULT = RingConfig()


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
    """Transformers' packing rule: a new document starts wherever the position does not rise by 1."""
    pos = position_ids.detach().cpu().long()
    if pos.dim() == 1:
        pos = pos[None]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return (starts.cumsum(-1) - 1).to(torch.int32)


def _documents(attention_mask, kwargs: dict, full: int, world_size: int) -> tuple[Any, Any]:
    """``(document_ids, cu_seqlens)`` for the core call (at most one is not None).

    ``ring_document_ids`` present (even None) means shard_batch has resolved packing and padding.
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
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or cu_q.shape != cu_k.shape or not torch.equal(cu_q, cu_k):
            raise ValueError("hf_ring needs cu_seq_lens_q == cu_seq_lens_k (self-attention over packed documents)")
        return None, cu_q
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        if seq_idx.dim() != 2 or seq_idx.shape[-1] != full:
            raise ValueError(
                f"seq_idx must give the document of every token of the unsharded sequence ([batch, {full}]); "
                "pass the full batch through hf_ring.shard_batch instead"
            )
        return seq_idx, None
    if world_size == 1:
        if attention_mask is not None:
            valid = attention_mask.detach().cpu().bool()
            return torch.where(valid, 0, -1).to(torch.int32), None
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            return _documents_from_positions(position_ids), None
    return None, None


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
        query: [batch, q_heads, local_seq, head_dim]; key, value: [batch, kv_heads, local_seq, head_dim].
        attention_mask: what ``ring_mask_function`` returned: None or a 2-D padding mask (one rank only).
        scaling: score scale (default ``head_dim ** -0.5``); dropout: must be 0 (no attention dropout).
        sliding_window: Transformers' window W (key visible iff ``q - W < k <= q``), or None.
        kwargs: ``ring_document_ids``, ``cu_seq_lens_q`` / ``cu_seq_lens_k``, ``seq_idx``,
            ``position_ids``, ``is_causal``, ``output_attentions``; others are ignored.

    Returns:
        ``(out, None)``, out: [batch, local_seq, q_heads, head_dim] in query's dtype.
    """
    cfg: RingConfig = getattr(module, CONFIG_ATTR, _DEFAULT)
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
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"hf_ring attention needs as many keys as queries (got {key.shape[2]} keys for {query.shape[2]} "
            "queries): a KV cache is not supported; call the model with use_cache=False, and call "
            "hf_ring.revert_ring_attention(model) before generate()"
        )
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    _, world_size = group_rank_and_size(cfg.group)
    document_ids, cu_seqlens = _documents(attention_mask, kwargs, query.shape[2] * world_size, world_size)
    out = ring_attention(
        query,
        key,
        value,
        group=cfg.group,
        layout=cfg.layout,
        causal=bool(causal),
        scale=scaling,
        sliding_window=sliding_window,
        cu_seqlens=cu_seqlens,
        document_ids=document_ids,
        backend=cfg.backend,
    )
    return out.transpose(1, 2).contiguous(), None
