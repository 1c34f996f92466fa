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
import functools

import torch

from . import batch_checks
from . import compressed as _compressed
from .comm import group_rank_and_size
from .guard import InStepError
from .layout import documents_from_cu_seqlens, index_in_document, packed_rows, positions, several_documents
from .ring import raise_on_every_rank, ring_attention
from .ring_config import (  # (most were defined here: their import from this module stays)
    BATCH_DOCUMENT_KWARGS,
    BLOCK_IDS_KWARG,
    CONFIG_ATTR,
    DECODE_KWARG,
    DISTANCE_BIAS_ATTR,
    DOCUMENT_IDS_KWARG,
    HANDED_OVER,
    LOCAL_ATTR,
    LOST_GROUP,
    PACKED_WITH_MIXERS,
    PACKING_KWARGS,
    POSITIONS_KWARG,
    SHARD_INFO_KWARG,
    TEMPERATURE_ATTR,
    DistanceBias,
    Lent,
    QueryTemperature,
    RingBlocks,
    RingConfig,
    ShardInfo,
    _Dropped,  # noqa: F401 - (pickles of a RingConfig whose group was dropped name it here)
    lost_group,
)
from .sparse import IndexerCall, SparseMask, picks_key_blocks, pools_tokens, select, select_decode

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BATCH_DOCUMENT_KWARGS",
    "BLOCK_IDS_KWARG",
    "CONFIG_ATTR",
    "DECODE_KWARG",
    "DOCUMENT_IDS_KWARG",
    "DistanceBias",
    "LOCAL_ATTR",
    "LOST_GROUP",
    "PACKED_WITH_MIXERS",
    "POSITIONS_KWARG",
    "QueryTemperature",
    "RingBlocks",
    "RingConfig",
    "SHARD_INFO_KWARG",
    "ShardInfo",
    "TEMPERATURE_ATTR",
    "lost_group",
    "register",
    "ring_attention_forward",
    "ring_mask_function",
    "scales_queries_itself",
]

ATTN_IMPLEMENTATION = "hf_ring"
"""The key under which hf_ring is registered in ``AttentionInterface`` and ``AttentionMaskInterface``."""

_DEFAULT = RingConfig()


#: Keywords the attention function reads (``PACKING_KWARGS`` too), and keywords Transformers passes
#: along that do not change what attention computes. Any other keyword with a value is refused: an
#: attention feature hf_ring does not implement (T5's ``position_bias``, ...) must raise, never be
#: dropped silently. ``softcap`` (Gemma2's attention logit softcapping) and ``s_aux`` (gpt-oss's learned
#: sinks) are implemented, as are Inkling 2's ``sinks`` (one per query); ``position_bias`` only as Inkling's patched
#: modules give it (its table by distance: the module holds a ``DistanceBias``).
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
    "output_router_logits",  # the MoE router's logits returned (a load-balancing loss: hf_ring.patches._router)
)  # fmt: skip


NUMBERS_FROM_MASK = ("opt",)
"""Model types whose model numbers its positions from the attention mask: ``apply_ring_attention`` renumbers them
(``hf_ring.patches.generic.MASK_POSITIONS``); switched by ``attn_implementation`` alone, they are refused."""


MAKES_A_MASK = ("biogpt",)
"""Model types whose model makes an all-ones attention mask of the local length when given none (BioGPT): such a
mask, without padding, is dropped (one host read per forward, kept in the plan cache); one with padding is refused
next to ``shard_batch``'s output as any other."""


def _unknown_kwargs_error(kwargs: dict) -> str | None:
    """Why keywords this function does not implement were passed with a value, or None."""
    known = (*_READ_KWARGS, *PACKING_KWARGS, *_HARMLESS_KWARGS)
    unknown = sorted(k for k, v in kwargs.items() if k not in known and v is not None and v is not False)
    if not unknown:
        return None
    return (
        f"hf_ring attention does not implement {unknown}: these keywords change what attention computes, and "
        "dropping them would give wrong numbers. hf_ring implements causal and sliding-window attention with "
        "scaling, GQA, packed documents, logit softcapping (softcap) and learned sinks (s_aux); use the model's "
        "own attention implementation for this model"
    )


