"""The ring-attention op: one ring schedule, forward and backward, for every layout.

Each rank keeps its queries. Key/value blocks travel the ring (rank r sends to r+1, receives from
r-1); at step s rank r holds the block of rank (r - s) mod N, attends its queries to it through a
local kernel and merges into fp32 accumulators (output, natural-log LSE), while the next block is
already in flight. Masks follow from the global positions each rank holds (``layout.positions``);
blocks the mask hides entirely are not computed.

Backward recomputes scores from the saved LSE. dQ accumulates locally; dK/dV accumulators (fp32)
travel the ring with their block (one hop behind it) and arrive home after N hops.

Validation happens before any communication: every rank checks its own arguments, then one small
all-gather of a fixed-size summary lets every rank raise the same error (bad input on one rank, or
ranks that disagree on shapes), so a mistake never turns into a hang. That all-gather is the only
collective besides the ring itself; on NCCL it costs one small device-to-host sync.

Plans: what a call needs besides the tensors (positions, per-step masks and their tile classes, the
masks' device copies, the backend, the checked summary) is a ``_Plan``. Without a ``PlanCache`` every
call builds and checks its own. With one (``apply_ring_attention`` gives each model one), a plan is
built once per batch and reused by every layer's forward and backward; the cross-rank check runs
once per kind of call after each ``PlanCache.new_batch()``, which the model's forward pre-hook calls
on every rank at the start of every forward. Steady state: no collective but the ring's P2P, no host
sync, no host-to-device copy per layer.

Failures: an error on one rank in the middle of the ring's lock-step exchanges (inside a call, or between
calls of a forward or backward) stops the CP group, so no rank ever goes on out of step: every rank raises,
naming the rank and the call that failed (``hf_ring.guard``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from types import ModuleType

import torch

from . import guard, preflight
from . import layout as _layout
from .comm import RingComm, UlyssesGroups
from .kernels import BlockMask, choose_backend
from .kernels import torch_backend as _torch_backend
from .kernels.mask import runs, upload
from .preflight import raise_on_every_rank

__all__ = ["PlanCache", "ring_attention", "raise_on_every_rank"]


@dataclasses.dataclass
class _Plan:
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

    def get(self, key, held: tuple) -> _Plan | None:
        """The plan stored under ``key`` for these very tensors (``(documents, blocks)``, by identity), or None."""
        entry = self._plans.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], held, strict=True)):
            return None
        self._plans.move_to_end(key)
        return entry[1]

    def checked(self, key, held: tuple) -> _Plan | None:
        """The plan of ``key`` if it was checked across ranks since ``new_batch()``, else None."""
        return self.get(key, held) if key in self._checked else None

    def store(self, key, held: tuple, plan: _Plan) -> None:
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


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    layout: str = "zigzag",
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    selected=None,
    backend: str = "auto",
    comm: RingComm | None = None,
    plans: PlanCache | None = None,
    ulysses: UlyssesGroups | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: [batch, q_heads, local_seq, head_dim], this rank's shard (in ``layout``) of the queries.
        k, v: [batch, kv_heads, local_seq, head_dim], ``q_heads % kv_heads == 0``. Only the kv_heads
            heads travel the ring; they are never repeated to q_heads. v's head_dim may differ from q's and k's
            (multi-head latent attention: DeepSeek-V2/V3, GLM-4.7-Flash); the output then has v's.
        group: process group of the ring (None: the default group; no initialised group: one rank).
        layout: ``"zigzag"``, ``"striped"`` or ``"contiguous"`` (see ``hf_ring.layout``).
        causal: key position <= query position.
        scale: score scale, default ``head_dim ** -0.5``.
        sliding_window: W. Causal: visible iff ``q - W < k <= q``; non-causal: iff ``|q - k| < W``.
        softcap: attention logit softcapping: scores ``s`` become ``softcap * tanh(s / softcap)`` before
            masking (Gemma2). ``"auto"`` runs it on a backend that implements it.
        sinks: [q_heads] learned attention sinks (gpt-oss): one extra logit per head in every row's
            softmax, with no value. Merged once into the final LSE of the whole ring (not per step);
            differentiable (its gradient is this rank's rows' share).
        cu_seqlens: int [num_docs + 1] boundaries of packed documents in the full (unsharded)
            sequence; tokens attend only inside their own document. Batch 1, or every batch row
            packed alike.
        document_ids: alternative to cu_seqlens: [1 or batch, full_seq] integer document id of every
            token of the unsharded sequence (the same on every rank); -1 marks padding, which sees
            nothing and is seen by nothing.
        block_ids: [1 or batch, full_seq] integer ids of bidirectional blocks of the unsharded sequence (the same
            on every rank; causal only): tokens of one row with the same id >= 0 see each other both ways, besides
            what the causal mask shows; negative ids mark tokens in no block. The image tokens of Gemma 3
            (Transformers' ``block_sequence_ids``). With a sliding window, a block's tokens see each other within
            the window (the window applies after the blocks, as in Transformers). One document per row: padding
            (document id -1) is allowed, packed documents are not.
        selected: [batch, local_seq, K] integer global key positions (in the unsharded sequence) each query may
            see at most, on q's device: DeepSeek sparse attention's top-k (``hf_ring.sparse``). A key outside a
            query's list is hidden whatever the other masks allow; repeats, keys the other masks hide and negative
            entries (no key) are fine. Or a function of no arguments returning it, called after the pre-flight
            check (a selection that needs collectives, as ``hf_ring.sparse.select``'s all-gather, then runs only
            when every rank passed it). Per call (each layer has its own); saved for the backward as it is (int32
            is enough); the steps then run on the torch backend, which reads it per tile. Pure ring only (no
            ``ulysses``).
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"sdpa"`` or ``"flash_attn"``.
        comm: a ``RingComm`` to send through (its byte counters then include this call), or a
            ``LoopbackComm`` (virtual ranks in one process; rank and size come from it).
        plans: a ``PlanCache`` to build the plan once per batch and reuse it (see ``PlanCache``: its
            ``new_batch()`` must be called on every rank at the start of every forward).
        ulysses: the Ulysses x Ring hybrid (``hf_ring.comm.ulysses_groups(group, U)``): inside each group
            of U consecutive ranks an all-to-all trades the sequence split for a head split (q_heads
            must be a multiple of U; key/value heads are repeated to the least common multiple of
            kv_heads and U when U does not divide them), the ring runs across the N / U groups on the
            gathered tokens, and a second all-to-all returns the heads. The data contract is unchanged
            (each rank passes its ``layout`` shard over all N ranks). None or U = 1: the pure ring.
        timeout: seconds a rank waits inside the ring for its peers (CPU tensors on gloo) before it raises
            ``TimeoutError`` naming the ring step and the peers; None: the process group's own timeout (30
            minutes on gloo). GPU waits never block the host; NCCL's watchdog bounds them. Ignored when
            ``comm`` is given (it carries its own).

    Returns:
        [batch, q_heads, local_seq, v_head_dim] in q's dtype. Rows that see no key are 0.
    """
    hybrid = ulysses is not None and ulysses.ulysses_size > 1
    if selected is not None:  # (the same on every rank: the model's shapes and configuration)
        _check_selected(selected, q, hybrid)
    if ulysses is not None:
        if group is not None and group is not ulysses.cp_group:
            raise ValueError("pass either group or ulysses (it carries its own CP group), not two different groups")
        group = ulysses.ring_group
    if comm is not None:
        if group is not None and group is not comm.group:
            raise ValueError("pass either group or comm (a RingComm carries its own group), not two different groups")
    else:
        comm = RingComm(group, timeout=timeout)
    guard.raise_if_stopped(getattr(comm, "group", None))
    docs = cu_seqlens if cu_seqlens is not None else document_ids
    held = (docs, block_ids)
    watch = None  # (groups, name, progress): what stops when this call fails on this rank
    if isinstance(comm, RingComm) and (comm.world_size > 1 or hybrid):
        groups = [comm.group] + ([ulysses.ulysses_group, ulysses.cp_group] if hybrid else [])
        grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
        name = plans.progress.call(groups, grad) if plans is not None else "a ring-attention call"
        watch = (groups, name, None if plans is None else plans.progress)
    key = plan = None
    if plans is not None:
        key = _cache_key(
            q, k, v, comm, layout, causal, scale, sliding_window, softcap, cu_seqlens, docs, block_ids, backend
        )
        key = key if key is None or not hybrid else (*key, id(ulysses))
        plan = plans.checked(key, held) if key is not None else None
    if plan is None:
        reuse = plans.get(key, held) if key is not None else None
        plan = _plan(
            q, k, v, comm, layout, causal, scale, sliding_window, softcap, sinks, cu_seqlens, document_ids, block_ids,
            backend, reuse, ulysses=ulysses if hybrid else None,
        )  # fmt: skip
        if key is not None:
            plans.store(key, held, plan)
    if callable(selected):  # after the pre-flight check: its collectives run only when every rank passed it
        try:
            selected = selected()
            _check_selected(selected, q, hybrid)
        except BaseException as e:
            _failed(watch, comm, e)
            raise
    if not hybrid:
        return _RingAttention.apply(q, k, v, sinks, plan, comm, watch, selected)
    return _hybrid(q, k, v, sinks, plan, comm, ulysses, watch)


