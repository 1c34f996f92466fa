"""``RingComm``: asynchronous point-to-point exchange with the ring neighbours.

The only module that talks to the network. Each ``send_recv`` queues one send of a tensor to the
next rank and one receive of a same-shaped tensor from the previous rank; ``commit`` launches the
queued operations as one batch (``torch.distributed.batch_isend_irecv``) and ``wait`` blocks until
they are done. Callers overlap computation between ``commit`` and ``wait`` and keep two buffers
(the one being computed on and the one being received into): a buffer handed to ``send_recv`` must
not be modified before ``wait`` returns.

Works on any backend torch.distributed supports for P2P (NCCL on GPU, gloo on CPU). With a world
size of 1 (or no initialised process group) nothing is sent and ``send_recv`` must not be called.

Two ``RingComm`` objects may be in flight at once (keys/values forward and their gradients
backward): ``partner()`` gives the second one, with its own ``tag``, so that gloo never matches
one's message to the other.

``all_gather_ints`` is the one collective besides the ring: ``ring_attention``'s pre-flight check
(a few integers per rank). On NCCL it costs one small device-to-host copy, so callers run it once
per batch, not once per layer. ``all_reduce_max`` serves models whose RoPE frequencies follow the
largest position id (``hf_ring.patches._rope``): once per forward, on the device.

``StateGather`` is the linear-attention layers' all-gather (each chunk's recurrent state and convolution inputs
to every rank; autograd-aware). ``HeadExchange`` is the Ulysses all-to-all (heads for sequence, inside a group of U ranks), and
``ulysses_groups`` splits a CP group into Ulysses groups and the rings across them (the hybrid).

``LoopbackComm`` stands in for ``RingComm`` when N virtual ranks run one after another in one
process (the ring benchmark on one GPU): it hands each step the block another rank would have sent.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from . import guard

__all__ = [
    "HeadExchange", "LoopbackComm", "RingComm", "StateGather", "UlyssesGroups", "auto_ulysses_size", "global_rank",
    "group_rank_and_size", "ulysses_groups",
]  # fmt: skip


def group_rank_and_size(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (the default group: the same), as ``src`` / ``dst`` of a
    collective or a point-to-point call over ``group`` wants it."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class RingComm:
    """Send to ``rank + 1`` and receive from ``rank - 1`` (ranks of ``group``), asynchronously.

    Attributes: ``rank``, ``world_size``, ``bytes_sent`` and ``bytes_received`` (running totals).
    """

    def __init__(self, group=None, *, tag: int = 0, timeout: float | None = None):
        self.group = group
        self.tag = tag
        self.timeout = timeout
        self.where = ""  # the exchange under way ("in the forward at ring step 1 of 2"), for errors
        self._on_gpu = False
        self.rank, self.world_size = group_rank_and_size(group)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._ops: list = []
        self._reqs: list = []
        if self.world_size > 1:
            self.send_peer = global_rank(self.group, (self.rank + 1) % self.world_size)
            self.recv_peer = global_rank(self.group, (self.rank - 1) % self.world_size)

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor | None = None) -> torch.Tensor:
        """Queue sending ``to_send`` to the next rank and receiving into ``recv_buf`` (allocated if None)."""
        if self.world_size == 1:
            raise RuntimeError("RingComm.send_recv called in a group of one rank")
        if not to_send.is_contiguous():
            raise ValueError("RingComm sends contiguous tensors only")
        if recv_buf is None:
            recv_buf = torch.empty_like(to_send)
        self._on_gpu = to_send.is_cuda
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_peer, self.group, self.tag))
        self._ops.append(dist.P2POp(dist.irecv, recv_buf, self.recv_peer, self.group, self.tag))
        nbytes = to_send.numel() * to_send.element_size()
        self.bytes_sent += nbytes
        self.bytes_received += recv_buf.numel() * recv_buf.element_size()
        return recv_buf

    def commit(self) -> None:
        """Launch every queued operation."""
        if self._reqs:
            raise RuntimeError("RingComm.commit called while a previous batch is still in flight")
        if self._ops:
            ops, self._ops = self._ops, []
            try:
                self._reqs = dist.batch_isend_irecv(ops)
            except RuntimeError as e:
                raise self._lost(e) from e

    def wait(self) -> None:
        """Block until the launched operations are complete.

        With ``timeout`` (seconds) on CPU tensors (gloo), a peer that does not answer in time raises
        ``TimeoutError`` naming ``where`` (the exchange, set by the caller) and the peers instead of waiting
        for the process group's own timeout. On GPU (NCCL) waits never block the host; the process group's
        timeout and NCCL's watchdog bound them there.
        """
        reqs, self._reqs = self._reqs, []
        limit = None if self.timeout is None or self._on_gpu else datetime.timedelta(seconds=self.timeout)
        for req in reqs:
            try:
                req.wait() if limit is None else req.wait(limit)
            except RuntimeError as e:
                raise self._lost(e, timed=limit is not None and "time" in str(e).lower()) from e

    def _lost(self, error: Exception, timed: bool = False, peers: str | None = None) -> Exception:
        """The error to raise when the exchange with the peers failed (``timed``: ran past ``timeout``). The
        group is stopped (``hf_ring.guard``); when a peer stopped it, its record says which rank and call failed."""
        if peers is None:
            peers = f"receives from global rank {self.recv_peer}, sends to global rank {self.send_peer}"
        where = f" {self.where}" if self.where else ""
        record = guard.lost([self.group], where.strip() or "in the ring")
        if record is not None:
            return guard.stopped_by_peers(f"rank {self.rank} of the ring stopped{where} ({peers})", record)
        if timed:
            return TimeoutError(
                f"ring_attention: rank {self.rank} of the ring waited more than {self.timeout:g} s{where} for its "
                f"peers ({peers}): a peer died, is stuck, or failed elsewhere; see its error (timeout= of "
                "apply_ring_attention / RingAttentionPlugin)"
            )
        return RuntimeError(f"ring_attention: rank {self.rank} of the ring lost its peers{where} ({peers}): {error}")

    def _collective_device(self, device: torch.device | None) -> torch.device:
        """Where a small collective's tensor lives: ``device`` when it is a GPU and the group runs NCCL; the current
        GPU for a group of NCCL alone (which takes no CPU tensor); else the CPU (gloo, or a group with a CPU backend
        beside NCCL)."""
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and device is not None and device.type == "cuda":
            return device
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def partner(self) -> RingComm:
        """A communicator over the same group with the next tag (for a second exchange in flight)."""
        return RingComm(self.group, tag=self.tag + 1, timeout=self.timeout)

    def all_gather_ints(self, values: list[int], device: torch.device | None = None) -> list[list[int]]:
        """Every rank's ``values`` (the same length everywhere), in rank order: one small all-gather.

        The tensor lives on ``device`` when the group's backend is NCCL and ``device`` is a GPU (NCCL
        needs it there; reading the result back is then one small device-to-host copy), on the current GPU for a
        group of NCCL alone given no GPU ``device``, else on the CPU.
        """
        if self.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64, device=self._collective_device(device))
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(every, mine, group=self.group)
        except RuntimeError as e:
            self.where = "in the pre-flight check"
            raise self._lost(e, peers=f"an all-gather over the {self.world_size} ranks of the group") from e
        return torch.stack(every).tolist()  # (one device-to-host copy under NCCL)

    def all_reduce_max(self, t: torch.Tensor, what: str = "the largest-position all-reduce of the rotary embedding"):
        """The element-wise maximum of ``t`` over the group (a new tensor on ``t``'s device): one all-reduce, on
        the device for NCCL (no host sync), else on the CPU, bounded by ``timeout`` there (as ``wait``). ``what``:
        named in errors."""
        if self.world_size == 1:
            return t.clone()
        where = self._collective_device(t.device)
        on_gpu = where.type == "cuda"
        out = t.to(where, copy=True)
        limit = None if self.timeout is None or on_gpu else datetime.timedelta(seconds=self.timeout)
        try:
            work = dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            work.wait() if limit is None else work.wait(limit)
        except RuntimeError as e:
            self.where = f"in {what}"
            timed = limit is not None and "time" in str(e).lower()
            raise self._lost(e, timed=timed, peers=f"an all-reduce over the {self.world_size} ranks") from e
        return out.to(t.device)


class LoopbackComm:
    """``RingComm``'s interface for N virtual ranks that run one after another in one process.

    ``blocks[r]`` is the message virtual rank r sends first (its keys/values as ``hf_ring.ring._message`` builds
    them: stacked, or side by side when the values have their own head_dim). At the s-th
    exchange of a pass (s = 1 .. N-1) rank ``rank`` receives ``blocks[(rank - s) % N]``, handed over
    without a copy, as a P2P receive of another rank's block would deliver it. Every pass of the ring
    (a forward, a backward) makes N-1 exchanges; the counter wraps after each.

    ``partner()`` carries the dK/dV accumulators of the backward: other ranks' contributions cannot
    arrive in a sequential run, so each receive is zeros, and with ``record=True`` every accumulator
    the partner sends is kept (a copy) in this comm's ``sent``: with zero inflow, the accumulator sent
    at step s holds exactly this rank's gradient for the block of rank ``(rank - s) % N``, and summing
    them over ranks gives dK/dV. The pre-flight check sees every virtual rank agree (one caller).
    """

    def __init__(self, rank: int, world_size: int, blocks=None, *, record: bool = False, tag: int = 0):
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"LoopbackComm needs 0 <= rank < world_size and world_size >= 2, got {rank}, {world_size}")
        self.group = None
        self.rank, self.world_size, self.tag = rank, world_size, tag
        self.blocks = blocks
        self.record = record
        self.sent: list[torch.Tensor] = []
        self.bytes_sent = self.bytes_received = 0
        self._count = 0

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor | None = None) -> torch.Tensor:
        nbytes = to_send.numel() * to_send.element_size()
        self.bytes_sent += nbytes
        self.bytes_received += nbytes
        if self.blocks is None:  # gradient accumulators: zero inflow, record what leaves
            if self.record:
                self.sent.append(to_send.clone())
            recv = torch.empty_like(to_send) if recv_buf is None else recv_buf
            return recv.zero_()
        self._count = self._count % (self.world_size - 1) + 1
        return self.blocks[(self.rank - self._count) % self.world_size]

    def commit(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def partner(self) -> LoopbackComm:
        grads = LoopbackComm(self.rank, self.world_size, None, record=self.record, tag=self.tag + 1)
        grads.sent = self.sent
        return grads

    def all_gather_ints(self, values: list[int], device: torch.device | None = None) -> list[list[int]]:
        return [list(values) for _ in range(self.world_size)]


def _collective_failed(group, who: str, timeout, what: str, error: RuntimeError, timed: bool) -> Exception:
    """The error to raise when a collective of ``group`` failed on this rank (``who``: "rank 1 of a Ulysses group";
    ``what``: "its all-to-all"; ``timed``: it ran past ``timeout``): the record of a group stopped elsewhere
    (``hf_ring.guard``), a timeout naming the peers, or a lost peer."""
    record = guard.lost([group], f"in {what}")
    if record is not None:
        return guard.stopped_by_peers(f"{who} stopped in {what}", record)
    peers = dist.get_process_group_ranks(group) if group is not None else "every rank"
    if timed:
        return TimeoutError(
            f"ring_attention: {who} waited more than {timeout:g} s in {what} for its peers (global ranks {peers}): "
            "a peer died, is stuck, or failed elsewhere; see its error (timeout= of apply_ring_attention / "
            "RingAttentionPlugin)"
        )
    return RuntimeError(f"ring_attention: {who} lost its peers (global ranks {peers}) in {what}: {error}")


class StateGather:
    """All-gather of one tensor per rank over a CP group, autograd-aware: ``gather(x)`` returns ``[world, *x.shape]``
    (every rank's ``x``, in group-rank order); its backward sums the gradients of every rank's copy (one all-reduce)
    and keeps this rank's slice. The linear-attention layers send each chunk's recurrent state and last
    convolution inputs through it (``hf_ring.linear_attention``): one small collective per layer and pass.

    ``bytes_received`` counts what arrives from other ranks in the forward. ``timeout`` (seconds; CPU tensors on
    gloo) bounds the wait as ``RingComm.wait`` does; None: the process group's own timeout.
    """

    def __init__(self, group, timeout: float | None = None, what: str = "a linear-attention all-gather"):
        self.group = group
        self.timeout = timeout
        self.what = what  # named in errors
        self.rank, self.world_size = group_rank_and_size(group)
        self.bytes_received = 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x.unsqueeze(0)
        return _Gather.apply(x, self)

    def _run(self, op, *args) -> None:
        on_gpu = args[0].is_cuda if isinstance(args[0], torch.Tensor) else args[0][0].is_cuda
        limit = None if self.timeout is None or on_gpu else datetime.timedelta(seconds=self.timeout)
        try:
            if limit is None:
                op(*args, group=self.group)
            else:
                op(*args, group=self.group, async_op=True).wait(limit)
        except RuntimeError as e:
            timed = limit is not None and "time" in str(e).lower()
            who = f"rank {self.rank} of the CP group"
            raise _collective_failed(self.group, who, self.timeout, self.what, e, timed) from e

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        every = [torch.empty_like(x) for _ in range(self.world_size)]
        self._run(dist.all_gather, every, x)
        self.bytes_received += x.numel() * x.element_size() * (self.world_size - 1)
        return torch.stack(every)

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        self._run(dist.all_reduce, grad)
        return grad[self.rank]


class _Gather(torch.autograd.Function):
    """``StateGather.gather``: all-gather forward, sum of every rank's gradient of this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, gather):
        ctx.gather = gather
        return gather._gather(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.gather._sum(grad), None


class HeadExchange:
    """All-to-all over the heads inside a Ulysses group of U ranks (autograd-aware).

    ``heads_to_sequence``: ``[batch, heads, local_seq, head_dim]`` (this rank's tokens, every head) becomes
    ``[batch, heads / U, U x local_seq, head_dim]`` (this rank's U-th of the heads, the tokens of every
    rank of the group, in group-rank order); ``sequence_to_heads`` is its inverse. Each is the other's
    backward. One ``all_to_all_single`` per call; ``bytes_sent`` / ``bytes_received`` count what leaves
    and arrives from other ranks (the block a rank keeps is not counted), as ``RingComm`` counts.
    ``timeout`` (seconds; CPU tensors on gloo): a peer that does not join the all-to-all in time makes it raise
    ``TimeoutError`` naming the group's ranks, as ``RingComm.wait`` does; None: the process group's own timeout.
    """

    def __init__(self, group, timeout: float | None = None):
        self.group = group
        self.timeout = timeout
        self.rank, self.world_size = group_rank_and_size(group)
        self.bytes_sent = 0
        self.bytes_received = 0

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return _Exchange.apply(x, self, True)

    def sequence_to_heads(self, y: torch.Tensor) -> torch.Tensor:
        return _Exchange.apply(y, self, False)

    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        limit = None if self.timeout is None or send.is_cuda else datetime.timedelta(seconds=self.timeout)
        try:
            if limit is None:
                dist.all_to_all_single(recv, send, group=self.group)
            else:
                dist.all_to_all_single(recv, send, group=self.group, async_op=True).wait(limit)
        except RuntimeError as e:
            timed = limit is not None and "time" in str(e).lower()
            who = f"rank {self.rank} of a Ulysses group"
            raise _collective_failed(self.group, who, self.timeout, "its all-to-all", e, timed) from e
        moved = send.numel() * send.element_size() * (self.world_size - 1) // self.world_size
        self.bytes_sent += moved
        self.bytes_received += moved
        return recv

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        b, h, n, d = x.shape
        u = self.world_size
        send = x.reshape(b, u, h // u, n, d).transpose(0, 1).contiguous()  # [dest, b, h/u, n, d]
        recv = self._exchange(send)  # [src, b, h/u, n, d]: my heads, the tokens of rank src
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * n, d)

    def _to_heads(self, y: torch.Tensor) -> torch.Tensor:
        b, hu, un, d = y.shape
        u = self.world_size
        send = y.reshape(b, hu, u, un // u, d).permute(2, 0, 1, 3, 4).contiguous()  # [dest (tokens), b, h/u, n, d]
        recv = self._exchange(send)  # [src (heads), b, h/u, n, d]: my tokens, the heads of rank src
        return recv.transpose(0, 1).reshape(b, u * hu, un // u, d)


class _Exchange(torch.autograd.Function):
    """One all-to-all of ``HeadExchange``; its backward is the other direction."""

    @staticmethod
    def forward(ctx, x, exchange, to_sequence: bool):
        ctx.exchange, ctx.to_sequence = exchange, to_sequence
        return exchange._to_sequence(x) if to_sequence else exchange._to_heads(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.exchange
        return (x._to_heads(grad) if ctx.to_sequence else x._to_sequence(grad)), None, None


@dataclasses.dataclass(frozen=True, eq=False)
class UlyssesGroups:
    """A context-parallel group of N ranks split for the Ulysses x Ring hybrid (``ulysses_groups``).

    ``ulysses_group``: the U consecutive ranks (of the CP group) this rank exchanges heads with;
    ``ring_group``: the R = N / U ranks with this rank's index inside their Ulysses group, one from each
    Ulysses group, in order: the ring. ``exchange``: the ``HeadExchange`` over ``ulysses_group``.
    """

    cp_group: object
    cp_size: int
    ulysses_size: int
    ulysses_group: object
    ring_group: object
    exchange: HeadExchange

    @property
    def ring_size(self) -> int:
        return self.cp_size // self.ulysses_size

    @property
    def ulysses_rank(self) -> int:
        return self.exchange.rank


def ulysses_groups(group, ulysses_size: int, *, timeout: float | None = None) -> UlyssesGroups:
    """Split the CP group ``group`` (None: the default group) into Ulysses groups of ``ulysses_size``
    consecutive ranks and rings across them. ``timeout``: the all-to-alls' bound (``HeadExchange``).

    Collective over the default group: every process calls it at the same point (the CP groups of all
    data-parallel replicas are split alike, in one order, as ``torch.distributed.new_group`` requires).
    ValueError, before any communication, if ``ulysses_size`` does not divide the CP group's size.
    """
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
        raise ValueError(f"ulysses_size must be a positive int, got {ulysses_size!r}")
    _, n = group_rank_and_size(group)
    if n % ulysses_size:
        raise ValueError(
            f"ulysses_size={ulysses_size} does not divide the context-parallel group's {n} ranks: the group is split "
            f"into Ulysses groups of ulysses_size consecutive ranks; choose a divisor of {n}"
        )
    if ulysses_size == 1 or n == 1:
        exchange = HeadExchange(None) if n == 1 else HeadExchange(group, timeout)
        return UlyssesGroups(group, n, 1, None, group, exchange)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, members)
    me = dist.get_rank()
    mine_u = mine_r = None
    for cp in sorted({tuple(m) for m in every}):  # every CP group, in one order on every process
        for start in range(0, len(cp), ulysses_size):
            ranks = list(cp[start : start + ulysses_size])
            g = dist.new_group(ranks)
            mine_u = g if me in ranks else mine_u
        for index in range(ulysses_size):
            ranks = list(cp[index::ulysses_size])
            g = dist.new_group(ranks)
            mine_r = g if me in ranks else mine_r
    return UlyssesGroups(group, n, ulysses_size, mine_u, mine_r, HeadExchange(mine_u, timeout))


def auto_ulysses_size(cp_size: int, q_heads: int, local_world_size: int | None = None) -> int:
    """``ulysses_size="auto"``: the largest U that divides the CP size and the query heads and keeps every
    Ulysses group inside one node (U divides the processes per node, ``local_world_size``; None: the
    ``LOCAL_WORLD_SIZE`` that torchrun and accelerate launch set, else the CP size, i.e. one node).
    Key/value heads do not limit it: with fewer than U they are repeated (see ``ring_attention``)."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE") or cp_size)
    return max(u for u in range(1, cp_size + 1) if cp_size % u == 0 and q_heads % u == 0 and local_world_size % u == 0)