def _sparse_error(indices) -> str | None:
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
    mask function, this only passes the padding information on (without a device sync). While a model whose layers
    are called without the batch's keywords runs (``ring_config.HANDED_OVER``), the mask comes with them (``Lent``).
    """
    mask = None if attention_mask is None else attention_mask[:, -kv_length:]
    stack = getattr(HANDED_OVER, "stack", None)
    if stack and kwargs.get("config") is stack[-1][1]:  # (the model running builds its mask: no other model's)
        return Lent(mask, stack[-1][2])
    return mask


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
            softcapping), ``s_aux`` (learned sinks, [q_heads]), ``ring_block_ids`` (bidirectional blocks),
            ``alibi_slopes`` (ALiBi's, [q_heads]: BLOOM's and MPT's forwards under hf_ring pass them), and
            keywords that do not change attention (``_HARMLESS_KWARGS``); any other keyword with a value raises
            ValueError (e.g. ``position_bias``): a feature hf_ring does not implement is never dropped silently.

    Returns:
        ``(out, None)``, out: [batch, local_seq, q_heads, v_head_dim] in query's dtype.
    """
    local = getattr(module, LOCAL_ATTR, None)
    if local is not None:
        return _attend_locally(local, module, query, key, value, attention_mask, scaling, dropout, kwargs)
    compressor_call = module.__dict__.pop(_compressed.ATTR, None)  # DeepSeek-V4 (hf_ring.patches._compressed)
    cfg: RingConfig = getattr(module, CONFIG_ATTR, _DEFAULT)
    if cfg is _DEFAULT and getattr(getattr(module, "config", None), "model_type", None) in NUMBERS_FROM_MASK:
        raise ValueError(  # (the same model on every rank: before any collective)
            f"{type(module).__name__}: this model numbers its positions from the attention mask, which shard_batch "
            "does not give it: switch the model with hf_ring.apply_ring_attention(model), which renumbers them "
            "(not only attn_implementation='hf_ring')"
        )
    if isinstance(attention_mask, SparseMask):  # a DSA attention module's (hf_ring.patches._sparse)
        call = attention_mask.call
        if call is not None:  # (its indexer's selection combined into the mask: Qwen4-Exp, GLM-5.3-Flash)
            kwargs = {**kwargs, "indices": call}
        attention_mask = attention_mask.mask
        if call is not None and pools_tokens(call.module):  # GLM-5.3-Flash: the 2-D padding mask its indexer got
            given = call.mask.mask if isinstance(call.mask, SparseMask) else call.mask
            attention_mask = batch_checks.without_all_true(given, cfg.plans)
    if getattr(getattr(module, "config", None), "model_type", None) in MAKES_A_MASK:
        attention_mask = batch_checks.without_all_true(attention_mask, cfg.plans)
    if kwargs.get("block_indices") is not None:  # MiniMax M3's indexer's blocks of keys, under their own name
        kwargs = {**kwargs, "indices": kwargs["block_indices"]}
    kwargs.pop("block_indices", None)
    bias, spec = kwargs.pop("position_bias", None), getattr(module, DISTANCE_BIAS_ATTR, None)
    if bias is not None and spec is None:  # (a dense bias of the shard's own keys: refused by name below)
        kwargs["position_bias"] = bias
    bias = None if bias is None or spec is None else dataclasses.replace(spec, table=bias)
    slopes = kwargs.pop("alibi_slopes", None)  # ALiBi's (BLOOM, MPT: their forward under hf_ring, patches._own)
    sinks = kwargs.get("s_aux")
    per_query = kwargs.pop("sinks", None)  # Inkling 2's: a sink per query, [batch, heads, seq, 1]
    if per_query is not None:
        if sinks is None and isinstance(per_query, torch.Tensor) and per_query.dim() == 4 and per_query.shape[-1] == 1:
            sinks = per_query.squeeze(-1)
        else:  # (refused by name below)
            kwargs["sinks"] = per_query
    unknown = _unknown_kwargs_error(kwargs) or _sparse_error(kwargs.get("indices"))
    if unknown:
        raise ValueError(unknown)  # from the model's code: the same on every rank, before any collective
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
    kwargs = batch_checks.with_model_positions(kwargs, query.shape[2])
    cache = kwargs.get(DECODE_KWARG)
    if cache is not None and cache.state.phase == "decode":
        out = _decode(module, query, key, value, cfg, cache, scaling, sliding_window, kwargs, sinks, bias, slopes)
        return out, None
    if compressor_call is None and isinstance(getattr(module, "compressor", None), torch.nn.Module):
        raise InStepError(  # (the same model on every rank, at the same layer: the group stays usable)
            f"{type(module).__name__}: this layer's compressor ran on one rank's tokens only: switch the model with "
            "hf_ring.apply_ring_attention(model), which compresses the whole sequence (not only "
            "attn_implementation='hf_ring')"
        )
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
    error = batch_checks.dropped_documents_error(module, kwargs, cfg)
    sharding = (
        None
        if error
        else batch_checks.sharding_error(module, kwargs, cfg, rank, world_size, local_len, positioned=True)
    )
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
    if bias is None:
        query, key, value = _autocast(query, key, value)
    try:  # what this rank finds wrong with its batch: through the ring's pre-flight exchange, so every rank raises
        if cfg.plans is None:
            document_ids, cu_seqlens = batch_checks.documents(attention_mask, kwargs, full, world_size)
        else:  # the same batch tensors in every layer: derive the documents (a host copy) once per forward
            sources = (attention_mask, *(kwargs.get(k) for k in (DOCUMENT_IDS_KWARG, *PACKING_KWARGS, "position_ids")))
            document_ids, cu_seqlens = cfg.plans.derived(
                sources, lambda: batch_checks.documents(attention_mask, kwargs, full, world_size)
            )
        by_positions = DOCUMENT_IDS_KWARG not in kwargs and all(kwargs.get(k) is None for k in PACKING_KWARGS)
        by_positions = by_positions and attention_mask is None
        if cfg.mixers and by_positions and several_documents(document_ids, cu_seqlens):
            raise_on_every_rank(PACKED_WITH_MIXERS, group=cfg.group, device=query.device)
        if isinstance(kwargs.get("indices"), IndexerCall) and picks_key_blocks(kwargs["indices"].module):
            _check_key_blocks(
                _packed(document_ids, cu_seqlens, cfg), cache
            )  # (the same on every rank: before any collective)
        if isinstance(kwargs.get("indices"), IndexerCall) and pools_tokens(kwargs["indices"].module):
            _check_pools(_packed(document_ids, cu_seqlens, cfg), cfg.layout, world_size)  # (the same on every rank)
        if _compressed.compresses(module):  # DeepSeek-V4: in every layer, so the first one finds it, before the ring
            if _packed(document_ids, cu_seqlens, cfg):  # (the same on every rank: the whole batch's documents)
                raise ValueError(_compressed.PACKED)
            _check_counted(kwargs, document_ids, cfg, full=full, rank=rank, world_size=world_size, device=query.device)
        shared = None
        if compressor_call is not None:  # DeepSeek-V4: the entries of the whole sequence, computed after the pre-flight
            problem = _compressed.error(
                compressor_call, layout=cfg.layout, world_size=world_size, local_len=local_len, ulysses=cfg.ulysses,
                rates=(getattr(getattr(module, "config", None), "compress_rates", None) or {}).values(),
            )  # fmt: skip
            if problem:  # (the configuration and this rank's length: at the first layer, before any ring call)
                raise ValueError(problem)
            shared = functools.partial(
                _compressed.resolve, compressor_call, group=cfg.group, layout=cfg.layout, timeout=cfg.timeout
            )
    except InStepError:
        raise
    except ValueError as e:  # (in the first layer, before any ring call of the forward: every rank is at it too)
        raise_on_every_rank(str(e), group=cfg.group, device=query.device)
    table = None
    if bias is not None:  # Inkling: scaled by the index in the row (in a packed row, in its document)
        table = bias.table
        if bias.log_scaling is not None:  # (Inkling's; Inkling 2's modules scale by position_ids themselves)
            rows = _bias_rows(document_ids, cu_seqlens, cache, full, rank, world_size, cfg, query.device)
            query, table = bias.scaled(query, rows)
        query, key, value = _autocast(query, key, value)
    chunk = batch_checks.chunk_size(module)
    if chunk is not None:  # (once per forward with a plan cache: the chunked layers share one plan)
        make = lambda: batch_checks.chunked(document_ids, cu_seqlens, full, chunk)  # noqa: E731
        documents = (document_ids, cu_seqlens, module.config)
        document_ids, cu_seqlens = (
            make() if cfg.plans is None else cfg.plans.derived((batch_checks.chunked, *documents), make)
        )
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
        sinks=sinks,
        cu_seqlens=cu_seqlens,
        document_ids=document_ids,
        block_ids=_block_ids(kwargs.get(BLOCK_IDS_KWARG), sliding_window),
        selected=selected,
        shared=shared,
        distance_bias=table,
        alibi_slopes=slopes,
        backend=cfg.backend,
        plans=cfg.plans,
        ulysses=cfg.ulysses,
        timeout=cfg.timeout,
    )
    return out.transpose(1, 2).contiguous(), None