def _check_selected(selected, q, hybrid: bool) -> None:
    """ValueError unless ``selected`` is a selection ``ring_attention`` takes for these queries (a function: later)."""
    if hybrid:
        raise ValueError(
            "ring_attention: a selection (selected=, DeepSeek sparse attention) runs on the pure ring; pass "
            "ulysses=None (ulysses_size=1)"
        )
    if callable(selected):
        return
    want = (q.shape[0], q.shape[2]) if isinstance(q, torch.Tensor) else None
    if not (
        isinstance(selected, torch.Tensor)
        and not selected.is_floating_point()
        and not selected.is_complex()
        and selected.dtype != torch.bool
        and selected.dim() == 3
        and tuple(selected.shape[:2]) == want
        and selected.device == q.device
    ):
        got = tuple(selected.shape) if isinstance(selected, torch.Tensor) else type(selected).__name__
        raise ValueError(
            f"ring_attention: selected must be an integer tensor [batch, local_seq, K] = [{want[0] if want else '?'}, "
            f"{want[1] if want else '?'}, K] on the queries' device, got {got}"
        )


def _selecting(plan: _Plan, selected: torch.Tensor, seq_len: int) -> _Plan:
    """This call's plan with its selection: every step's mask hides the keys outside it, and the steps run on a
    backend that reads it (the torch backend, unless the plan's does)."""
    backend = plan.backend if getattr(plan.backend, "SELECT", False) else _torch_backend
    masks = [m.with_selection(selected, seq_len) for m in plan.masks]
    return dataclasses.replace(plan, backend=backend, masks=masks)


