"""DeepSeek sparse attention (DSA) under the ring: the indexer's top-k taken over the whole sequence.

DSA models (DeepSeek-V3.2, GLM-MoE-DSA, A.X K2, HunYuan V4 and V4 VL, Mistral Large 4, Dots3 Note) give their attention layers an indexer: a small
multi-head dot product (one key head, ReLU, weighted over its heads) scores every query against every key it may
see, and the attention then sees only the ``index_topk`` best keys of each query. Under context parallelism a
rank holds its own tokens only, while a query's top-k ranges over every earlier key of the sequence.

While a model is patched, its indexers compute nothing when called (``hf_ring.patches._sparse``): each returns an
``IndexerCall``, its module and its arguments, which the model hands on to the attention function (Transformers
passes it as ``indices``), and the attention function resolves it with ``select``:

1. the indexer's keys of this rank's tokens: the model's own indexer code, stopped where it reads its key cache;
2. gathered from every rank of the CP group (one all-gather of ``[batch, local_seq, index_head_dim]`` per indexer
   layer, in the forward only: the indexer takes no gradient) and put in sequence order;
3. the model's own indexer code again, on chunks of this rank's queries, its key cache answering with the whole
   sequence's keys and its mask being the ring's (causal, documents, padding: ``BlockMask``), so that each query's
   scores and top-k come from the same operations as in the unmodified model;
4. the top-k global positions go to ``ring_attention(selected=...)``, whose steps hide every other key.

Generation (``ring_generate``): the sharded cache keeps the indexer keys of every token on every rank (the prefill's
gathered, then each decode step's, computed alike on every rank); a decode step's queries pick their top-k from them
with no communication (``select_decode``), and ``decode_attention`` hides the other keys of each rank's shard. The
indexer keys are small beside the attention's (DeepSeek-V3.2: 128 values per token against a latent of 576).

A layer that reuses an earlier layer's top-k (GLM-MoE-DSA's and HunYuan V4's "shared" layers) is handed the same
``IndexerCall``, resolved once.

Qwen4-Exp's QSA indexer picks blocks of keys instead (``_select_blocks``): each query's visible tokens, cut into
blocks of ``compress_ratio`` from its document's first, scored by pooled block keys; the best ``budget / ratio``
blocks and the query's own incomplete block. Its model loops over queries one by one; hf_ring computes the same
operations for chunks of queries at once, from the whole sequence's indexer keys and rotary angles (one all-gather),
and returns the picked positions as ``select`` does (-1 where a query has fewer); in ``ring_generate`` the cache
keeps the keys and angles of every token on every rank, from which a decode step picks (``_decode_blocks``). Its
projections and norms run once per call (not per chunk of queries), and each query's top-k runs over its own
candidates, as the model's does, so that exact ties (the ReLU's zeros) break alike. Causal only, as the model is.

MiniMax M3's indexer picks blocks of keys per key/value head (``_select_key_blocks``): its keys of the whole
sequence come from one all-gather, then the model's own indexer code runs on chunks of this rank's queries, its cache
answering with them; the picked block indices go to ``ring_attention`` as a ``Selection`` (blocks of
``index_block_size`` keys, a list per key/value head). In ``ring_generate`` the keys and the blocks start after the
padding it puts in front of the prompt (``Selection.start``); a decode step picks from every token's keys, kept on
every rank.

GLM-5.3-Flash's indexer picks pools of tokens (``_select_pools``): pools of ``index_kpool`` tokens from the row's
first real token, each scored by a gated average of its tokens' keys, the best ``index_topk / index_kpool`` and the
query's own incomplete pool. The packed keys, gate scores and validity of the whole sequence come from one
all-gather; the model's own indexer code then runs on chunks of consecutive positions of this rank's queries, its
cache answering with them and with the position after the chunk as its length. One document per row, not striped
(``hf_attention`` refuses both). In ``ring_generate`` the cache keeps every token's packed keys on every rank, from
which a decode step picks (``_decode_pools``).

Kolibri 1.1's weightless indexer returns a mask (``MaskCall``, ``_select_by_mask``): an indexer layer picks each
query's pool of candidates (blocks of keys, by their averages), every indexed layer the top-k keys of the last pool
beside sink and local keys, all scored with key head 0. Its key head 0 of the whole sequence comes from one
all-gather per layer; the model's own ``select_pool`` and ``select_tokens`` run on chunks of this rank's queries, and
a later layer computes its source's pool again per chunk, from the queries and keys the source kept (a pool is as
large as a dense mask). ``ring_generate`` refuses it.

Memory: the indexer's scores are ``[batch, chunk, index_heads, seq]`` fp32 per chunk of queries, the chunk sized to
keep them within ``chunk_bytes`` (256 MiB by default; the pass also holds their ReLU, the chunk's other indexer
tensors, and an fp32 copy of the whole sequence's indexer keys); the unmodified model holds them for all its
queries at once. Each chunk runs the indexer's projections on its own queries again (the model's code computes
queries and keys in one call): little compute beside the scores, but under DeepSpeed ZeRO-3 one gather of their
weights per chunk, and every rank of the ZeRO group runs as many chunks (its gathers are collectives). The
indexer's own module is called once, for its record: it must not be a ZeRO-3 leaf module or an FSDP2 unit of its
own (decoder-layer units, the default, are fine).
Caveat: a top-k is not continuous. Keys whose scores tie at a query's k-th place, exactly (the ReLU gives exact zeros)
or within rounding, are picked by ``torch.topk`` in an order, and with a rounding, that depend on the row's length;
the ring hands it the whole sequence's row, as the unmodified model has it on the same batch (the same length), but
a batch padded or cut otherwise may pick another key (docs/transformers.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys

import torch

from . import layout as _layout
from .comm import RingComm, StateGather, group_rank_and_size
from .kernels.mask import BlockMask, Selection, upload
from .ring import host_document_ids

__all__ = [
    "CHUNK_BYTES",
    "IndexerCall",
    "MaskCall",
    "SparseMask",
    "picks_key_blocks",
    "pools_tokens",
    "select",
    "select_decode",
    "selects_by_mask",
]

CHUNK_BYTES = 256 * 2**20
"""Default bound on the indexer's fp32 scores of one chunk of queries (``select``)."""


