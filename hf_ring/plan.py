"""Plans of ``ring_attention`` calls: what a call needs besides the tensors, resolved once before any communication.

A ``Plan`` holds the positions each rank holds, the per-step masks (``BlockMask``: causal, window, documents,
bidirectional blocks) and their device copies, the kernel backend, and the summary every rank sent to the pre-flight
check. ``make_plan`` checks a call on every rank of the CP group (one small all-gather: bad input on one rank, or
ranks that disagree, raise on every rank) and builds its plan. A ``PlanCache`` keeps plans across the layers of a
batch (see ``hf_ring.ring``).
"""

from __future__ import annotations

import collections
import dataclasses
from types import ModuleType

import torch

from . import guard, preflight
from . import layout as _layout
from .comm import RingComm
from .kernels import BlockMask, choose_backend
from .kernels.mask import runs, upload

__all__ = ["Plan", "PlanCache", "cache_key", "host_document_ids", "make_plan"]


@dataclasses.dataclass
class Plan:
    """Everything one call needs besides the tensors: resolved once, before communication."""

    rank: int
    world_size: int
    scale: float
    softcap: float | None
    backend: ModuleType
    masks: list  # masks[src]: queries of this rank vs the key/value block of rank src
    empty: list  # empty[src]: the block of rank src is fully masked for this rank
    summary: list  # what every rank sent to the pre-flight check (checked again once per batch)
    # the hybrid: (order, inverse) of the gathered tokens when sorted by position (fewer runs), on q's device
    order: tuple | None = None
    pinned: list = dataclasses.field(default_factory=list)  # host sides of ``order``'s non-blocking upload

    @property
    def kernel_kwargs(self) -> dict:
        """Keywords every backend call gets beyond the common ones (softcapping, when asked for)."""
        return {} if self.softcap is None else {"softcap": self.softcap}


class PlanCache:
    """Plans of ``ring_attention`` calls, built once per batch and shared by every layer, forward and backward.

    Keyed on what a plan depends on: the group's rank and size, layout, shapes, dtypes and devices of
    q/k/v, causal, scale, window, backend, and the document and block tensors (by identity and version; the cache
    holds them, so their identity cannot be reused by another tensor). At most ``MAX_PLANS`` are kept.

    ``new_batch()`` must be called on every rank at the same point, at the start of every forward
    (``apply_ring_attention`` installs a forward pre-hook on the model that does). After it, the first
    call of each key runs the pre-flight check across ranks (one small all-gather; ranks that disagree
    raise there, on every rank); later calls of that key use the checked plan with no communication.
    Ranks that agree make the same calls in the same order, so they decide the same way.

    Shared, not duplicated, by ``copy.copy`` / ``copy.deepcopy`` (like ``RingConfig``); a pickled cache
    comes back empty.
    """

    MAX_PLANS = 8

    def __init__(self):
        self._plans: collections.OrderedDict = collections.OrderedDict()  # key -> ((documents, blocks), plan)
        self._checked: set = set()
        self._derived: dict = {}  # identities of sources -> (sources, value), until new_batch()
        self.progress = guard.Progress()  # where this model's forward and backward stand in their ring calls
        # the model's forward was given document ids (padding or packing): set and cleared by hf_ring.patches'
        # model hooks, so that a layer called without them is caught (a family that drops the batch's keywords)
        self.batch_documents = False

    def new_batch(self) -> None:
        """Make the next call of every key check its plan across ranks again (start of a forward). Raises
        ``guard.StoppedError`` when this rank's previous step failed out of step with its peers."""
        self.progress.begin_forward()
        self._checked.clear()
        self._derived.clear()

    def derived(self, sources: tuple, make):
        """``make()``, computed once per forward for these very ``sources`` (objects compared by identity;
        held until ``new_batch()``): callers derive per-batch values, e.g. document ids, once, not per layer."""
        key = tuple(id(s) for s in sources)
        hit = self._derived.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], sources)):
            hit = (sources, make())
            self._derived[key] = hit
        return hit[1]

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key, held: tuple) -> Plan | None:
        """The plan stored under ``key`` for these very tensors (``(documents, blocks)``, by identity), or None."""
        entry = self._plans.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], held, strict=True)):
            return None
        self._plans.move_to_end(key)
        return entry[1]

    def checked(self, key, held: tuple) -> Plan | None:
        """The plan of ``key`` if it was checked across ranks since ``new_batch()``, else None."""
        return self.get(key, held) if key in self._checked else None

    def store(self, key, held: tuple, plan: Plan) -> None:
        self._plans[key] = (held, plan)
        self._plans.move_to_end(key)
        self._checked.add(key)
        while len(self._plans) > self.MAX_PLANS:
            old, _ = self._plans.popitem(last=False)
            self._checked.discard(old)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (PlanCache, ())


