"""DeepSeek-V4's compressed attention layers under the ring: the compressed entries of the whole sequence.

Every DeepSeek-V4 attention layer attends over a sliding window of the sequence's keys (one key/value head, keys and
values one tensor) with learned sinks. Its compressed layers add entries that each summarise a window of
``compress_rate`` tokens: an entry is a softmax-gated sum of the window's projections (``kv_proj``, gated by
``gate_proj`` plus a learned bias per slot), normalised and rotated at its window's first position. Heavily compressed
layers (HCA, 128 tokens in the released configs) show a query every entry whose window has ended by its position.
Compressed sparse layers (CSA, 4 tokens) overlap each window with the one before (the entry pools two series over
``2 * compress_rate`` tokens), and their indexer, a smaller compressor of its own with a scorer, keeps the best
``index_topk`` of those entries per query. Transformers concatenates the entries to the window's keys and masks them
per query (``block_bias``).

Under the ring a rank holds its own tokens, while a query's entries range over the whole sequence. While a model is
patched, each compressor computes nothing when called (``hf_ring.patches._compressed``): it records its call on its
attention module and returns no entries, so the model's keys stay the rank's own; the attention function resolves the
record with ``resolve``:

1. each rank compresses the windows of its own chunks of the layout, the model's own projections and operations on
   them; a CSA window that opens a chunk takes the previous window's first series from the rank holding it (one small
   all-gather of every chunk's last window, with its gradient);
2. the entries of every rank are gathered (one all-gather of ``[batch, local_seq / compress_rate, head_dim]``,
   whose backward sums every rank's gradient of each entry) and put in sequence order;
3. a CSA layer's indexer does the same with its own compressor (no gradient: its top-k is not differentiable), then
   scores this rank's queries against every entry by the model's own scorer and keeps the top-k the model keeps;
4. ``ring_attention`` attends each query to the entries it sees (``SharedKeys``: causal by the position of each
   window's last token, the indexer's selection as a ``Selection`` of blocks of ``compress_rate`` positions), merged
   with the ring's sliding window and the sinks into one softmax.

Windows must not straddle ranks: with more than one rank the layout's chunks (half of the local tokens in zig-zag,
all of them contiguous) must be multiples of every compress rate, and the striped layout (which deals tokens one by
one) is refused. One document per row: packed documents are refused, since the model's compressor and indexer run
across documents. Padding is fine; as in Transformers, entries of padding windows are not masked (with padding at the
end, which collators put there, no query of a real token sees one). Not with the Ulysses x Ring hybrid, nor
``ring_generate`` (the compressors' cache is the model's own).

Memory: the entries of the whole sequence (``seq / compress_rate`` of them per compressed layer) on every rank, and a
CSA indexer's scores ``[batch, chunk, index_heads, seq / compress_rate]`` fp32 for chunks of this rank's queries sized
to ``hf_ring.sparse.CHUNK_BYTES`` (the unmodified model holds them for all its queries at once).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import layout as _layout
from . import sparse as _sparse
from .comm import StateGather, group_rank_and_size
from .kernels.mask import Selection
from .ring import SharedKeys
from .sparse import _defined_beside

__all__ = [
    "ATTR",
    "LAYER_TYPES",
    "NOT_COUNTED",
    "PACKED",
    "CompressorCall",
    "chunk_multiple",
    "compresses",
    "counts_from_zero",
    "error",
    "resolve",
]

ATTR = "_hf_ring_compressor_call"
"""Where a patched compressor records its call on its attention module, for the attention function."""


@dataclasses.dataclass(frozen=True)
class CompressorCall:
    """A compressed layer's compressor call, recorded while patched: its module and its arguments."""

    module: torch.nn.Module
    hidden_states: torch.Tensor
    q_residual: torch.Tensor
    position_ids: torch.Tensor


LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
"""DeepSeek-V4's compressed layer types."""


def compresses(module) -> bool:
    """``module`` is an attention module of a DeepSeek-V4 model with compressed layers (any of its layers)."""
    types = getattr(getattr(module, "config", None), "layer_types", None) or ()
    return hasattr(module, "compressor") and any(t in LAYER_TYPES for t in types)


def _rates(call: CompressorCall) -> list[int]:
    """The compress rates of the call's compressor and of its indexer, if any."""
    indexer = getattr(call.module, "indexer", None)
    return [call.module.compress_rate] + ([indexer.compress_rate] if indexer is not None else [])


def chunk_multiple(model) -> int:
    """The multiple of tokens each chunk of the layout must hold for ``model`` under context parallelism (with more
    than one rank; ``shard_batch(chunk_multiple=...)`` pads to it): the lcm of the compress rates of DeepSeek-V4's
    compressed layers and their indexers, 1 for every other model. ``model``: a Transformers model, or a wrapper
    of one (PEFT, DDP)."""
    rates = []
    for module in model.modules():
        if compresses(module) and module.compressor is not None:
            indexer = getattr(module.compressor, "indexer", None)
            rates += [module.compressor.compress_rate] + ([indexer.compress_rate] if indexer is not None else [])
    return math.lcm(*rates) if rates else 1


