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
masks' device copies, the backend, the checked summary) is a ``Plan``. Without a ``PlanCache`` every
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

import dataclasses
import functools
import math
from types import SimpleNamespace

import torch

from . import guard
from . import plan as _planning
from .comm import RingComm, UlyssesGroups
from .kernels import masked_fallback, unsupported_by
from .kernels import torch_backend as _torch_backend
from .kernels.mask import BlockMask, Selection, selection_error
from .plan import Plan, PlanCache, host_document_ids  # (PlanCache and host_document_ids: imported from here too)
from .preflight import check_everywhere, raise_on_every_rank

__all__ = ["PlanCache", "SharedKeys", "host_document_ids", "ring_attention", "raise_on_every_rank"]


@dataclasses.dataclass(frozen=True)
class SharedKeys:
    """Keys/values every rank holds whole, beside the sequence's (DeepSeek-V4's compressed entries): each rank's
    queries attend to them locally, merged with the ring's blocks by the LSE rule into one softmax.

    keys: [batch, kv_heads, n, head_dim]; values: [batch, kv_heads, n, v_head_dim] (the same kv_heads and head_dims
        as the sequence's; they may be one tensor). Their gradients are this rank's queries' share: sum them over the
        ranks (``hf_ring.comm.StateGather`` does, when they came from its all-gather).
    positions: [n] int64 on the host: the global position of each; with ``causal``, a query sees an entry iff its
        position is not after the query's. Neither the window nor the documents apply to them.
    selected: a ``Selection`` over them (its ``block``/``start`` naming their positions), or None: all visible.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    selected: Selection | None = None


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
    shared: SharedKeys | None = None,
    distance_bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
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
            differentiable (its gradient is this rank's rows' share). Or [batch, q_heads, local_seq]: a sink per
            query (Inkling 2's, projected from each token), its gradient its own; not with ``ulysses``.
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
            entries (no key) are fine. Or [batch, kv_heads, local_seq, K]: a list per key/value head, for the query
            heads of its group; or a ``hf_ring.Selection`` of either whose entries name blocks of ``block``
            consecutive positions from ``start`` (MiniMax M3's indexer). With ``ulysses``, it travels as the keys
            do. Or a function of no arguments returning it, called after the pre-flight check (a selection that
            needs collectives, as ``hf_ring.sparse.select``'s all-gather, then runs only when every rank passed
            it). Per call (each layer has its own); saved for the backward as it is (int32 is enough); the steps
            then run on the torch backend, which reads it per tile.
        shared: a ``SharedKeys`` (keys every rank holds whole, attended locally and merged with the ring's, on the
            torch backend), or a function of no arguments returning it, called after the pre-flight check (as
            ``selected``); None: none. Not with ``ulysses``.
        distance_bias: [batch, q_heads, local_seq, E] floating, on q's device: each query's additive bias by backward
            distance (Inkling's relative position bias): the score of a key at global distance ``d = q_pos - k_pos``
            gets the query's entry ``d`` when ``0 <= d < E``, nothing otherwise (the masks apply as without it).
            Differentiable (its gradient stays on this rank: it belongs to the rank's queries). The steps then run on
            the torch backend, which reads it per tile. Not with ``ulysses``, ``shared`` or ``softcap``.
        alibi_slopes: [q_heads] floating, on q's device, without gradient: ALiBi (BLOOM, MPT): the score of a key at
            global distance ``d = q_pos - k_pos`` gets ``-slope * d`` (its query head's slope). The steps then run on
            a backend that takes them: the plan's (``"torch"``, ``"triton"``), else the masked steps' (triton on
            CUDA), else torch. With ``ulysses`` too (each rank the slopes of its heads); not with ``distance_bias``,
            ``shared`` or ``softcap``.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"sdpa"``, ``"cudnn"`` or ``"flash_attn"``.
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
    if shared is not None and hybrid:  # (the same on every rank: the call's arguments)
        raise ValueError(
            "ring_attention: shared keys (DeepSeek-V4's compressed entries) are not supported with ulysses"
        )
    if selected is not None:  # (the same on every rank: the model's shapes and configuration)
        _check_selected(selected, q, k)
    if isinstance(sinks, torch.Tensor) and sinks.dim() == 3 and hybrid:  # (the model's configuration)
        raise ValueError("ring_attention: a sink per query (sinks [batch, q_heads, local_seq]) is not supported with "
                         "ulysses")  # fmt: skip
    if distance_bias is not None:  # (likewise)
        _check_bias(distance_bias, q, hybrid=hybrid, shared=shared is not None, softcap=softcap)
    if alibi_slopes is not None:  # (likewise)
        _check_slopes(alibi_slopes, q, distance_bias)
        _check_bias(None, q, hybrid=False, shared=shared is not None, softcap=softcap, what="alibi_slopes")
        distance_bias = alibi_slopes  # (the torch backend tells them by their shape)
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
        key = _planning.cache_key(
            q, k, v, comm, layout, causal, scale, sliding_window, softcap, sinks, cu_seqlens, docs, block_ids, backend
        )
        key = key if key is None or not hybrid else (*key, id(ulysses))
        plan = plans.checked(key, held) if key is not None else None
    if plan is None:
        reuse = plans.get(key, held) if key is not None else None
        plan = _planning.make_plan(
            q, k, v, comm, layout, causal, scale, sliding_window, softcap, sinks, cu_seqlens, document_ids, block_ids,
            backend, reuse, ulysses=ulysses if hybrid else None,
        )  # fmt: skip
        if key is not None:
            plans.store(key, held, plan)
    if callable(selected):  # after the pre-flight check: its collectives run only when every rank passed it
        try:
            selected = selected()
            _check_selected(selected, q, k)
        except BaseException as e:
            _failed(watch, comm, e)
            raise
    if callable(shared):  # (likewise: it may gather)
        try:
            shared = shared()
            _check_shared(shared, q, k, v)
        except BaseException as e:
            _failed(watch, comm, e)
            raise
    selected = None if selected is None else Selection.of(selected)
    if not hybrid:  # (a bias by distance: neither hybrid nor with shared keys)
        index = None if selected is None else selected.index
        if shared is None:
            return _RingAttention.apply(q, k, v, sinks, plan, comm, watch, index, selected, *(None,) * 4, distance_bias)
        extra = (shared.keys, shared.values, shared.selected.index if shared.selected is not None else None)
        return _RingAttention.apply(q, k, v, sinks, plan, comm, watch, index, selected, *extra, shared)
    return _hybrid(q, k, v, sinks, plan, comm, ulysses, watch, selected, alibi_slopes)


def _check_shared(shared, q, k, v) -> None:
    """ValueError unless ``shared`` is a ``SharedKeys`` these queries can attend to (the same on every rank: the
    model's shapes)."""
    ok = isinstance(shared, SharedKeys) and all(isinstance(t, torch.Tensor) for t in (shared.keys, shared.values))
    if ok:
        ek, ev, pos = shared.keys, shared.values, shared.positions
        ok = (
            ek.dim() == 4 and ev.dim() == 4 and ek.shape[:3] == ev.shape[:3] and ek.shape[0] == q.shape[0]
            and ek.shape[1] == k.shape[1] and ek.shape[-1] == k.shape[-1] and ev.shape[-1] == v.shape[-1]
            and isinstance(pos, torch.Tensor) and pos.device.type == "cpu" and pos.shape == (ek.shape[2],)
            and ek.device == q.device and ev.device == q.device
        )  # fmt: skip
    if not ok:
        raise ValueError(
            "ring_attention: shared must be a hf_ring.ring.SharedKeys with keys [batch, kv_heads, n, head_dim] and "
            "values [batch, kv_heads, n, v_head_dim] like k and v's, on q's device, and positions [n] on the host"
        )
    if shared.selected is not None:
        problem = selection_error(shared.selected, q, k, device=True)
        if problem is not None:
            raise ValueError(f"ring_attention: shared keys' {problem}")


def _check_slopes(slopes, q, distance_bias) -> None:
    """ValueError unless ``slopes`` are ALiBi's slopes for these queries, without a bias by distance beside them (the
    same on every rank: the model's shapes and configuration)."""
    hq = q.shape[1]
    if not (
        isinstance(slopes, torch.Tensor) and tuple(slopes.shape) == (hq,) and slopes.dtype.is_floating_point
        and slopes.device == q.device and not slopes.requires_grad
    ):  # fmt: skip
        got = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise ValueError(
            f"ring_attention: alibi_slopes must be a floating-point tensor [q_heads={hq}] on q's device that requires "
            f"no gradient (ALiBi's slopes are fixed), got {got}"
        )
    if distance_bias is not None:
        raise ValueError("ring_attention: pass distance_bias or alibi_slopes, not both")


def _check_bias(bias, q, *, hybrid: bool, shared: bool, softcap, what: str = "distance_bias") -> None:
    """ValueError unless ``bias`` is a bias by distance for these queries (``what="alibi_slopes"``: None, the slopes
    checked by ``_check_slopes``), in a call that can take one (the same on every rank: the model's shapes and
    configuration)."""
    b, hq, lq, _ = q.shape
    if bias is not None and not (
        isinstance(bias, torch.Tensor) and bias.dim() == 4 and tuple(bias.shape[:3]) == (b, hq, lq)
        and bias.shape[3] >= 1 and bias.dtype.is_floating_point and bias.device == q.device
    ):  # fmt: skip
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(
            f"ring_attention: distance_bias must be a floating-point tensor [batch={b}, q_heads={hq}, local_seq={lq}, "
            f"extent >= 1] on q's device, got {got}"
        )
    for given, name in ((hybrid, "ulysses"), (shared, "shared keys"), (softcap is not None, "softcap")):
        if given:
            raise ValueError(f"ring_attention: {what} is not supported with {name}")


def _biasing(plan: Plan, bias: torch.Tensor, dbias: torch.Tensor | None = None, inputs=None, kernels=None) -> Plan:
    """This call's plan with its bias: the steps on a backend that reads it (``kernels``, or chosen here; the plan's
    ``backend.kernels``), given ``bias`` (and, backward, the accumulator of its gradient). A table by distance: the
    plan's backend if it reads one, else the torch backend. ALiBi's slopes ([q_heads]): the plan's backend if it
    takes them, else the one that runs the steps fused attention ops cannot (triton on CUDA), when it can run
    ``inputs`` (q, k, v); else the torch backend."""
    if kernels is None and bias.dim() == 1:
        kernels = plan.backend if getattr(plan.backend, "ALIBI", False) else masked_fallback(bias.device)
        if not getattr(kernels, "ALIBI", False) or unsupported_by(kernels, *inputs):
            kernels = _torch_backend
    elif kernels is None:
        kernels = plan.backend if getattr(plan.backend, "BIAS", False) else _torch_backend
    backend = SimpleNamespace(
        kernels=kernels, __name__=f"{kernels.__name__} with a bias", SOFTCAP=False,
        SELECT=getattr(kernels, "SELECT", False),
        forward=functools.partial(kernels.forward, bias=bias),
        backward=functools.partial(kernels.backward, bias=bias, dbias=dbias),
    )  # fmt: skip
    return dataclasses.replace(plan, backend=backend)


def _check_selected(selected, q, k=None) -> None:
    """ValueError unless ``selected`` is a selection ``ring_attention`` takes for these queries (a function: later)."""
    if callable(selected):
        return
    problem = selection_error(selected, q, k, device=True)
    if problem is not None:
        raise ValueError(f"ring_attention: {problem}")


def _selecting(plan: Plan, selected: Selection, seq_len: int) -> Plan:
    """This call's plan with its selection: every step's mask hides the keys outside it, and the steps run on a
    backend that reads it (the torch backend, unless the plan's does)."""
    backend = plan.backend if getattr(plan.backend, "SELECT", False) else _torch_backend
    masks = [m.with_selection(selected, seq_len) for m in plan.masks]
    return dataclasses.replace(plan, backend=backend, masks=masks)


def _hybrid(q, k, v, sinks, plan, comm, ulysses, watch, selected: Selection | None = None, slopes=None):
    """Ulysses x Ring: heads for sequence inside the Ulysses group, the ring across groups, heads back. A selection
    travels as the keys do: one per query to every rank of the group, one per key/value head to the rank of that head
    (an all-to-all of integers, no gradient). Sinks and ALiBi's slopes: those of this rank's query heads."""
    u, x = ulysses.ulysses_size, ulysses.exchange
    index = None if selected is None else selected.index
    if index is not None:  # the all-to-all below needs the same shape on every rank: checked first, everywhere
        summary = [0, index.dim(), index.shape[-1], index.element_size(), selected.block, selected.start]
        fields = ("error", "selection dimensions", "selection entries per query", "selection entry bytes",
                  "selection block", "selection start")  # fmt: skip
        check_everywhere(None, summary, RingComm(ulysses.cp_group), q.device, fields=fields, op="ring_attention")
    repeat = math.lcm(k.shape[1], u) // k.shape[1]
    if repeat > 1:  # fewer KV heads than the group splits: each KV head serves the same query heads as before
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if sinks is not None:
        sinks = sinks.view(u, -1)[x.rank]  # the sinks of this rank's query heads
    if slopes is not None:
        slopes = slopes.view(u, -1)[x.rank]
    q, k, v = x.heads_to_sequence(q), x.heads_to_sequence(k), x.heads_to_sequence(v)
    if index is not None:
        if index.dim() == 3:  # one list per query, for every head: each rank of the group gets them all
            index = index.unsqueeze(1).expand(-1, u, -1, -1)
        elif repeat > 1:
            index = index.repeat_interleave(repeat, dim=1)
        with torch.no_grad():
            index = x.heads_to_sequence(index.contiguous())
        index = index[:, 0] if selected.index.dim() == 3 else index
    if plan.order is not None:  # the gathered tokens in position order (the plan's masks are built for it)
        q, k, v = (t.index_select(2, plan.order[0]) for t in (q, k, v))
        index = None if index is None else index.index_select(-2, plan.order[0])
    if index is None:
        out = _RingAttention.apply(q, k, v, sinks, plan, comm, watch, *(None,) * 6, slopes)
    else:
        out = _RingAttention.apply(q, k, v, sinks, plan, comm, watch, index, selected, *(None,) * 4, slopes)
    if plan.order is not None:
        out = out.index_select(2, plan.order[1])
    return x.sequence_to_heads(out)


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


def _ring_forward(q, k, v, plan: Plan, comm):
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


def _ring_backward(dout, q, kv, out, lse, delta, plan: Plan, comm):
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


def _shared_selecting(mask: BlockMask, selected: Selection | None, index: torch.Tensor | None) -> BlockMask:
    """The mask of the shared keys (causal by their positions) with their selection: ``selected``'s block and start,
    ``index`` its entries (saved for the backward as a tensor); as it is without one."""
    if index is None:
        return mask
    end = int(mask.k_pos.max()) + 1 if mask.k_pos.numel() else 0
    return mask.with_selection(dataclasses.replace(selected, index=index), end)


def _failed(watch, comm, error: BaseException) -> None:
    """This rank's ring call failed: stop its groups (``hf_ring.guard``), naming this rank and the call.
    An exchange that failed because the group was stopped elsewhere spreads that record instead."""
    if watch is None:
        return
    groups, name, _ = watch
    where = f" {comm.where} of" if comm.where else " in"
    guard.failed(groups, error, f"{where} {name}")


def _per_row(sinks: torch.Tensor) -> torch.Tensor:
    """The sinks as fp32 logits broadcast over the rows ``[batch, q_heads, local_seq]``: one per head, or one per
    query."""
    return sinks.float()[None, :, None] if sinks.dim() == 1 else sinks.float()


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
    def forward(ctx, q, k, v, sinks, plan, comm, watch, selected=None, selection=None, ek=None, ev=None, e_index=None,
                shared=None, bias=None):  # fmt: skip
        with torch.autocast(q.device.type, enabled=False):
            try:
                run = plan
                if selected is not None:
                    selection = dataclasses.replace(selection, index=selected)  # (the hybrid's, exchanged)
                    run = _selecting(plan, selection, q.shape[2] * plan.world_size)
                if bias is not None:
                    run = _biasing(run, bias.detach(), inputs=(q, k, v))
                    ctx.bias_kernels = run.backend.kernels  # (the backward's too)
                out, lse, kv = _ring_forward(q, k, v, run, comm)
            except BaseException as e:
                _failed(watch, comm, e)
                raise
            shared_mask = None
            if shared is not None:  # the keys every rank holds whole: one more block, local
                shared_mask = BlockMask(plan.masks[0].q_pos, shared.positions, causal=plan.masks[0].causal)
                mask = _shared_selecting(shared_mask, shared.selected, e_index)
                _torch_backend.forward(q, ek, ev, mask, plan.scale, out, lse, **plan.kernel_kwargs)
                out.masked_fill_(torch.isinf(lse).unsqueeze(-1), 0.0)
            if sinks is not None:
                merged = torch.logaddexp(lse, _per_row(sinks.detach()))
                out.mul_(torch.exp(lse - merged).unsqueeze(-1))
                lse = merged
        # Compiled, the output is a copy, never the buffer the kernels mutated: torch 2.11's AOTAutograd
        # gives a mutated output of a custom op a zero gradient (found with the triton backend, fp32).
        out = out.to(q.dtype, copy=torch.compiler.is_compiling())
        ctx.save_for_backward(q, *((k, v) if kv is None else (kv,)), out, lse, sinks, selected, ek, ev, e_index, bias)
        # (the selections' indices are saved as tensors; their block and start go with the context)
        ctx.selection = None if selection is None else dataclasses.replace(selection, index=None)
        ctx.shared_mask = shared_mask  # (with its device copies: the backward reuses them)
        ctx.shared_selected = None if e_index is None else dataclasses.replace(shared.selected, index=None)
        ctx.plan, ctx.comm, ctx.watch = plan, comm, watch
        return out

    @staticmethod
    def backward(ctx, dout):
        q, *kv, out, lse, sinks, selected, ek, ev, e_index, bias = ctx.saved_tensors
        kv = kv[0] if len(kv) == 1 else tuple(kv)
        with torch.autocast(q.device.type, enabled=False):
            delta = (dout.float() * out.float()).sum(-1)
            dbias = None
            try:
                plan = ctx.plan
                if selected is not None:
                    selection = dataclasses.replace(ctx.selection, index=selected)
                    plan = _selecting(plan, selection, q.shape[2] * plan.world_size)
                if bias is not None:
                    if ctx.needs_input_grad[13]:
                        dbias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                    plan = _biasing(plan, bias, dbias, kernels=ctx.bias_kernels)
                dq, dk, dv = _ring_backward(dout, q, kv, out, lse, delta, plan, ctx.comm)
            except BaseException as e:
                _failed(ctx.watch, ctx.comm, e)
                raise
            if ctx.watch is not None and ctx.watch[2] is not None:
                ctx.watch[2].backward_calls += 1
            dsinks = None
            if sinks is not None and ctx.needs_input_grad[3]:
                dsinks = -(torch.exp(_per_row(sinks) - lse) * delta)
                dsinks = (dsinks.sum((0, 2)) if sinks.dim() == 1 else dsinks).to(sinks.dtype)
            dek = dev = None
            if ctx.shared_mask is not None:  # the local block of the shared keys: its gradients stay here
                dek = torch.zeros(ek.shape, dtype=torch.float32, device=q.device)
                dev = torch.zeros(ev.shape, dtype=torch.float32, device=q.device)
                mask = _shared_selecting(ctx.shared_mask, ctx.shared_selected, e_index)
                _torch_backend.backward(
                    dout, q, ek, ev, lse, delta, mask, ctx.plan.scale, dq, dek, dev, out=out, **ctx.plan.kernel_kwargs
                )  # fmt: skip
                dek, dev = dek.to(ek.dtype), dev.to(ev.dtype)
        grads = (dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dsinks, None, None, None, None, None)
        return *grads, dek, dev, None, None, None if dbias is None else dbias.to(bias.dtype)