#: Document ids at or above this are relabelled (the triton kernels keep sentinels above 2**30).
_MAX_DOC_ID = 2**30


def host_document_ids(cu_seqlens, document_ids, full: int) -> torch.Tensor | None:
    """[1 or batch, full] int32 document ids on the host (negative: padding, as -1), or None.

    Only equality between ids matters, so ids of any integer range are relabelled to 0.. when they
    would not fit the kernels' int32 range (``unique(return_inverse=True)``: equal ids stay equal).
    """
    if cu_seqlens is not None:
        return _layout.documents_from_cu_seqlens(cu_seqlens, full).to(torch.int32)[None]
    if document_ids is None:
        return None
    ids = document_ids.detach().cpu().long()
    if ids.numel() and (int(ids.max()) >= _MAX_DOC_ID or int(ids.min()) < -1):
        pad = ids < 0
        _, dense = torch.unique(torch.where(pad, ids.max(), ids), return_inverse=True)
        ids = torch.where(pad, -1, dense)
    return ids.to(torch.int32)


def _block_codes(block_ids: torch.Tensor, docs: torch.Tensor | None) -> tuple[torch.Tensor | None, str | None]:
    """``([1 or batch, full] int32 block codes, None)`` (``BlockMask.blocks``: -1 padding, 0 no block, c > 0 block
    c), or ``(None, why)`` when the documents are more than padding around one document per row."""
    blk = block_ids.detach().cpu().long()
    if docs is not None:
        real = docs.long()
        hi = torch.where(real >= 0, real, -1).amax(1)
        lo = torch.where(real >= 0, real, hi[:, None]).amin(1)
        if bool((lo != hi).any()):
            return None, (
                "block_ids cannot be combined with packed documents (several document ids in a row); padding "
                "(document id -1) is fine"
            )
    inside = blk >= 0
    if inside.any():  # relabel to 1.. (equal ids stay equal; any integer range fits the kernels' int32)
        _, dense = torch.unique(torch.where(inside, blk, blk.max()), return_inverse=True)
        codes = torch.where(inside, dense + 1, 0)
    else:
        codes = torch.zeros_like(blk)
    if docs is not None:
        codes = torch.where(docs.long() < 0, -1, codes)
    return codes.to(torch.int32), None


def _blocks_reach(q_pos, k_pos, q_doc, k_doc) -> bool:
    """Whether some query and key of one block (codes > 0) have the key after the query: the pairs the blocks
    show beyond the causal mask in this step."""
    for qd, kd in zip(q_doc, k_doc, strict=True):  # rows of the batch (slices of one code tensor)
        q_in, k_in = qd > 0, kd > 0
        if not (q_in.any() and k_in.any()):
            continue
        size = int(max(qd.max(), kd.max())) + 1
        first_q = torch.full((size,), torch.iinfo(torch.int64).max).scatter_reduce(
            0, qd[q_in].long(), q_pos[q_in], "amin"
        )
        last_k = torch.full((size,), -1, dtype=torch.int64).scatter_reduce(0, kd[k_in].long(), k_pos[k_in], "amax")
        if bool((last_k > first_q).any()):
            return True
    return False


def _without_blocks(q_codes: torch.Tensor, k_codes: torch.Tensor) -> tuple:
    """Block codes as document ids (one document, -1 padding), or ``(None, None)`` where neither side pads."""
    if not bool((q_codes < 0).any() or (k_codes < 0).any()):
        return None, None
    return torch.where(q_codes > 0, 0, q_codes), torch.where(k_codes > 0, 0, k_codes)


