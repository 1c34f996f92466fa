"""How a full sequence maps onto the ranks of a context-parallel group. Pure functions, no communication.

Layouts (N ranks, full length S):

- ``zigzag`` (default): S is cut into 2N equal chunks; rank r holds chunks r and 2N-1-r, in that
  order. Causal work is balanced and each half is contiguous. Needs S % 2N == 0 (when N > 1).
- ``striped``: token t lives on rank t mod N (Striped Attention). Needs S % N == 0.
- ``contiguous``: N equal chunks; rank r holds chunk r. Needs S % N == 0.

With one rank every layout is the identity and any length works.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "LAYOUTS",
    "check_layout",
    "required_multiple",
    "positions",
    "shard",
    "unshard",
    "valid_cu_seqlens",
    "documents_from_cu_seqlens",
    "documents_from_positions",
    "chunk_documents",
    "index_in_document",
    "packed_rows",
    "several_documents",
]

LAYOUTS = ("zigzag", "striped", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def required_multiple(layout: str, world_size: int) -> int:
    """The full sequence length must be a multiple of this (2N for zigzag, N otherwise; 1 for N = 1)."""
    check_layout(layout)
    if world_size == 1:
        return 1
    return 2 * world_size if layout == "zigzag" else world_size


def _check(seq_len: int, rank: int, world_size: int, layout: str) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of world_size {world_size}")
    m = required_multiple(layout, world_size)
    if seq_len % m:
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of {m} (the {layout} layout over "
            f"{world_size} ranks needs a multiple of {m}); pad it to {-(-seq_len // m) * m}"
        )


def positions(seq_len: int, *, rank: int, world_size: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global token positions (int64, ascending within each run) that ``rank`` holds; built on ``device`` (default
    the CPU: no host-device copy)."""
    _check(seq_len, rank, world_size, layout)
    if world_size == 1:
        return torch.arange(seq_len, device=device)
    if layout == "striped":
        return torch.arange(rank, seq_len, world_size, device=device)
    if layout == "contiguous":
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    c = seq_len // (2 * world_size)
    hi = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(hi * c, (hi + 1) * c, device=device)])  # fmt: skip


def shard(x: torch.Tensor, *, dim: int, rank: int, world_size: int, layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of the full-sequence tensor ``x`` along ``dim`` (a new tensor)."""
    pos = positions(x.shape[dim], rank=rank, world_size=world_size, layout=layout)
    return x.index_select(dim, pos.to(x.device))


def unshard(shards: Sequence[torch.Tensor], *, dim: int, layout: str = "zigzag") -> torch.Tensor:
    """Reassemble the full tensor from every rank's part (a list in rank order)."""
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("unshard needs at least one shard")
    lens = {s.shape[dim] for s in shards}
    if len(lens) != 1:
        raise ValueError(f"shards disagree on their length along dim {dim}: {sorted(lens)}")
    seq_len = lens.pop() * world_size
    ref = shards[0]
    shape = list(ref.shape)
    shape[dim] = seq_len
    out = ref.new_empty(shape)
    for rank, part in enumerate(shards):
        pos = positions(seq_len, rank=rank, world_size=world_size, layout=layout)
        out.index_copy_(dim, pos.to(out.device), part)
    return out


# Document structure of a packed sequence (used by the core op, shard_batch and the HF attention).


def valid_cu_seqlens(cu: torch.Tensor, seq_len: int) -> bool:
    """``cu`` is a 1-D integer tensor of boundaries rising from 0 to ``seq_len``."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
        return False
    cu = cu.detach().cpu().long()
    return int(cu[0]) == 0 and int(cu[-1]) == seq_len and not bool((cu[1:] < cu[:-1]).any())


def documents_from_cu_seqlens(cu: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len] int64 document index of every token (CPU) from boundaries ``cu`` [num_docs + 1]."""
    return torch.bucketize(torch.arange(seq_len), cu.detach().cpu().long()[1:], right=True)


def documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] int64 document index of every token (CPU), by Transformers' packing rule: a new
    document starts wherever the position does not rise by 1."""
    pos = position_ids.detach().cpu().long().reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return starts.cumsum(-1) - 1


def chunk_documents(document_ids: torch.Tensor | None, chunk: int, *, seq_len: int) -> torch.Tensor:
    """[rows, seq_len] int32 ids of chunked attention (Llama 4): every document of ``document_ids`` (``[1 or rows,
    seq_len]``, -1 = padding; None: one document, one row) is cut into chunks of ``chunk`` tokens counted from the
    document's first token in the row, each chunk its own document; padding stays -1. Transformers counts a chunk
    from a row's first token that is not left padding, and within a packed document from its first token (its
    position 0): the same chunks."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"the attention chunk size must be a positive integer, got {chunk!r}")
    docs = torch.zeros(1, seq_len, dtype=torch.long) if document_ids is None else document_ids.detach().cpu().long()
    labels, within = index_in_document(docs)
    pieces = labels * (docs.shape[1] // chunk + 1) + within // chunk  # (document, chunk) apart
    ids = torch.unique(pieces, return_inverse=True)[1]
    return torch.where(docs < 0, -1, ids).to(torch.int32)


def index_in_document(docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, within)`` of document ids ``docs`` ([rows, seq] on the host, -1 = padding): each token's document
    numbered 0 .. k-1 over the batch, and its index from that document's first token in its row (int64 both)."""
    rows, n = docs.shape
    index = torch.arange(n).expand(rows, n)
    _, labels = torch.unique(docs, return_inverse=True)
    first = torch.full((rows, int(labels.max()) + 1), n).scatter_reduce(1, labels, index, "amin")
    return labels, index - first.gather(1, labels)


def packed_rows(document_ids: torch.Tensor) -> torch.Tensor:
    """[rows] bool: the rows of ``document_ids`` (``[rows, seq]``, -1 = padding) holding two different ids >= 0."""
    ids = document_ids.detach().cpu().long()
    top = ids.max(dim=-1, keepdim=True).values
    return ((ids >= 0) & (ids != top)).any(dim=-1)


def several_documents(document_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> bool:
    """Some row holds more than one document: ``cu_seqlens`` with more than one, or ``document_ids`` (``[rows,
    seq]``, -1 = padding) with two different ids >= 0 in a row (one host copy)."""
    if cu_seqlens is not None:
        return cu_seqlens.numel() > 2
    if document_ids is None:
        return False
    return bool(packed_rows(document_ids).any())