def _packed(document_ids, cu_seqlens, cfg: RingConfig) -> bool:
    """Whether the batch packs several documents in a row (``several_documents``), once per forward with a plan
    cache."""
    make = lambda: several_documents(document_ids, cu_seqlens)  # noqa: E731
    return make() if cfg.plans is None else cfg.plans.derived((several_documents, document_ids, cu_seqlens), make)


def _check_counted(kwargs, document_ids, cfg: RingConfig, *, full: int, rank: int, world_size: int, device) -> None:
    """DeepSeek-V4's compressed layers read the position ids as the tokens' indices in the row (a query sees the
    windows ended by its position id): raise on every rank unless they are (padding aside). No host read when
    ``shard_batch`` numbered the tokens itself; else one host copy per forward."""
    info, ids = kwargs.get(SHARD_INFO_KWARG), kwargs.get("position_ids")
    if (isinstance(info, ShardInfo) and info.numbered) or not isinstance(ids, torch.Tensor):
        return
    make = lambda: _compressed.counts_from_zero(  # noqa: E731
        ids, document_ids, full=full, rank=rank, world_size=world_size, layout=cfg.layout
    )
    sources = (_compressed.counts_from_zero, ids, document_ids)
    if not (make() if cfg.plans is None else cfg.plans.derived(sources, make)):  # (this rank's own: so through the
        raise_on_every_rank(_compressed.NOT_COUNTED, group=cfg.group, device=device)  # ring's pre-flight exchange)


