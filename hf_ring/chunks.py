"""This rank's chunks of a sharded sequence, their document segments, and the short causal convolution across
the chunk edges (the recurrent mixers' first step: ``hf_ring.linear_attention``).

A rank's tokens are runs of consecutive positions (``Chunks``: zig-zag gives two, contiguous one). A short causal
convolution over them needs, for each run, the K - 1 inputs before it, which live on another rank: one all-gather
of every run's last K - 1 inputs (``causal_conv1d``). With packed documents every run is cut where the document
changes (``row``: its segments, computed once per documents tensor), and each segment sees only the inputs of its
own document.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from . import layout as _layout
from .comm import StateGather

__all__ = ["Chunks", "Uses", "by_run", "causal_conv1d", "chunks", "groups", "padded", "previous", "row"]


class Chunks:
    """How this rank's ``local_seq`` tokens cut into runs of consecutive positions: ``count`` runs of ``length``
    tokens each, run ``i`` being chunk ``index[i]`` of the ``total`` chunks of the whole sequence, in order."""

    def __init__(self, count: int, length: int, index: tuple, total: int, world_size: int):
        self.count, self.length, self.index, self.total = count, length, index, total
        self.world_size = world_size

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` with its ``dim`` (this rank's tokens) cut into the runs, stacked on a new leading dimension."""
        return torch.stack(x.split(self.length, dim=dim)) if self.count > 1 else x.unsqueeze(0)

    def join(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Inverse of ``split``: runs stacked on dim 0 back into this rank's tokens along ``dim`` (of a run)."""
        return torch.cat(x.unbind(0), dim=dim) if self.count > 1 else x[0]

    def owner(self, chunk: int) -> tuple[int, int]:
        """``(rank, run)`` holding global chunk ``chunk``."""
        if self.total == self.world_size:  # contiguous (or one rank)
            return chunk, 0
        return (chunk, 0) if chunk < self.world_size else (self.total - 1 - chunk, 1)


def chunks(local_seq: int, *, rank: int, world_size: int, layout: str) -> Chunks:
    """The runs of ``rank``'s tokens (see ``Chunks``); ValueError for the striped layout over several ranks."""
    _layout.check_layout(layout)
    if world_size == 1:
        return Chunks(1, local_seq, (0,), 1, 1)
    if layout == "striped":
        raise ValueError(
            "recurrent layers (Gated DeltaNet, Mamba2, short convolutions) cannot run on the striped layout: each "
            "token's state comes from the token before it, which lives on another rank; use layout='zigzag' or "
            "'contiguous'"
        )
    if layout == "contiguous":
        return Chunks(1, local_seq, (rank,), world_size, world_size)
    return Chunks(2, local_seq // 2, (rank, 2 * world_size - 1 - rank), 2 * world_size, world_size)


class Uses(torch.autograd.Function):
    """``y`` itself, made to depend on ``gathered`` too (a zero gradient): a rank whose chunks need nothing from
    the others (the first rank of the contiguous layout) still runs the gather's backward, a collective every
    rank must join."""

    @staticmethod
    def forward(ctx, y, gathered):
        ctx.meta = (gathered.shape, gathered.dtype, gathered.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def previous(every: torch.Tensor, plan: Chunks, fill: torch.Tensor) -> torch.Tensor:
    """For each of this rank's runs, the gathered entry of the chunk before it (``fill`` before the first):
    ``every`` is ``[world, runs, ...]``; returns ``[runs, ...]``."""
    out = []
    for c in plan.index:
        out.append(fill if c == 0 else every[plan.owner(c - 1)])
    return torch.stack(out)


def causal_conv1d(
    x: torch.Tensor,
    conv: Callable,
    kernel_size: int,
    plan: Chunks,
    gather: StateGather | None,
    documents: torch.Tensor | None = None,
    memory: dict | None = None,
) -> torch.Tensor:
    """A causal convolution over the whole sequence, on this rank's tokens.

    Args:
        x: [batch, channels, local_seq], this rank's tokens (in the layout's order).
        conv: ``conv(x) -> y`` with y[..., t] depending on x[..., t - K + 1 .. t] (zeros before the start), as
            Transformers' ``causal_conv1d_fn`` with the layer's weights.
        kernel_size: K. plan: this rank's runs (``chunks``). gather: the group's ``StateGather`` (None: one rank).
        documents: None, or [1 or batch, full_seq] document ids of the unsharded sequence (the same on every
            rank): each document is convolved on its own (zeros before its first token).
        memory: ``hf_ring.ring_generate``'s record of this layer: empty, it gets the sequence's last K - 1 inputs
            (``"conv"``, the same on every rank); holding them, ``x`` is the next tokens of the sequence (the same
            on every rank), convolved after them locally, and the record moves on. ``"added"``: [local_seq] True
            at the padding ``ring_generate`` put before the prompt, whose inputs are zeroed.

    Returns:
        [batch, channels, local_seq]: what the convolution of the unsharded sequence gives at these tokens.
    """
    halo = kernel_size - 1
    if memory is not None and documents is not None:
        raise ValueError("ring_generate keeps one document per row; packed documents have no state to go on from")
    added = None if memory is None else memory.pop("added", None)
    if added is not None:  # the prefill: ring_generate's padding before the prompt, as if nothing were there
        x = x * ~added
    if memory is not None and "conv" in memory:  # a decode step: after the sequence's last inputs, no exchange
        full = torch.cat([memory["conv"], x], dim=-1)
        memory["conv"] = full[..., full.shape[-1] - halo :]
        return conv(full)[..., halo:]
    tails = None
    if halo == 0 or (documents is None and plan.world_size == 1):
        y = conv(x)
    else:
        runs = plan.split(x, dim=2)  # [runs, b, c, n]
        tails = None if plan.world_size == 1 else gather.gather(runs[..., -halo:])  # [world, runs, b, c, K - 1]
        zeros = torch.zeros_like(runs[0, ..., :halo])
        before = zeros.expand(plan.count, *zeros.shape) if tails is None else previous(tails, plan, zeros)
        if documents is None:
            y = conv(torch.cat([before, runs], dim=-1).flatten(0, 1))  # runs stacked on the batch
            y = plan.join(y[..., halo:].unflatten(0, (plan.count, -1)), dim=2)
        else:
            y = torch.stack([_conv_row(runs[:, r], before[:, r], conv, halo, plan, *row(documents, r, plan))
                             for r in range(x.shape[0])], dim=1)  # fmt: skip
            y = plan.join(y, dim=2)
    if memory is not None:  # the prefill of ring_generate: the sequence's last K - 1 inputs, for the decode steps
        if tails is not None:
            last = tails[plan.owner(plan.total - 1)]
        else:  # one rank: its own last inputs (zeros before a sequence shorter than the halo)
            last = torch.nn.functional.pad(x, (max(halo - x.shape[-1], 0), 0))[..., x.shape[-1] - halo :]
        memory["conv"] = last.detach()
    return y if tails is None else Uses.apply(y, tails)


class _Segment:
    """Tokens ``start:end`` of run ``run``, one document; ``continues``: it goes on from the chunk before."""

    def __init__(self, run: int, start: int, end: int, continues: bool):
        self.run, self.start, self.end, self.continues = run, start, end, continues


_SEGMENTS: dict = {}  # id(documents tensor) -> (a weak reference to it, {(row, plan): (ids, segments)})


def row(documents: torch.Tensor, r: int, plan: Chunks) -> tuple[list, list]:
    """Row ``r``'s document ids of the whole sequence (a list; one row for every batch row) and this rank's
    segments of it, computed once per documents tensor (every layer of a forward gets the same one)."""
    r = 0 if documents.shape[0] == 1 else r
    tag = id(documents)
    entry = _SEGMENTS.get(tag)
    if entry is None or entry[0]() is not documents:  # dropped with the tensor (the end of its forward)
        entry = (weakref.ref(documents, lambda _: _SEGMENTS.pop(tag, None)), {})
        _SEGMENTS[tag] = entry
    cached = entry[1]
    key = (r, plan.index, plan.length)
    if key not in cached:
        ids = documents[r].tolist()
        cached[key] = (ids, _segments(ids, plan))
    return cached[key]


def _segments(ids: list, plan: Chunks) -> list:
    """This rank's runs cut where the document id changes, in order (``ids``: the row's ids of the whole
    sequence; a document is a run of equal ids, as for the attention)."""
    out = []
    for i, c in enumerate(plan.index):
        lo = c * plan.length
        run = ids[lo : lo + plan.length]
        cuts = [0, *(t for t in range(1, plan.length) if run[t] != run[t - 1]), plan.length]
        for a, b in zip(cuts[:-1], cuts[1:]):
            out.append(_Segment(i, a, b, a == 0 and c > 0 and ids[lo - 1] == run[0]))
    return out


def padded(pieces: list, length: int) -> torch.Tensor:
    """Pieces of unequal length along dim 0, each zero-padded at its end to ``length``, stacked."""
    return torch.stack([torch.nn.functional.pad(p, (0, 0) * (p.dim() - 1) + (0, length - p.shape[0])) for p in pieces])


def by_run(segments: list, pieces: list, plan: Chunks, dim: int) -> torch.Tensor:
    """Each segment's piece put back in its run (joined along ``dim``), the runs stacked: [runs, ...]."""
    parts = [[] for _ in range(plan.count)]
    for s, piece in zip(segments, pieces):
        parts[s.run].append(piece)
    return torch.stack([torch.cat(p, dim=dim) for p in parts])


def groups(lengths: list) -> list:
    """Indices of pieces grouped for one kernel call each, padded to the group's longest: longest first, a piece
    joins the current group while the group's padded size stays within twice its tokens (so all calls together
    compute at most twice the tokens there are, however the lengths are spread)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, tokens = [], 0
    for i in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= 2 * (tokens + lengths[i]):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return groups


def _conv_row(runs, before, conv, halo: int, plan: Chunks, ids: list, segments: list) -> torch.Tensor:
    """``causal_conv1d`` of one batch row with documents: every segment convolved with the inputs before it that
    belong to its document (the halo's, for a segment going on from the chunk before: those in the run of equal
    ids reaching the chunk's start). runs: [runs, c, n]."""
    pieces = []
    for s in segments:
        h = torch.zeros_like(before[s.run])
        if s.continues:
            lo = plan.index[s.run] * plan.length
            reach = 0  # how many tokens before the chunk belong to its first document
            while reach < halo and lo - reach - 1 >= 0 and ids[lo - reach - 1] == ids[lo]:
                reach += 1
            same = [j >= halo - reach for j in range(halo)]
            h = before[s.run] * torch.tensor(same, dtype=h.dtype, device=h.device)
        pieces.append(torch.cat([h, runs[s.run][:, s.start : s.end]], dim=-1).T)  # [K - 1 + len, c]
    out: list = [None] * len(segments)
    for group in groups([p.shape[0] for p in pieces]):
        longest = max(pieces[i].shape[0] for i in group)
        y = conv(padded([pieces[i] for i in group], longest).transpose(1, 2))  # [pieces, c, longest]
        for i, piece in zip(group, y):
            out[i] = piece[:, halo : halo + segments[i].end - segments[i].start]
    return by_run(segments, out, plan, dim=-1)  # [runs, c, n]