@dataclasses.dataclass(frozen=True)
class SparseMask:
    """The mask a DSA attention module is given while patched: what hf_ring's mask function made (None, or a 2-D
    padding mask at one rank), indexable as the module indexes a 4-D mask for its indexer (``[:, 0, :, :]``): any
    index gives the same wrapper. A module that combines its indexer's selection with its boolean mask
    (Qwen4-Exp: ``mask & selection``) gets the wrapper back with the deferred call in ``call``. The attention
    function unwraps it."""

    mask: torch.Tensor | None
    call: IndexerCall | None = None

    dtype = torch.bool  # (what a module reads to choose between a boolean and an additive mask)

    def __getitem__(self, index) -> SparseMask:
        return self

    def __and__(self, other) -> SparseMask:
        if not isinstance(other, IndexerCall):
            return NotImplemented
        return dataclasses.replace(self, call=other)


class _StopIndexerError(Exception):
    """Raised by ``_LocalKeys`` to stop (not a failure) the indexer once it has computed its keys."""


class _StandIn:
    """A stand-in for the indexer's key cache, read as DSA indexers read theirs (``update_indexer(keys, layer)``) or as
    MiniMax M3's does (``layers[layer].update_index(keys)``)."""

    @property
    def layers(self):
        return self

    def __getitem__(self, layer_idx: int):
        return self

    def update_index(self, keys: torch.Tensor) -> torch.Tensor:
        return self.update_indexer(keys, None)


class _LocalKeys(_StandIn):
    """Stands for the indexer's key cache: records the keys of the call's tokens and stops the indexer there."""

    keys: torch.Tensor | None = None

    def update_indexer(self, keys: torch.Tensor, layer_idx: int | None):
        self.keys = keys
        raise _StopIndexerError


class _WholeKeys(_StandIn):
    """Stands for the indexer's key cache: answers with the keys of the whole sequence."""

    def __init__(self, keys: torch.Tensor):
        self.keys = keys

    def update_indexer(self, keys: torch.Tensor, layer_idx: int | None) -> torch.Tensor:
        return self.keys


@dataclasses.dataclass(eq=False)
class IndexerCall:
    """A DSA indexer's call, deferred to the attention function (``select``): the indexer module, its arguments,
    the name of its cache argument (``cache``, ``past_key_values`` before Transformers 5.24), and the model's own
    cache (None in training), which is given this rank's indexer keys as the unmodified indexer would."""

    module: torch.nn.Module
    hidden_states: torch.Tensor | None
    q_resid: torch.Tensor | None
    position_embeddings: tuple | None
    position_ids: torch.Tensor | None
    cache_name: str = "cache"
    cache: object = None
    selected: torch.Tensor | Selection | None = None  # once resolved: int32 global positions, or a Selection (M3)
    mask: object = None  # the mask the module gave its indexer (GLM-5.3-Flash's: the 2-D padding mask, wrapped)

    def run(self, rows: slice, cache, mask) -> torch.Tensor:
        """The model's indexer on the queries ``rows`` of this call, with ``cache`` and ``mask`` (MiniMax M3's takes
        no mask: its queries see the keys up to their positions)."""
        cut = (slice(None), rows)
        pos = self.position_ids
        given = {"hidden_states": self.hidden_states[cut], self.cache_name: cache}
        if self.position_embeddings is not None:  # (GLM-5.3-Flash's indexer has no RoPE)
            cos, sin = self.position_embeddings
            given["position_embeddings"] = (cos[cut], sin[cut])
        if _takes(self.module, "position_ids"):
            # (Mistral Large 4's indexer scales its queries by their positions; M3's compares them with the keys')
            given["position_ids"] = pos[cut] if isinstance(pos, torch.Tensor) and pos.dim() == 2 else pos
        if not picks_key_blocks(self.module):
            given["attention_mask"] = mask
        if self.q_resid is not None:  # (DeepSeek-V3.2's queries come from the attention's query latent)
            given["q_resid"] = self.q_resid[cut]
        return type(self.module).forward(self.module, **given)


@functools.cache
def _parameters(cls) -> tuple:
    """The names ``cls.forward`` takes, and whether it takes any keyword (``**kwargs``)."""
    params = inspect.signature(cls.forward).parameters.values()
    return tuple(p.name for p in params), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _takes(module, name: str) -> bool:
    """``module``'s forward takes the keyword ``name``."""
    names, any_keyword = _parameters(type(module))
    return any_keyword or name in names


