"""The pre-flight check of ``ring_attention``: every rank checks its own arguments, then one small all-gather of a
fixed-size summary lets every rank raise the same error before any ring exchange (bad input on one rank, or ranks
that disagree on shapes or settings), so a mistake never turns into a hang. Errors raised here are ``InStepError``
(a ``ValueError``): every rank raises at the same point, and the group stays usable.
"""

from __future__ import annotations

import struct

import torch

from . import layout as _layout
from .comm import RingComm
from .guard import InStepError
from .kernels import BACKENDS

__all__ = ["FIELDS", "check_everywhere", "dtype_index", "fingerprint", "local_error", "raise_on_every_rank", "summary"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def local_error(
    q, k, v, layout, causal, scale, window, softcap, sinks, cu_seqlens, document_ids, backend, world_size, ulysses_size=1,
    block_ids=None,
):  # fmt: skip
    """The first problem with this rank's arguments, as a message that says what to do; or None.
    ``world_size``: ranks holding a shard (the CP group); ``ulysses_size``: U of the hybrid."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor [batch, heads, local_seq, head_dim]"
    if k.shape[:3] != v.shape[:3]:
        return (
            f"k and v must agree on batch, kv_heads and local_seq (v's head_dim may differ), got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    b, hq, lq, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, lq, d):
        return (
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, local_seq and head_dim "
            "(layout [batch, heads, local_seq, head_dim])"
        )
    if k.shape[1] == 0 or hq % k.shape[1]:
        return f"q_heads ({hq}) must be a multiple of kv_heads ({k.shape[1]})"
    if hq % ulysses_size:
        return (
            f"q_heads ({hq}) must be a multiple of ulysses_size ({ulysses_size}): each rank of a Ulysses group "
            f"takes q_heads / ulysses_size heads; choose a ulysses_size that divides {hq}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not supported; use float16, bfloat16 or float32 (float64 is computed in fp32)"
    if not (q.device == k.device == v.device):
        return f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
    if min(d, v.shape[3]) < 8:
        return f"head_dim must be at least 8, got {d} (q, k) and {v.shape[3]} (v)"
    if layout not in _layout.LAYOUTS:
        return f"unknown layout {layout!r}; choose one of {', '.join(_layout.LAYOUTS)}"
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}"
    if scale is not None and not (float(scale) > 0 and float(scale) != float("inf")):
        return f"scale must be a positive finite number, got {scale}"
    if window is not None and (int(window) != window or window < 1):
        return f"sliding_window must be a positive integer, got {window}"
    if softcap is not None and not (float(softcap) > 0 and float(softcap) != float("inf")):
        return f"softcap must be a positive finite number (or None), got {softcap}"
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor)
        or tuple(sinks.shape) not in ((hq,), (b, hq, lq))
        or not sinks.dtype.is_floating_point
        or sinks.device != q.device
    ):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        return (
            f"sinks must be a floating-point tensor [q_heads={hq}] (or one per query, [batch={b}, q_heads={hq}, "
            f"local_seq={lq}]) on q's device, got {got}"
        )
    full = lq * world_size
    m = _layout.required_multiple(layout, world_size)
    if full % m:
        return (
            f"full sequence length {full} ({world_size} ranks x local_seq {lq}) is not a multiple of {m}: "
            f"the {layout} layout over {world_size} ranks needs a multiple of {m}; pad the sequence to "
            f"{-(-full // m) * m} (hf_ring.shard_batch does this with pad_to_multiple=True)"
        )
    if cu_seqlens is not None and document_ids is not None:
        return "pass cu_seqlens or document_ids, not both"
    if cu_seqlens is not None:
        cu = cu_seqlens
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
            return "cu_seqlens must be a 1-D integer tensor [num_docs + 1]"
        if not _layout.valid_cu_seqlens(cu, full):
            cu = cu.detach().cpu()
            return (
                f"cu_seqlens must rise from 0 to the full (unsharded) length {full}; got "
                f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}"
            )
    if document_ids is not None:
        if not _ids_shaped(document_ids, b, full):
            got = tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
            return (
                f"document_ids must be an integer tensor [1 or batch={b}, full_seq={full}] (ids of the unsharded "
                f"sequence), got {got}"
            )
        if document_ids.dtype.is_floating_point:
            return "document_ids must be an integer tensor"
    if block_ids is not None:
        if not _ids_shaped(block_ids, b, full) or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            got = tuple(block_ids.shape) if isinstance(block_ids, torch.Tensor) else type(block_ids).__name__
            return f"block_ids must be an integer tensor [1 or batch={b}, full_seq={full}], got {got}"
        if not causal:
            return "block_ids need causal=True (without the causal mask every token already sees its block)"
    return None


def _ids_shaped(t, batch: int, full: int) -> bool:
    """``t`` is a tensor of per-token ids of the unsharded sequence: ``[1 or batch, full]``."""
    return isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] in (1, batch) and t.shape[1] == full


def dtype_index(dtype: torch.dtype) -> int:
    """A floating dtype as an integer for the cross-rank summaries (-1 for one not listed)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _bits(x) -> int:
    """A float's exact bits as an int (0 for None), for the cross-rank summary."""
    return 0 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def summary(q, k, v, layout, causal, scale, window, softcap, sinks, docs, error, ulysses_size=1) -> list[int]:
    """A fixed-size integer summary of this rank's call; every rank must send the same one."""
    if error is not None:
        return [1] + [0] * (len(FIELDS) - 1)
    b, hq, lq, d = q.shape
    documents = -1 if docs is None else fingerprint(docs)
    return [
        0, lq, b, hq, k.shape[1], d, v.shape[3], dtype_index(q.dtype), _layout.LAYOUTS.index(layout),
        int(causal), -1 if window is None else int(window), _bits(scale), _bits(softcap), int(sinks is not None),
        documents, ulysses_size,
    ]  # fmt: skip


def fingerprint(*tensors) -> int:
    """A cheap O(size) integer summary of integer tensors (position-weighted, shapes included), equal on ranks
    holding equal tensors: what the pre-flight checks compare instead of the tensors themselves."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        flat = t.detach().cpu().long().flatten()
        w = torch.arange(flat.numel(), dtype=torch.int64) % 65521 + 1
        total = (total * 31 + int(((flat + 3) * w).sum()) + t.shape[0]) % (1 << 61)
    return total


FIELDS = ("error", "local_seq", "batch", "q_heads", "kv_heads", "head_dim", "v_head_dim", "dtype", "layout", "causal",
           "sliding_window", "scale", "softcap", "sinks", "documents", "ulysses_size")  # fmt: skip


def check_everywhere(error, summary, comm, device, *, fields=FIELDS, op: str = "ring_attention") -> None:
    """One all-gather of every rank's ``summary`` (integers named by ``fields``, the first one the error flag);
    then every rank raises the same ``InStepError`` when a rank had an ``error`` or ranks disagree."""
    rank, world_size = comm.rank, comm.world_size
    if world_size == 1:
        if error:
            raise InStepError(f"{op}: {error}")
        return
    every = comm.all_gather_ints(summary, device)
    if error:
        raise InStepError(f"{op} (rank {rank}): {error}")
    bad = [r for r, s in enumerate(every) if s[0]]
    if bad:
        raise InStepError(
            f"{op}: rank(s) {bad} rejected their input (see the error raised there); no communication was started"
        )
    for i, field in enumerate(fields[1:], start=1):
        values = [s[i] for s in every]
        if len(set(values)) > 1:
            raise InStepError(
                f"{op}: ranks disagree on {field}: {values} (rank order); every rank of the group must make the "
                "same call with the same settings"
            )


def raise_on_every_rank(message: str, *, group=None, device: torch.device | None = None):
    """Raise ``InStepError(message)`` (a ``ValueError``) here after taking part in the pre-flight exchange of
    ``ring_attention``: the other ranks of ``group``, entering ``ring_attention`` at the same point,
    learn that this rank rejected its input and raise too, instead of waiting for it in the ring.

    For callers above the core (the Transformers integration) that find a problem only some ranks
    can see. It joins the exchange the other ranks run anyway: no extra collective when all is well.
    """
    summary = [1] + [0] * (len(FIELDS) - 1)
    check_everywhere(message, summary, RingComm(group), device)
    raise AssertionError("unreachable: check_everywhere raises when given an error")