def counts_from_zero(position_ids, document_ids, *, full: int, rank: int, world_size: int, layout: str) -> bool:
    """Whether this rank's ``position_ids`` are its tokens' indices in the row (what the model's compressors and the
    ring's mask of their entries both read), padding aside (``document_ids`` < 0); a host copy of them."""
    mine = _layout.positions(full, rank=rank, world_size=world_size, layout=layout)
    same = position_ids.detach().cpu() == mine
    if document_ids is not None:
        same = same | (_layout.shard(document_ids, dim=1, rank=rank, world_size=world_size, layout=layout) < 0)
    return bool(same.all())


PACKED = (
    "DeepSeek-V4's compressed attention layers compress windows of the row and rank them across documents, as the "
    "model does: packed documents would share entries; pass one document per row (padding is fine)"
)
"""The error of a packed batch."""

NOT_COUNTED = (
    "DeepSeek-V4's compressed attention layers need position ids that count each row's tokens from 0 (the model lets a "
    "query see the windows ended by its position id, which otherwise may not have ended by the query): pass none, or "
    "0, 1, ..."
)
"""The error of a batch whose position ids are not its tokens' indices (``counts_from_zero``)."""


def error(call: CompressorCall, *, layout: str, world_size: int, local_len: int, ulysses, rates=()) -> str | None:
    """Why this compressed layer cannot run under the ring with these settings, or None (the same on every rank: the
    model's configuration and the batch's shape, before any collective). ``rates``: every compress rate of the model
    (``config.compress_rates``' values), for the padding the message asks for."""
    what = f"DeepSeek-V4's compressed attention layers ({type(call.module).__name__})"
    if ulysses is not None and ulysses.ulysses_size > 1:
        return f"{what} are not supported with the Ulysses x Ring hybrid: apply_ring_attention(model, ulysses=1)"
    if world_size == 1:
        return None
    if layout == "striped":
        return f"{what} compress windows of consecutive tokens, which the striped layout deals to different ranks: use "\
            "layout='zigzag' or 'contiguous'"  # fmt: skip
    chunk = local_len // 2 if layout == "zigzag" else local_len
    for rate in _rates(call):
        if chunk % rate:
            multiple = _layout.required_multiple(layout, world_size) * math.lcm(rate, *rates)
            return (
                f"{what} compress windows of {rate} tokens, which must not straddle ranks, but the {layout} layout over "
                f"{world_size} ranks gives chunks of {chunk} tokens: pad the sequence to a multiple of {multiple} "
                f"(shard_batch(batch, chunk_multiple=hf_ring.chunk_multiple(model)) does, as RingAttentionPlugin "
                f"does by itself; or the collator's pad_to_multiple_of={multiple})"
            )
    return None


def _chunk_indices(layout: str, rank: int, world_size: int) -> list[int]:
    """The global indices of the chunks (runs of consecutive tokens, of one length) ``rank`` holds, in its order."""
    if world_size == 1:
        return [0]
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def _chunks(layout: str, rank: int, world_size: int, local_len: int) -> list[tuple[int, int, int]]:
    """``(local start, global chunk index, length)`` of the chunks this rank holds."""
    indices = _chunk_indices(layout, rank, world_size)
    length = local_len // len(indices)
    return [(j * length, index, length) for j, index in enumerate(indices)]