def cache_key(q, k, v, comm, layout, causal, scale, window, softcap, sinks, cu_seqlens, docs, blocks, backend):
    """What a plan and its check depend on, without a device sync; None when the arguments are not even tensors.
    (``sinks``: their shape, dtype and device, which the check validates, not their values.)"""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if any(t is not None and not isinstance(t, torch.Tensor) for t in (docs, blocks, sinks)):
        return None
    tensors = tuple((tuple(t.shape), t.dtype, t.device) for t in (q, k, v, *([] if sinks is None else [sinks])))
    doc_key = None if docs is None else ("cu" if cu_seqlens is not None else "ids", id(docs), docs._version)
    block_key = None if blocks is None else (id(blocks), blocks._version)
    return (
        comm.rank, comm.world_size, id(comm.group), layout, tensors, causal, scale, window, softcap, backend, doc_key,
        block_key,
    )  # fmt: skip


def make_plan(
    q, k, v, comm, layout, causal, scale, window, softcap, sinks, cu_seqlens, document_ids, block_ids, backend, reuse,
    ulysses=None,
):  # fmt: skip
    """Check this call on every rank of the CP group (one small all-gather) and return its plan (``reuse`` if
    given, which was built for the same key: only the check runs again). ``comm``: the ring; ``ulysses``:
    the hybrid's groups (the check then runs over the whole CP group, and ring rank g holds the tokens of
    Ulysses group g)."""
    rank, world_size = comm.rank, comm.world_size
    u = 1 if ulysses is None else ulysses.ulysses_size
    check = comm if ulysses is None else RingComm(ulysses.cp_group)
    device = q.device if isinstance(q, torch.Tensor) else None
    if reuse is not None:
        preflight.check_everywhere(None, reuse.summary, check, device)
        return reuse
    n = world_size * u  # ranks holding a shard
    error = preflight.local_error(
        q, k, v, layout, causal, scale, window, softcap, sinks, cu_seqlens, document_ids, backend, n, u, block_ids
    )
    docs = module = None
    if error is None:
        docs = host_document_ids(cu_seqlens, document_ids, q.shape[2] * n)
        if block_ids is not None:
            docs, error = _block_codes(block_ids, docs)
    if error is None:
        module, error = choose_backend(backend, q, k, v, softcap)
    summary = preflight.summary(q, k, v, layout, causal, scale, window, softcap, sinks, docs, error, u)
    preflight.check_everywhere(error, summary, check, device)

    full = q.shape[2] * n
    shard = [_layout.positions(full, rank=r, world_size=n, layout=layout) for r in range(n)]
    pos = [torch.cat(shard[g * u : (g + 1) * u]) if u > 1 else shard[g] for g in range(world_size)]
    order, pinned = None, []
    if u > 1:  # the gathered tokens in position order where that makes fewer runs (zig-zag: 2 runs, not 2U)
        ranked = [p.sort() for p in pos]
        if sum(len(runs(r.values)) for r in ranked) < sum(len(runs(p)) for p in pos):
            pos = [r.values for r in ranked]
            mine = ranked[rank].indices
            order = tuple(upload(t, q.device, pinned) for t in (mine, torch.argsort(mine)))
    q_pos = pos[rank]
    masks = []
    for src in range(world_size):
        q_doc = None if docs is None else docs[:, q_pos]
        k_doc = None if docs is None else docs[:, pos[src]]
        blocks = block_ids is not None and _blocks_reach(q_pos, pos[src], q_doc, k_doc)
        if block_ids is not None and not blocks:  # the causal mask already shows this step's block pairs
            q_doc, k_doc = _without_blocks(q_doc, k_doc)
        masks.append(
            BlockMask(
                q_pos=q_pos,
                k_pos=pos[src],
                causal=bool(causal),
                window=None if window is None else int(window),
                q_doc=q_doc,
                k_doc=k_doc,
                blocks=blocks,
            )
        )
    empty = [m.is_empty() for m in masks]
    if q.is_cuda:  # upload the masks' positions once, without blocking (kernels that read them on the device)
        for m, e in zip(masks, empty):
            if not e:
                m.device_tensors(q.device)
    return Plan(
        rank=rank,
        world_size=world_size,
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
        backend=module,
        masks=masks,
        empty=empty,
        summary=summary,
        order=order,
        pinned=pinned,
    )
