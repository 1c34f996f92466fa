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

import dataclasses

import torch

from . import layout as _layout
from .comm import RingComm, StateGather, group_rank_and_size
from .kernels.mask import BlockMask, upload
from .ring import host_document_ids

__all__ = ["CHUNK_BYTES", "IndexerCall", "SparseMask", "select", "select_decode"]

CHUNK_BYTES = 256 * 2**20
"""Default bound on the indexer's fp32 scores of one chunk of queries (``select``)."""


@dataclasses.dataclass(frozen=True)
class SparseMask:
    """The mask a DSA attention module is given while patched: what hf_ring's mask function made (None, or a 2-D
    padding mask at one rank), indexable as the module indexes a 4-D mask for its indexer (``[:, 0, :, :]``): any
    index gives the same wrapper. The attention function unwraps it."""

    mask: torch.Tensor | None

    def __getitem__(self, index) -> SparseMask:
        return self


class _StopIndexerError(Exception):
    """Raised by ``_LocalKeys`` to stop (not a failure) the indexer once it has computed its keys."""


class _LocalKeys:
    """Stands for the indexer's key cache: records the keys of the call's tokens and stops the indexer there."""

    keys: torch.Tensor | None = None

    def update_indexer(self, keys: torch.Tensor, layer_idx: int):
        self.keys = keys
        raise _StopIndexerError


class _WholeKeys:
    """Stands for the indexer's key cache: answers with the keys of the whole sequence."""

    def __init__(self, keys: torch.Tensor):
        self.keys = keys

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
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
    selected: torch.Tensor | None = None  # [batch, local_seq, K] int32 global positions, once resolved

    def run(self, rows: slice, cache, mask) -> torch.Tensor:
        """The model's indexer on the queries ``rows`` of this call, with ``cache`` and ``mask``."""
        cos, sin = self.position_embeddings
        cut = (slice(None), rows)
        pos = self.position_ids
        given = {
            "hidden_states": self.hidden_states[cut],
            "position_embeddings": (cos[cut], sin[cut]),
            "attention_mask": mask,
            # (Mistral Large 4's indexer scales its queries by their positions; the others take them unused)
            "position_ids": pos[cut] if isinstance(pos, torch.Tensor) and pos.dim() == 2 else pos,
            self.cache_name: cache,
        }
        if self.q_resid is not None:  # (DeepSeek-V3.2's queries come from the attention's query latent)
            given["q_resid"] = self.q_resid[cut]
        return type(self.module).forward(self.module, **given)


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
    CP group (and, under DeepSpeed ZeRO-3, one small all-reduce over its parameters' group); ``ring_attention`` calls it after
    its pre-flight check when given it as ``selected=functools.partial(select, call, ...)``.

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
    make = lambda: _visibility(cu_seqlens, document_ids, full, rank, world_size, layout, keys.device)  # noqa: E731
    seen = None if plans is None else plans.derived((_visibility, cu_seqlens, document_ids), make)
    if seen is None or seen[1].numel() != full or seen[1].device != keys.device:  # (another batch's, not reused)
        seen = make()
    q_pos, k_pos, docs = seen[:3]
    rows = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * batch * call.module.n_heads * full))
    chunks = -(-local_len // rows)
    zero3 = next((p.ds_process_group for p in call.module.parameters() if hasattr(p, "ds_process_group")), False)
    if zero3 is not False:
        # DeepSpeed ZeRO-3 gathers a layer's parameters over its group at each of the layer's calls: every rank of
        # that group calls the indexer's layers as often (a rank with fewer chunks runs empty ones)
        count = torch.tensor([chunks], device=keys.device)
        what = "the all-reduce of the sparse-attention indexer's chunk count (DeepSpeed ZeRO-3)"
        chunks = int(RingComm(zero3, timeout=timeout).all_reduce_max(count, what))
    whole = _WholeKeys(keys)
    picked = []
    for i in range(chunks):
        part = slice(min(local_len, i * rows), min(local_len, (i + 1) * rows))
        mask = BlockMask(
            q_pos=q_pos[part],
            k_pos=k_pos,
            causal=causal,
            q_doc=None if docs is None else docs[:, q_pos[part]],
            k_doc=docs,
        ).visible()
        picked.append(call.run(part, whole, mask))
    return _resolved(call, torch.cat(picked, dim=1))


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


def _local_keys(call: IndexerCall) -> torch.Tensor:
    """The indexer keys of the call's own tokens: the model's indexer run up to its key cache."""
    local = _LocalKeys()
    try:
        call.run(slice(None), local, None)
    except _StopIndexerError:
        pass
    if local.keys is None:
        raise RuntimeError(
            f"{type(call.module).__name__} did not read its key cache (update_indexer): hf_ring cannot give it the "
            "keys of the whole sequence"
        )
    return local.keys


def _resolved(call: IndexerCall, picked: torch.Tensor) -> torch.Tensor:
    """Record the call's selection (a layer reusing it takes it as it is) and let its arguments go."""
    call.selected = picked.to(torch.int32)
    call.hidden_states = call.q_resid = call.position_embeddings = call.position_ids = call.cache = None
    return call.selected


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