def _hybrid(q, k, v, sinks, plan, comm, ulysses, watch):
    """Ulysses x Ring: heads for sequence inside the Ulysses group, the ring across groups, heads back."""
    u, x = ulysses.ulysses_size, ulysses.exchange
    repeat = math.lcm(k.shape[1], u) // k.shape[1]
    if repeat > 1:  # fewer KV heads than the group splits: each KV head serves the same query heads as before
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if sinks is not None:
        sinks = sinks.view(u, -1)[x.rank]  # the sinks of this rank's query heads
    q, k, v = x.heads_to_sequence(q), x.heads_to_sequence(k), x.heads_to_sequence(v)
    if plan.order is not None:  # the gathered tokens in position order (the plan's masks are built for it)
        q, k, v = (t.index_select(2, plan.order[0]) for t in (q, k, v))
    out = _RingAttention.apply(q, k, v, sinks, plan, comm, watch)
    if plan.order is not None:
        out = out.index_select(2, plan.order[1])
    return x.sequence_to_heads(out)


# --------------------------------------------------------------------------- planning


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


def _cache_key(q, k, v, comm, layout, causal, scale, window, softcap, cu_seqlens, docs, blocks, backend):
    """What a plan depends on, without a device sync; None when the arguments are not even tensors."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if any(t is not None and not isinstance(t, torch.Tensor) for t in (docs, blocks)):
        return None
    tensors = tuple((tuple(t.shape), t.dtype, t.device) for t in (q, k, v))
    doc_key = None if docs is None else ("cu" if cu_seqlens is not None else "ids", id(docs), docs._version)
    block_key = None if blocks is None else (id(blocks), blocks._version)
    return (
        comm.rank, comm.world_size, id(comm.group), layout, tensors, causal, scale, window, softcap, backend, doc_key,
        block_key,
    )  # fmt: skip


def _plan(
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
    return _Plan(
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


# --------------------------------------------------------------------------- schedule


def _ring_buffers(kv: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Receive buffers for a pass over n ranks: the first block sent (``kv``) is never written, so the
    forward can keep it for the backward; one buffer for n = 2, two alternating ones beyond."""
    return [torch.empty_like(kv) for _ in range(min(n - 1, 2))]