def select(
    call: IndexerCall,
    *,
    group=None,
    layout: str = "zigzag",
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    timeout: float | None = None,
    plans=None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """The top-k keys of this rank's queries over the whole sequence: ``[batch, local_seq, K]`` int32 global
    positions (``ring_attention``'s ``selected``), computed once per ``call``. Collectives: one all-gather over the
    CP group (and, for a DSA indexer under DeepSpeed ZeRO-3, one small all-reduce over its parameters' group;
    Qwen4-Exp's calls its projections once, on every rank alike); ``ring_attention`` calls it after its pre-flight
    check when given it as ``selected=functools.partial(select, call, ...)``.

    Args:
        call: what the patched indexer returned (``IndexerCall``).
        group, layout: the CP group and the layout of the shards.
        causal, cu_seqlens, document_ids: what the indexer's queries may see, as ``ring_attention`` takes them
            (document ids of the unsharded sequence, -1 padding).
        timeout: seconds to wait for the peers in the all-gather of the indexer keys (CPU tensors on gloo).
        plans: the model's ``PlanCache``: the positions and documents go to the device once per forward (without
            it, once per call).
        chunk_bytes: bound on the fp32 scores of one chunk of queries (None: ``CHUNK_BYTES``).
    """
    if call.selected is not None:
        return call.selected
    rank, world_size = group_rank_and_size(group)
    if picks_key_blocks(call.module):
        return _resolved(call, _select_key_blocks(call, group, world_size, layout, chunk_bytes, timeout))
    where = dict(cu_seqlens=cu_seqlens, document_ids=document_ids, timeout=timeout, plans=plans)
    if isinstance(call, MaskCall):
        return _resolved(call, _select_by_mask(call, group, rank, world_size, layout, causal, chunk_bytes, **where))
    if _pools_blocks(call.module):
        return _resolved(call, _select_blocks(call, group, rank, world_size, layout, chunk_bytes, **where))
    if pools_tokens(call.module):
        return _resolved(call, _select_pools(call, group, rank, world_size, layout, chunk_bytes, **where))
    keys = local_keys = _local_keys(call)
    if world_size > 1:
        with torch.no_grad():
            shards = StateGather(group, timeout, what="the all-gather of the sparse-attention indexer keys").gather(
                keys
            )
        keys = _layout.unshard(list(shards), dim=1, layout=layout)
    if call.cache is not None:  # ring_generate's keeps the whole sequence's indexer keys, another cache its own
        whole = getattr(call.cache, "WHOLE_INDEXER_KEYS", False)
        call.cache.update_indexer(keys if whole else local_keys, call.module.layer_idx)
    batch, local_len = keys.shape[0], call.hidden_states.shape[1]
    full = keys.shape[1]
    q_pos, k_pos, docs = _seen(plans, cu_seqlens, document_ids, full, rank, world_size, layout, keys.device)[:3]
    rows = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * batch * call.module.n_heads * full))
    chunks = _chunk_count(call.module, -(-local_len // rows), keys.device, timeout)
    whole = _WholeKeys(keys)
    picked = []
    for i in range(chunks):
        part = slice(min(local_len, i * rows), min(local_len, (i + 1) * rows))
        picked.append(call.run(part, whole, _visible(q_pos[part], k_pos, docs, causal)))
    return _resolved(call, torch.cat(picked, dim=1))


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, docs: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Which keys each of the queries at ``q_pos`` may see (causal, documents, padding): ``[batch or 1, queries,
    keys]`` bool, the ring's mask as an indexer takes it (``docs``: the whole sequence's ids, -1 padding)."""
    q_doc = None if docs is None else docs[:, q_pos]
    return BlockMask(q_pos=q_pos, k_pos=k_pos, causal=causal, q_doc=q_doc, k_doc=docs).visible()


def _chunk_count(module, chunks: int, device, timeout) -> int:
    """How many chunks of queries this rank runs the indexer on: ``chunks``, or under DeepSpeed ZeRO-3 the most of any
    rank of its group (one all-reduce): ZeRO-3 gathers a layer's parameters over its group at each of the layer's
    calls, so every rank of that group calls the indexer's layers as often (a rank with fewer runs empty ones)."""
    zero3 = next((p.ds_process_group for p in module.parameters() if hasattr(p, "ds_process_group")), False)
    if zero3 is False:
        return chunks
    what = "the all-reduce of the sparse-attention indexer's chunk count (DeepSpeed ZeRO-3)"
    return int(RingComm(zero3, timeout=timeout).all_reduce_max(torch.tensor([chunks], device=device), what))


def selects_by_mask(module) -> bool:
    """The indexer returns the mask of the keys each query attends to, picked from a pool of candidates that an
    earlier layer's indexer selected (Kolibri 1.1: ``select_pool``, ``select_tokens``)."""
    return all(hasattr(module, name) for name in ("select_pool", "select_tokens", "is_pool_source"))


@dataclasses.dataclass(eq=False)
class MaskCall(IndexerCall):
    """The deferred call of an indexer that returns a mask (``selects_by_mask``): this layer's queries and keys as the
    model gave them, and the call of the indexer whose pool of candidates it picks from (itself for a pool source).
    Once resolved, a pool source keeps the queries its pool is scored by and the whole sequence's keys, from which a
    later layer's ``select`` computes the pool of its own chunks of queries again (a pool is ``[batch, queries,
    keys]``: kept whole, it would cost as much as a dense mask)."""

    queries: torch.Tensor | None = None  # [batch, heads, local_seq, head_dim]
    keys: torch.Tensor | None = None  # [batch, kv_heads, local_seq, head_dim]
    pool: MaskCall | None = None
    whole_keys: torch.Tensor | None = None  # once resolved: key head 0 of the whole sequence, [batch, 1, seq, dim]


def _select_by_mask(call: MaskCall, group, rank, world_size, layout, causal, chunk_bytes, *, cu_seqlens, document_ids,
                    timeout, plans) -> torch.Tensor:  # fmt: skip
    """Kolibri 1.1's selection over the whole sequence for this rank's queries: ``[batch, local_seq, topk + local +
    sinks]`` int32 global positions, -1 for none, by the model's own indexer code.

    Its indexer scores keys with key head 0 and the first ``num_heads`` query heads. A pool source picks each query's
    pool of candidates (all its visible keys, or the best blocks of ``compression`` keys, by block averages); every
    indexed layer then keeps the best ``topk`` of its pool's keys, the first ``num_sink_tokens`` and the last
    ``num_local_tokens`` of the query's visible ones. Here key head 0 of the whole sequence comes from one all-gather
    per layer, and the model's own ``select_pool`` and ``select_tokens`` run on chunks of this rank's queries, their
    mask the ring's (causal, documents, padding); a layer picking from an earlier layer's pool computes that pool
    again for its chunk, from the queries and keys its source kept. A query's keys are counted from its first
    visible one, as the model counts them (``query_groups``): keys no query of a chunk sees lie before that or after
    the query, where the model's scores never reach."""
    m = call.module
    with torch.no_grad():
        keys = call.keys[:, :1]
        if world_size > 1:
            what = "the all-gather of the sparse-attention indexer keys"
            keys = _layout.unshard(list(StateGather(group, timeout, what=what).gather(keys)), dim=2, layout=layout)
        queries = call.queries[:, : m.num_heads]
        source = call if m.is_pool_source else call.pool
        # (a pool source keeps the queries its pool is scored by and the whole keys, for the layers after it)
        call.whole_keys, call.queries = (keys, queries.detach()) if m.is_pool_source else (None, None)
        call.keys = call.pool = None
        if source is None or source.whole_keys is None:
            raise RuntimeError(
                f"layer {getattr(m, 'layer_idx', '?')}: its indexer picks from an earlier indexer's pool, which hf_ring "
                "was not given (the model's layers run out of order?)"
            )
        batch, local_len, full = queries.shape[0], queries.shape[2], keys.shape[2]
        q_pos, k_pos, docs = _seen(plans, cu_seqlens, document_ids, full, rank, world_size, layout, keys.device)[:3]
        rows = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * batch * full))
        budget = min(full, m.topk + m.num_local_tokens + m.num_sink_tokens)
        index = torch.arange(full, device=keys.device)
        picked = []
        for lo in range(0, local_len, rows):
            part = slice(lo, min(local_len, lo + rows))
            visible = _visible(q_pos[part], k_pos, docs, causal).expand(batch, -1, -1)
            pool = type(source.module).select_pool(
                source.module, source.queries[:, :, part], source.whole_keys, visible
            )
            chosen = type(m).select_tokens(m, queries[:, :, part], keys, visible, pool)
            first = torch.where(chosen, index, full).topk(budget, dim=-1, largest=False).values
            picked.append(torch.where(first < full, first, -1))
        return torch.cat(picked, dim=1)