def _check_key_blocks(packed: bool, cache) -> None:
    """ValueError where MiniMax M3's block selection would not be the model's: its indexer counts its blocks from the
    row's first token and lets a query see the keys up to its position id, so a packed row's later documents would
    select among the earlier ones' blocks (Transformers leaves that undefined), and ``ring_generate``'s reference for
    a padded prompt, the row alone, has its blocks where the padding is not."""
    if packed:
        raise ValueError(
            "MiniMax M3's sparse attention layers count their blocks of keys from the row's first token and compare "
            "the keys' indices in the row with the queries' position ids: packed documents would select among each "
            "other's blocks; pass one document per row (padding is fine)"
        )
    if cache is not None and bool((cache.state.docs[:, cache.state.offset :] < 0).any()):
        raise ValueError(
            "ring_generate: MiniMax M3's sparse attention layers count their blocks of keys from the row's first "
            "token, so a padded prompt row selects other blocks than the row alone (as in Transformers): pass "
            "prompts without padding (one row, or rows of one length)"
        )


def _check_pools(packed: bool, layout: str, world_size: int) -> None:
    """ValueError where GLM-5.3-Flash's pooled selection cannot be the model's: its indexer cuts the row into pools
    from its first token that is not padding and lets a query see every earlier pool, so a packed row's documents
    would select among each other's pools; it takes its queries as consecutive positions (``hf_ring.sparse``), which
    a striped shard is not."""
    if packed:
        raise ValueError(
            "GLM-5.3-Flash's sparse attention layers cut the row into pools of keys from its first token and let a "
            "query see every earlier pool: packed documents would select among each other's pools; pass one document "
            "per row (padding is fine)"
        )
    if layout == "striped" and world_size > 1:
        raise ValueError(
            "GLM-5.3-Flash's sparse attention layers pick pools of keys for runs of consecutive positions, which a "
            "striped shard does not hold; use layout='zigzag' (the default) or 'contiguous'"
        )