def _message(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The local keys/values as the one contiguous message that travels: stacked [2, B, Hkv, L, D], or, when the
    values' head_dim differs from the keys' (multi-head latent attention), side by side [B, Hkv, L, D + Dv]."""
    return torch.stack([k, v]) if k.shape == v.shape else torch.cat([k, v], dim=-1)


def _halves(kv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (keys, values) views of a ``_message`` (or of a gradient accumulator shaped like one); ``d``: the
    keys' head_dim."""
    return (kv[0], kv[1]) if kv.dim() == 5 else (kv[..., :d], kv[..., d:])


def _ring_forward(q, k, v, plan: _Plan, comm):
    """(out fp32, lse fp32, kv): kv is the local keys/values that travelled (``_message``; None with one rank),
    kept for the backward."""
    n, r = plan.world_size, plan.rank
    b, hq, lq, d = q.shape
    out = torch.zeros(b, hq, lq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, lq), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 1:
        if not plan.empty[0]:
            plan.backend.forward(q, k, v, plan.masks[0], plan.scale, out, lse, **plan.kernel_kwargs)
        out.masked_fill_(torch.isinf(lse).unsqueeze(-1), 0.0)
        return out, lse, None
    kv = _message(k, v)
    bufs = _ring_buffers(kv, n)
    cur = kv
    comm.where = "in the forward"
    for step in range(n):
        src = (r - step) % n
        if step + 1 < n:
            nxt = comm.send_recv(cur, bufs[step % len(bufs)])
            comm.where = f"in the forward at ring step {step + 1} of {n}"
            comm.commit()
        if not plan.empty[src]:
            plan.backend.forward(q, *_halves(cur, d), plan.masks[src], plan.scale, out, lse, **plan.kernel_kwargs)
        if step + 1 < n:
            comm.wait()
            cur = nxt
    out.masked_fill_(torch.isinf(lse).unsqueeze(-1), 0.0)
    return out, lse, kv


def _ring_backward(dout, q, kv, out, lse, delta, plan: _Plan, comm):
    """(dq, dk, dv) fp32; ``kv``: the local keys/values that travelled (``_message``), or the (k, v) pair with
    one rank; ``delta``: rowsum(dout * out) fp32."""
    n, r = plan.world_size, plan.rank
    d = q.shape[-1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if n == 1:
        dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in kv)
        if not plan.empty[0]:
            plan.backend.backward(
                dout, q, kv[0], kv[1], lse, delta, plan.masks[0], plan.scale, dq, dk, dv, out=out,
                **plan.kernel_kwargs,
            )  # fmt: skip
        return dq, dk, dv
    # dK/dV of the block held (shaped like the message): computed into `local`, added to the accumulator
    # that arrived with the block, sent on; `send`/`recv` alternate so a buffer in flight is never written.
    send = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    bufs = _ring_buffers(kv, n)
    recv, local = torch.empty_like(send), torch.empty_like(send)
    grad_comm = comm.partner()
    cur = kv
    comm.where = "in the backward"
    for step in range(n):
        src = (r - step) % n
        if step + 1 < n:
            nxt = comm.send_recv(cur, bufs[step % len(bufs)])
            comm.where = f"in the backward at ring step {step + 1} of {n}"
            comm.commit()
        target = send if step == 0 else local
        if step > 0:
            target.zero_()
        if not plan.empty[src]:
            plan.backend.backward(
                dout, q, *_halves(cur, d), lse, delta, plan.masks[src], plan.scale, dq, *_halves(target, d),
                out=out, **plan.kernel_kwargs,
            )  # fmt: skip
        if step > 0:
            grad_comm.wait()
            recv.add_(local)
            send, recv = recv, send
        recv = grad_comm.send_recv(send, recv)
        grad_comm.where = f"in the backward at ring step {step + 1} of {n} (dK/dV)"
        grad_comm.commit()
        if step + 1 < n:
            comm.wait()
            cur = nxt
    grad_comm.wait()
    comm.bytes_sent += grad_comm.bytes_sent
    comm.bytes_received += grad_comm.bytes_received
    return dq, *_halves(recv, d)  # after N hops the accumulator of this rank's own block is home


def _failed(watch, comm, error: BaseException) -> None:
    """This rank's ring call failed: stop its groups (``hf_ring.guard``), naming this rank and the call.
    An exchange that failed because the group was stopped elsewhere spreads that record instead."""
    if watch is None:
        return
    groups, name, _ = watch
    where = f" {comm.where}" if comm.where else ""
    guard.failed(groups, error, f"{where} of {name}")


class _RingAttention(torch.autograd.Function):
    # Autocast is off inside: the kernels choose their own precision (fp32 scores and accumulators);
    # under autocast the torch backend's matmuls would otherwise round scores to bf16.
    # q/k/v are taken with their strides (Transformers hands transposed views); nothing is copied but
    # the one K/V message (``_message``), which the backward reuses.
    #
    # Sinks: one extra logit per head with no value, merged once into the final LSE:
    # lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'). The backward then runs on (out', lse')
    # unchanged (the kernels' probabilities exp(s - lse') are the softmax with the sink), and the
    # sink's gradient is -sum over rows of exp(sink - lse') * rowsum(dout * out').
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, comm, watch, selected=None):
        with torch.autocast(q.device.type, enabled=False):
            try:
                run = plan if selected is None else _selecting(plan, selected, q.shape[2] * plan.world_size)
                out, lse, kv = _ring_forward(q, k, v, run, comm)
            except BaseException as e:
                _failed(watch, comm, e)
                raise
            if sinks is not None:
                merged = torch.logaddexp(lse, sinks.detach().float()[None, :, None])
                out.mul_(torch.exp(lse - merged).unsqueeze(-1))
                lse = merged
        # Compiled, the output is a copy, never the buffer the kernels mutated: torch 2.11's AOTAutograd
        # gives a mutated output of a custom op a zero gradient (found with the triton backend, fp32).
        out = out.to(q.dtype, copy=torch.compiler.is_compiling())
        ctx.save_for_backward(q, *((k, v) if kv is None else (kv,)), out, lse, sinks, selected)
        ctx.plan, ctx.comm, ctx.watch = plan, comm, watch
        return out

    @staticmethod
    def backward(ctx, dout):
        q, *kv, out, lse, sinks, selected = ctx.saved_tensors
        kv = kv[0] if len(kv) == 1 else tuple(kv)
        with torch.autocast(q.device.type, enabled=False):
            delta = (dout.float() * out.float()).sum(-1)
            try:
                plan = (
                    ctx.plan if selected is None else _selecting(ctx.plan, selected, q.shape[2] * ctx.plan.world_size)
                )
                dq, dk, dv = _ring_backward(dout, q, kv, out, lse, delta, plan, ctx.comm)
            except BaseException as e:
                _failed(ctx.watch, ctx.comm, e)
                raise
            if ctx.watch is not None and ctx.watch[2] is not None:
                ctx.watch[2].backward_calls += 1
            dsinks = None
            if sinks is not None and ctx.needs_input_grad[3]:
                p_sink = torch.exp(sinks.float()[None, :, None] - lse)
                dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dsinks, None, None, None, None