def picks_key_blocks(module) -> bool:
    """The indexer keeps, per key/value head, the blocks of keys whose best key scores highest (MiniMax M3)."""
    return all(hasattr(module, name) for name in ("block_size", "topk_blocks", "local_blocks"))


def _select_key_blocks(call, group, world_size: int, layout: str, chunk_bytes, timeout) -> Selection:
    """MiniMax M3's selection over the whole sequence for this rank's queries: blocks of ``block_size`` keys per
    key/value head, ``[batch, kv_heads, local_seq, topk_blocks]`` (-1 for none), by the model's own indexer code.

    Its indexer scores each query against every key up to the query's position (its ``position_ids``, compared with
    the keys' indices in the row), max-pools the scores per block of keys counted from the row's first, keeps the
    ``index_local_blocks`` blocks ending at the query's and the best others. Here its keys of the whole sequence come
    from one all-gather (one key head: ``[batch, 1, seq, index_head_dim]``), then the model's code runs on chunks of
    this rank's queries, its cache answering with them. In ``ring_generate`` the prompt's padding in front is not
    the model's row: the keys start after it, and so do the blocks (``Selection.start``).
    """
    m = call.module
    with torch.no_grad():
        own = keys = _local_keys(call)  # [batch, 1, local, dim]
        if world_size > 1:
            what = "the all-gather of the sparse-attention indexer keys"
            keys = _layout.unshard(list(StateGather(group, timeout, what=what).gather(own)), dim=2, layout=layout)
        start = 0
        if getattr(call.cache, "WHOLE_INDEXER_KEYS", False):  # ring_generate's: every token's keys on every rank
            start = call.cache.state.offset
            call.cache.update_indexer(keys[:, 0], m.layer_idx)
        elif call.cache is not None:  # the model's own cache, at one rank: its keys, as the model gives it them
            call.cache.layers[m.layer_idx].update_index(own)
        keys = keys[:, :, start:]
        batch, local_len, full = keys.shape[0], call.hidden_states.shape[1], keys.shape[2]
        rows = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * batch * m.num_heads * max(1, full)))
        chunks = _chunk_count(m, -(-local_len // rows), keys.device, timeout)
        whole = _WholeKeys(keys)
        parts = [slice(min(local_len, i * rows), min(local_len, (i + 1) * rows)) for i in range(chunks)]
        picked = torch.cat([call.run(part, whole, None) for part in parts], dim=2)
        return Selection(picked.to(torch.int32), m.block_size, start)


def select_decode(call: IndexerCall, cache, *, q_pos: torch.Tensor, prompt_docs: torch.Tensor, causal: bool = True):
    """The top-k keys of a decode step's queries over the whole sequence: ``[batch, new, K]`` int32 global positions,
    computed once per ``call``. The decode step's tokens are the same on every rank, and ``cache`` (``ring_generate``'s
    sharded cache) keeps the indexer keys of every token on every rank (``update_indexer``: the prefill's gathered,
    then each step's own), so every rank picks the same keys with no communication.

    Args:
        call: what the patched indexer returned. cache: the sharded cache.
        q_pos: [new] global positions of the step's tokens; prompt_docs: [batch, prompt] int32 document ids of the
            (padded) prompt, -1 padding (the new tokens are of document 0).
    """
    if call.selected is not None:
        return call.selected
    if picks_key_blocks(call.module):  # (MiniMax M3: its keys and blocks start after ring_generate's padding)
        with torch.no_grad():
            keys = cache.update_indexer(_local_keys(call)[:, 0], call.module.layer_idx)[:, None, cache.state.offset :]
            picked = call.run(slice(None), _WholeKeys(keys), None)
        return _resolved(call, Selection(picked.to(torch.int32), call.module.block_size, cache.state.offset))
    if _pools_blocks(call.module):
        return _resolved(call, _decode_blocks(call, cache, q_pos, prompt_docs))
    if pools_tokens(call.module):
        return _resolved(call, _decode_pools(call, cache))
    keys = cache.update_indexer(_local_keys(call), call.module.layer_idx)  # [batch, every token so far, dim]
    full = keys.shape[1]
    docs = torch.cat([prompt_docs, prompt_docs.new_zeros(prompt_docs.shape[0], full - prompt_docs.shape[1])], 1)
    mask = BlockMask(
        q_pos=q_pos.cpu().long(),
        k_pos=torch.arange(full),
        causal=causal,
        q_doc=torch.zeros(1, q_pos.numel(), dtype=torch.int32),
        k_doc=docs,
    ).visible()
    return _resolved(call, call.run(slice(None), _WholeKeys(keys), mask.to(keys.device)))


def pools_tokens(module) -> bool:
    """The indexer scores pools of ``index_kpool`` tokens counted from the row's first token that is not padding, and
    adds the query's incomplete pool (GLM-5.3-Flash)."""
    return hasattr(module, "index_kpool") and hasattr(module, "get_pooled_states")


class _PooledKeys(_WholeKeys):
    """Stands for GLM-5.3-Flash's indexer cache: answers with the whole sequence's packed keys, gate scores and
    validity, its length as the position after the call's last query (its queries: the ``q_length`` before it)."""

    def __init__(self, keys: torch.Tensor, end: int):
        super().__init__(keys)
        self.end = end

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.end


def _select_pools(call, group, rank, world_size, layout, chunk_bytes, *, cu_seqlens, document_ids, timeout, plans):
    """GLM-5.3-Flash's selection over the whole sequence for this rank's queries: ``[batch, local_seq, index_topk +
    index_kpool - 1]`` int32 global positions, -1 for none, by the model's own indexer code.

    Its indexer packs each token's key, pool gate scores and validity (padding: 0), cuts the row into pools of
    ``index_kpool`` tokens from its first valid token, scores each query against the pools whose last token it may
    see, keeps the best ``index_topk / index_kpool`` and its own incomplete pool, and gives padding queries none.
    Here the packed tokens of this rank come from the model's code (stopped at its cache), the whole sequence's from
    one all-gather; then the model's code runs on chunks of consecutive positions of this rank's queries, its cache
    answering with the whole sequence and with the position after the chunk as its length (its queries: the chunk).
    Padding is the batch's (``document_ids`` -1: ``shard_batch``'s, or at one rank those of the mask the model gave its
    indexer, which ``hf_attention`` passes on). One document per row (``hf_attention`` refuses packed rows: the
    model's pools run across documents).
    """
    m = call.module
    hidden = call.hidden_states
    batch, local_len = hidden.shape[:2]
    full = local_len * world_size
    with torch.no_grad(), _gathered(m):
        q_pos, _, docs = _seen(plans, cu_seqlens, document_ids, full, rank, world_size, layout, hidden.device)[:3]
        if docs is not None:  # (the batch's padding: shard_batch's, or the model's mask at one rank)
            valid = (docs >= 0).expand(batch, full)[:, q_pos]
        else:
            valid = torch.ones(batch, local_len, dtype=torch.bool, device=hidden.device)
        own = packed = _local_keys(call, valid)
        if world_size > 1:
            what = "the all-gather of the sparse-attention indexer keys"
            packed = _layout.unshard(list(StateGather(group, timeout, what=what).gather(packed)), dim=1, layout=layout)
        if call.cache is not None:  # ring_generate's keeps every token's, the model's own (at one rank) its tokens'
            call.cache.update_indexer(packed if getattr(call.cache, "WHOLE_INDEXER_KEYS", False) else own, m.layer_idx)
        rows = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * batch * m.n_heads * max(1, -(-full // m.index_kpool))))
        host = _layout.positions(full, rank=rank, world_size=world_size, layout=layout)  # (on the host: no sync)
        starts = [0, *(torch.nonzero(host[1:] != host[:-1] + 1).flatten() + 1).tolist()]
        parts = []
        for lo, hi in zip(starts, [*starts[1:], local_len]):  # runs of consecutive positions, cut into chunks
            parts += [slice(a, min(hi, a + rows)) for a in range(lo, hi, rows)]
        chunks = _chunk_count(m, len(parts), hidden.device, timeout)  # (ZeRO-3: as many on every rank of its group)
        picked = []
        for i in range(chunks):  # a rank with fewer runs its first query again, the result dropped (the model's code
            part = parts[i] if i < len(parts) else slice(0, 1)  # takes no empty chunk)
            got = call.run(part, _PooledKeys(packed, int(host[part.stop - 1]) + 1), valid[:, part])
            if i < len(parts):
                picked.append(got)
        return torch.cat(picked, dim=1)


def _gathered(module):
    """A context in which ``module``'s own parameters are whole: under DeepSpeed ZeRO-3, gathered over their group
    (a collective: every rank of it runs the indexer layers as often); else nothing. GLM-5.3-Flash's indexer reads its
    pool gate and position weights directly, outside its module's call (where ZeRO-3 would gather them)."""
    own = [p for p in module.parameters(recurse=False) if hasattr(p, "ds_id")]
    if not own:
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # only those still partitioned: TRL's generation already gathers every parameter (DeepSpeed refuses a nested
    # context over the same ones), and those below ZeRO-3's persistence threshold stay whole (alike on every rank)
    own = [p for p in own if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    return deepspeed.zero.GatheredParameters(own) if own else contextlib.nullcontext()


def _decode_pools(call, cache) -> torch.Tensor:
    """GLM-5.3-Flash's selection of a decode step's queries (``select_decode``): the cache holds every token's packed
    keys, gate scores and validity on every rank (the prefill's gathered, then each step's, every new token valid),
    so every rank picks the same pools with no communication, by the model's own code."""
    m = call.module
    hidden = call.hidden_states
    with torch.no_grad(), _gathered(m):
        valid = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        packed = cache.update_indexer(_local_keys(call, valid), m.layer_idx)  # [batch, every token so far, 2 dim + 1]
        return call.run(slice(None), _PooledKeys(packed, packed.shape[1]), valid)


def _pools_blocks(module) -> bool:
    """The indexer scores blocks of ``compress_ratio`` keys, not single keys (Qwen4-Exp's QSA indexer)."""
    return hasattr(module, "compress_ratio") and hasattr(module, "block_topk")


def _defined_beside(module, name: str):
    """``name`` from the Transformers module defining ``module``'s class, looked up along its bases (FSDP2 gives a
    sharded module a class of its own, defined elsewhere)."""
    for cls in type(module).__mro__:
        found = getattr(sys.modules.get(cls.__module__), name, None)
        if found is not None:
            return found
    raise ValueError(f"{type(module).__name__}: found no {name} beside its class (not a Transformers module)")


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """A row's blocks of ``r`` consecutive visible tokens of one document, counted from its first token (the
    tokens a query may see in sequence order, cut every ``r``; a document's last, incomplete block is none), and
    where each token stands in its document. ``order`` lists the row's positions document by document (padding
    last), ``rank[t]`` is the index of ``order`` holding position ``t``, ``count[t]`` the number of visible tokens of
    its document up to and including ``t`` (0 for padding); block ``i`` holds positions ``tokens[i]``, is block
    ``index[i]`` of document ``doc[i]``."""

    full: int
    r: int
    order: torch.Tensor
    rank: torch.Tensor
    count: torch.Tensor
    doc: torch.Tensor
    tokens: torch.Tensor
    index: torch.Tensor
    docs: torch.Tensor  # [full] document id of every position (-1 padding)


def _blocks(docs: torch.Tensor | None, row: int, full: int, r: int, device) -> _Blocks:
    """``_Blocks`` of row ``row`` of ``docs`` ([1 or batch, full] ids, -1 padding; None: one document)."""
    d = torch.zeros(full, dtype=torch.long, device=device) if docs is None else docs[min(row, docs.shape[0] - 1)].long()
    pad = d < 0
    order = torch.sort(torch.where(pad, d.max() + 1, d), stable=True).indices
    ds, idx = d[order], torch.arange(full, device=device)
    new = torch.ones(full, dtype=torch.bool, device=device)
    new[1:] = ds[1:] != ds[:-1]
    cs = idx - torch.cummax(torch.where(new, idx, 0), 0).values  # place in its document
    group = new.cumsum(0) - 1
    length = torch.bincount(group)[group]
    heads = torch.nonzero((ds >= 0) & (cs % r == 0) & (cs + r <= length)).flatten()
    rank = torch.empty_like(order)
    rank[order] = idx
    count = torch.empty_like(order)
    count[order] = torch.where(ds >= 0, cs + 1, 0)
    tokens = order[heads[:, None] + torch.arange(r, device=device)]
    return _Blocks(full, r, order, rank, count, ds[heads], tokens, cs[heads] // r, d)


def _select_blocks(call, group, rank, world_size, layout, chunk_bytes, *, cu_seqlens, document_ids, timeout, plans):
    """Qwen4-Exp's QSA selection over the whole sequence, for this rank's queries: ``[batch, local_seq, budget + r -
    1]`` int32 global positions, -1 for none.

    Each query sees its document's visible tokens in order, cut into blocks of ``r`` (``_Blocks``). A block's key is
    the mean of its tokens' indexer keys, normalised, rotated to the block's first position; a query scores every
    complete block it may see (the sum over the indexer heads of the ReLU of the dot products, over the square root
    of the head size), keeps the ``budget / r`` best and the incomplete block it stands in. The indexer keys of the
    whole sequence (one key head) and their rotary angles come from one all-gather; the blocks, once per batch row
    and layer, then the scores by chunks of queries within ``chunk_bytes``. The model's indexer loops over queries and
    reads the same operations.
    """
    m = call.module
    with torch.no_grad():
        q, own, dtypes = _block_inputs(call)
        mine = own
        if world_size > 1:
            what = "the all-gather of the sparse-attention indexer keys"
            mine = _layout.unshard(list(StateGather(group, timeout, what=what).gather(own)), dim=1, layout=layout)
        if call.cache is not None:  # ring_generate's keeps the whole sequence's keys and angles, another its own keys
            whole = getattr(call.cache, "WHOLE_INDEXER_KEYS", False)
            call.cache.update_indexer(mine if whole else _packed(m, own, dtypes)[0], m.layer_idx)
        full = mine.shape[1]
        seen = _seen(plans, cu_seqlens, document_ids, full, rank, world_size, layout, q.device)
        q_pos, docs = seen[0], seen[2]
        cuts = []
        for row in range(q.shape[0]):
            make_blocks = lambda row=row: _blocks(docs, row, full, m.compress_ratio, q.device)  # noqa: E731
            blocks = None if plans is None else plans.derived((_blocks, docs, m.compress_ratio, row), make_blocks)
            if blocks is None or blocks.full != full or blocks.r != m.compress_ratio or blocks.order.device != q.device:
                blocks = make_blocks()
            cuts.append(blocks)
        return _picks(m, q, mine, dtypes, cuts, q_pos, chunk_bytes)


def _block_inputs(call) -> tuple:
    """``(queries [batch, n, heads, dim], [batch, n, dim + 2 angles] keys and their rotary cos and sin, (the keys'
    dtype, the angles'))`` of the indexer's ``n`` tokens (the call's hidden states; its rotary angles may cover tokens
    before them, the model's cached positions in a decode step: the last ``n``), as the model's indexer computes
    them. The keys and angles travel together in a dtype holding both exactly."""
    m = call.module
    rotate = _defined_beside(m, "apply_rotary_pos_emb")
    hidden = call.hidden_states
    batch, n, _ = hidden.shape
    cos, sin = (t[:, t.shape[1] - n :] for t in call.position_embeddings)
    dim, heads = m.index_head_dim, m.index_n_heads
    q, keys = m.index_qk_proj(hidden).split([heads * dim, m.index_kv_heads * dim], dim=-1)
    q = rotate(m.q_layernorm(q.reshape(batch, n, -1, dim)), cos=cos, sin=sin, unsqueeze_dim=2)
    common = torch.promote_types(keys.dtype, cos.dtype)
    packed = torch.cat([t.expand(batch, n, -1).to(common) for t in (keys, cos, sin)], dim=-1)  # (one key head)
    return q, packed, (keys.dtype, cos.dtype)


def _packed(m, packed: torch.Tensor, dtypes: tuple) -> tuple:
    """``(keys, cos, sin)`` of ``_block_inputs``' packed tensor, each in its own dtype."""
    keys_dtype, cos_dtype = dtypes
    angles = (packed.shape[-1] - m.index_head_dim) // 2
    keys, cos, sin = packed.split([m.index_head_dim, angles, angles], dim=-1)
    return keys.to(keys_dtype), cos.to(cos_dtype), sin.to(cos_dtype)


def _picks(m, q, packed, dtypes: tuple, cuts: list, q_pos, chunk_bytes) -> torch.Tensor:
    """Every row's selection from the whole sequence's ``packed`` keys and angles and the rows' blocks (``cuts``):
    ``[batch, queries, budget + r - 1]`` int32 global positions, -1 for none."""
    rotate = _defined_beside(m, "apply_rotary_pos_emb")
    keys, cos, sin = _packed(m, packed, dtypes)
    r, dim = m.compress_ratio, m.index_head_dim
    # every row's block keys: the mean of their tokens' keys, normalised (one call of the norm for all rows, as often
    # on every rank: DeepSpeed ZeRO-3 gathers its weight at each call), rotated to their first position
    means = [keys[b].index_select(0, blk.tokens.flatten()).view(-1, r, dim).float().mean(dim=1) for b, blk in
             enumerate(cuts)]  # fmt: skip
    normed = m.k_layernorm(torch.cat(means).to(keys.dtype)).split([len(x) for x in means])
    out = torch.empty((*q.shape[:2], m.token_budget + r - 1), dtype=torch.int32, device=q.device)
    for b, (blocks, pooled) in enumerate(zip(cuts, normed)):
        start = blocks.tokens[:, 0]
        pooled = rotate(pooled.unsqueeze(1), cos=cos[b][start], sin=sin[b][start]).squeeze(1)
        out[b] = _pick(m, q[b], pooled.float(), blocks, q_pos, chunk_bytes)
    return out


def _decode_blocks(call, cache, q_pos: torch.Tensor, prompt_docs: torch.Tensor) -> torch.Tensor:
    """Qwen4-Exp's QSA selection of a decode step's queries (``select_decode``): the cache holds every token's
    indexer keys and rotary angles on every rank (the prefill's gathered, then each step's), so every rank picks
    the same blocks with no communication."""
    m = call.module
    with torch.no_grad():
        q, mine, dtypes = _block_inputs(call)
        packed = cache.update_indexer(mine, m.layer_idx)  # [batch, every token so far, dim + 2 angles]
        full = packed.shape[1]
        new = prompt_docs.new_zeros(prompt_docs.shape[0], full - prompt_docs.shape[1])  # (the new tokens: document 0)
        docs = torch.cat([prompt_docs, new], dim=1).to(q.device)
        cuts = [_blocks(docs, row, full, m.compress_ratio, q.device) for row in range(q.shape[0])]
        return _picks(m, q, packed, dtypes, cuts, q_pos.to(q.device).long(), None)


def _pick(m, q, pooled, blocks: _Blocks, q_pos, chunk_bytes) -> torch.Tensor:
    """One row's selection (``_select_blocks``): ``[local_seq, budget + r - 1]`` global positions, -1 for none.
    Each query's top-k runs over its own candidates, its document's first ``complete`` blocks, as the model's does
    (``torch.topk`` breaks exact ties, which the ReLU makes common, by the row it is given): queries with the same
    candidates (of one document, as many tokens seen but for the last ``r``) take theirs in one call."""
    r, dim = blocks.r, m.index_head_dim
    n = q.shape[0]
    qd, count = blocks.docs[q_pos], blocks.count[q_pos]
    complete = count // r
    out = torch.full((n, m.token_budget + r - 1), -1, dtype=torch.long, device=q.device)
    behind = torch.arange(r - 1, device=q.device)  # the query's incomplete block: itself and the tokens before it
    tail = blocks.order[(blocks.rank[q_pos][:, None] - behind).clamp_min(0)]
    out[:, m.block_topk * r :] = torch.where(behind < (count - complete * r)[:, None], tail, -1)
    found = blocks.tokens.shape[0]
    if found == 0:
        return out
    first = torch.searchsorted(blocks.doc, qd.to(blocks.doc.dtype))  # each query's document's first block
    rows = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * m.index_n_heads * found))
    for lo in range(0, n, rows):
        part = slice(lo, min(n, lo + rows))
        scores = torch.matmul(q[part].float(), pooled.transpose(-1, -2)).relu().sum(dim=1) / math.sqrt(dim)
        same = {}
        for i, key in enumerate(zip(first[part].tolist(), complete[part].tolist())):
            if key[1] > 0:
                same.setdefault(key, []).append(i)
        for (f, c), members in same.items():
            who = torch.tensor(members, device=q.device)
            top = scores[who, f : f + c].topk(min(m.block_topk, c), dim=-1).indices
            out[lo + who, : top.shape[1] * r] = blocks.tokens[f + top].flatten(1)
    return out


def _local_keys(call: IndexerCall, mask=None) -> torch.Tensor:
    """The indexer keys of the call's own tokens: the model's indexer run up to its key cache (with ``mask``: GLM-5.3-
    Flash's packs each token's validity beside its key)."""
    local = _LocalKeys()
    try:
        call.run(slice(None), local, mask)
    except _StopIndexerError:
        pass
    if local.keys is None:
        raise RuntimeError(
            f"{type(call.module).__name__} did not read its key cache (update_indexer): hf_ring cannot give it the "
            "keys of the whole sequence"
        )
    return local.keys


def _resolved(call: IndexerCall, picked):
    """Record the call's selection (a layer reusing it takes it as it is) and let its arguments go."""
    call.selected = picked if isinstance(picked, Selection) else picked.to(torch.int32)
    call.hidden_states = call.q_resid = call.position_embeddings = call.position_ids = call.cache = None
    return call.selected


def _seen(plans, cu_seqlens, document_ids, full: int, rank: int, world_size: int, layout: str, device) -> tuple:
    """``_visibility``, built once per forward when ``plans`` (the model's ``PlanCache``) is given."""
    make = lambda: _visibility(cu_seqlens, document_ids, full, rank, world_size, layout, device)  # noqa: E731
    seen = None if plans is None else plans.derived((_visibility, cu_seqlens, document_ids), make)
    if seen is None or seen[1].numel() != full or seen[1].device != device:  # (another batch's, not reused)
        seen = make()
    return seen


def _visibility(cu_seqlens, document_ids, full: int, rank: int, world_size: int, layout: str, device) -> tuple:
    """``(query positions, key positions, document ids or None, pinned host copies)`` on ``device``: what the
    indexer's masks are built from (``BlockMask.visible`` on the device)."""
    pinned = []
    docs = host_document_ids(cu_seqlens, document_ids, full)
    q_pos = _layout.positions(full, rank=rank, world_size=world_size, layout=layout)
    return (
        upload(q_pos, device, pinned),
        upload(torch.arange(full), device, pinned),
        None if docs is None else upload(docs, device, pinned),
        pinned,
    )