def _compress(module, hidden: torch.Tensor, chunks: list, gather: StateGather, layout: str) -> torch.Tensor:
    """The entries of the whole sequence, ``[batch, seq // rate, head_dim]`` in window order: ``module``'s (a
    compressor or an indexer) operations on this rank's windows, gathered from every rank."""
    rate, d = module.compress_rate, module.head_dim
    batch = hidden.shape[0]
    kv, gate = module.kv_proj(hidden), module.gate_proj(hidden)
    overlap = kv.shape[-1] == 2 * d  # (CSA: two series, the first pooled with the next window's second)
    windows, first = [], []
    for start, index, length in chunks:
        n = length // rate
        ck = kv[:, start : start + n * rate].view(batch, n, rate, -1)
        cg = gate[:, start : start + n * rate].view(batch, n, rate, -1) + module.position_bias
        windows.append((ck, cg, index))
        first.append(torch.arange(n) + index * n)
    if overlap and gather.world_size > 1:  # the last window of every chunk: the next chunk's first needs its series
        tails = torch.stack([torch.cat([ck[:, -1, :, :d], cg[:, -1, :, :d]], -1) for ck, cg, _ in windows])
        every = gather.gather(tails)  # [world, chunks, batch, rate, 2 d]
        held = [_chunk_indices(layout, r, gather.world_size) for r in range(gather.world_size)]
        holder = {index: (r, j) for r, indices in enumerate(held) for j, index in enumerate(indices)}
    entries = []
    for ck, cg, index in windows:
        if overlap:
            n = ck.shape[1]
            pooled_kv = ck.new_zeros((batch, n, 2 * rate, d))
            pooled_gate = cg.new_full((batch, n, 2 * rate, d), float("-inf"))
            pooled_kv[:, :, rate:] = ck[..., d:]
            pooled_gate[:, :, rate:] = cg[..., d:]
            if n > 1:
                pooled_kv[:, 1:, :rate] = ck[:, :-1, :, :d]
                pooled_gate[:, 1:, :rate] = cg[:, :-1, :, :d]
            if index > 0 and gather.world_size > 1:
                tail = every[holder[index - 1]]
                pooled_kv[:, 0, :rate] = tail[..., :d].to(pooled_kv.dtype)
                pooled_gate[:, 0, :rate] = tail[..., d:].to(pooled_gate.dtype)
            ck, cg = pooled_kv, pooled_gate
        entries.append(module.kv_norm((ck * cg.softmax(dim=2, dtype=torch.float32).to(ck.dtype)).sum(dim=2)))
    local = torch.cat(entries, 1)
    if overlap and gather.world_size > 1 and all(index == 0 for _, _, index in windows) and torch.is_grad_enabled():
        # (the rank holding only the first chunk reads no tail; its backward must still join the all-reduce of their
        # gradients, which the others' backward runs: zero, through the graph)
        local = local + every.flatten()[:0].sum()  # (an empty sum: exactly 0 whatever the tails hold)
    window = torch.cat(first)
    positions = (window * rate).to(local.device).unsqueeze(0).expand(batch, -1)
    cos, sin = module.rotary_emb(local, position_ids=positions, layer_type=module.rope_layer_type)
    local = _defined_beside(module, "apply_rotary_pos_emb")(local.unsqueeze(1), cos, sin).squeeze(1)
    if gather.world_size == 1:
        return local
    every = gather.gather(local)  # [world, batch, local windows, d]: the windows of each rank, in the layout's order
    return _layout.unshard(list(every.unbind(0)), dim=1, layout=layout)


def _top_k(indexer, keys: torch.Tensor, hidden: torch.Tensor, q_residual: torch.Tensor, position_ids) -> torch.Tensor:
    """The indexer's picks ``[batch, local_seq, k]`` among the entries ``keys`` (-1: none), as the model computes them,
    for chunks of queries whose fp32 scores ``[batch, chunk, index_heads, entries]`` stay within
    ``hf_ring.sparse.CHUNK_BYTES`` (each query's row whole: its top-k, ties included, is the model's)."""
    batch, length, _ = hidden.shape
    count = keys.shape[1]
    if count == 0:
        return torch.full((batch, length, 0), -1, dtype=torch.long, device=hidden.device)
    rotate = _defined_beside(indexer, "apply_rotary_pos_emb")
    cos, sin = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(batch, length, -1, indexer.head_dim).transpose(1, 2)
    q = rotate(q, cos, sin).transpose(1, 2)  # [batch, local_seq, index_heads, index_head_dim]
    threshold = ((position_ids + 1) // indexer.compress_rate).unsqueeze(-1).expand(batch, -1, -1)
    entries = torch.arange(count, device=hidden.device)
    rows = max(1, _sparse.CHUNK_BYTES // (4 * batch * q.shape[2] * count))
    picks = []
    for start in range(0, length, rows):
        part = slice(start, start + rows)
        scores = indexer.scorer(q[:, part], keys, hidden[:, part])  # [batch, chunk, entries]
        scores = scores.masked_fill(entries >= threshold[:, part], float("-inf"))
        picked = scores.topk(min(indexer.index_topk, count), dim=-1).indices
        picks.append(torch.where(picked >= threshold[:, part], -1, picked))
    return torch.cat(picks, 1)


def resolve(call: CompressorCall, *, group, layout: str, timeout: float | None) -> SharedKeys:
    """The compressed entries of the whole sequence for this rank's queries (``SharedKeys``); collectives: one or two
    all-gathers per compressor (and as many for a CSA indexer, without gradient)."""
    rank, world_size = group_rank_and_size(group)
    m, hidden = call.module, call.hidden_states
    chunks = _chunks(layout, rank, world_size, hidden.shape[1])
    gather = StateGather(group, timeout, what="a compressed-attention all-gather")
    entries = _compress(m, hidden, chunks, gather, layout)  # [batch, entries, head_dim]
    count = entries.shape[1]
    positions = torch.arange(1, count + 1) * m.compress_rate - 1  # an entry is seen from its window's last token
    selected = None
    indexer = getattr(m, "indexer", None)
    if indexer is not None:
        with torch.no_grad():
            keys = _compress(indexer, hidden, chunks, gather, layout)
            picks = _top_k(indexer, keys, hidden, call.q_residual, call.position_ids)
        rate = indexer.compress_rate
        selected = Selection(picks, block=rate, start=rate - 1)
    keys = entries.unsqueeze(1)
    return SharedKeys(keys, keys, positions, selected)