def _attend_locally(implementation: str, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """A cross-attention call: the rank's queries against keys that are not the sequence's (image features, the same
    on every rank), as unsharded, by the implementation the model had (SDPA where that was eager: the same up to
    rounding; its cross-attention mask comes per local token, cut with the batch)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    run = ALL_ATTENTION_FUNCTIONS["sdpa" if implementation not in ALL_ATTENTION_FUNCTIONS else implementation]
    own = (DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG, POSITIONS_KWARG, BLOCK_IDS_KWARG, DECODE_KWARG)
    kwargs = {k: v for k, v in kwargs.items() if k not in own}
    return run(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _bias_rows(document_ids, cu_seqlens, cache, full: int, rank: int, world_size: int, cfg: RingConfig, device):
    """The indices by which Inkling's log scaling scales its queries and bias, [local] or [batch, local]: each token's
    index in its row, as the model counts it (in ring_generate, its padding before the prompt counted too); in a row
    packing several documents, its index in its document (each document as if alone, as its convolutions)."""
    if cache is not None:
        return _generated_rows(cache, device)

    def make():
        rows = positions(full, rank=rank, world_size=world_size, layout=cfg.layout, device=torch.device("cpu"))
        if _packed(document_ids, cu_seqlens, cfg):  # (decided per row: a row holding one document keeps its index)
            docs = document_ids if cu_seqlens is None else documents_from_cu_seqlens(cu_seqlens, full)[None]
            docs = docs.detach().cpu().long()
            within = index_in_document(docs)[1]
            rows = torch.where(packed_rows(docs)[:, None], within, torch.arange(full))[:, rows]
        return rows.to(device)

    # (once per forward: every layer, and the backward's recomputation, scale by the same rows)
    return make() if cfg.plans is None else cfg.plans.derived((_bias_rows, document_ids, cu_seqlens), make)


def _decode(
    module,
    query,
    key,
    value,
    cfg: RingConfig,
    cache,
    scaling,
    sliding_window,
    kwargs,
    sinks=None,
    bias=None,
    slopes=None,
) -> torch.Tensor:
    """A decode step of ``ring_generate``: the new tokens' queries (alike on every rank) against every rank's
    cached keys (``decode_attention``); [batch, new, q_heads, v_head_dim]. ``sinks``: per head or per query;
    ``bias``: Inkling's ``DistanceBias``; ``slopes``: ALiBi's."""
    from .decode import decode_attention

    st = cache.state
    index = getattr(module, "layer_idx", None)
    if index in st.kv_source:  # Gemma 4, Mistral Large 4: a KV-shared layer: its source layer's key positions
        layer = cache.layers[st.kv_source[index]]
    elif index is None or index < 0:  # a block shared by several layers (Zamba2): the layer its call just updated
        layer = st.updated
    else:
        layer = cache.layers[index]
    causal = _is_causal(module, kwargs)
    temperature = getattr(module, TEMPERATURE_ATTR, None)
    if temperature is not None:
        query = temperature.apply(query, _generated_rows(cache, query.device))
    table = None
    if bias is not None:
        query, table = bias.scaled(query, _generated_rows(cache, query.device))
    query, key, value = _autocast(query, key, value)
    docs = {}  # one document per row: only padding needs the document mask (costly tiles on the CPU)
    chunk = batch_checks.chunk_size(module)
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
        sinks=sinks,
        backend=cfg.backend,
        check=False,  # ring_generate checked the step across ranks once, before the first layer
        selected=selected,
        distance_bias=table,
        alibi_slopes=slopes,
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
