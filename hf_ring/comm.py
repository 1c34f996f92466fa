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
backward): give them different ``tag`` values so that gloo never matches one's message to the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RingComm", "group_rank_and_size"]


def group_rank_and_size(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class RingComm:
    """Send to ``rank + 1`` and receive from ``rank - 1`` (ranks of ``group``), asynchronously.

    Attributes: ``rank``, ``world_size``, ``bytes_sent`` and ``bytes_received`` (running totals).
    """

    def __init__(self, group=None, *, tag: int = 0):
        self.group = group
        self.tag = tag
        self.rank, self.world_size = group_rank_and_size(group)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._ops: list = []
        self._reqs: list = []
        if self.world_size > 1:
            self.send_peer = self._global((self.rank + 1) % self.world_size)
            self.recv_peer = self._global((self.rank - 1) % self.world_size)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor | None = None) -> torch.Tensor:
        """Queue sending ``to_send`` to the next rank and receiving into ``recv_buf`` (allocated if None)."""
        if self.world_size == 1:
            raise RuntimeError("RingComm.send_recv called in a group of one rank")
        if not to_send.is_contiguous():
            raise ValueError("RingComm sends contiguous tensors only")
        if recv_buf is None:
            recv_buf = torch.empty_like(to_send)
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
            self._reqs = dist.batch_isend_irecv(self._ops)
            self._ops = []

    def wait(self) -> None:
        """Block until the launched operations are complete."""
        reqs, self._reqs = self._reqs, []
        for req in reqs:
            req.wait()

    def drain(self) -> None:
        """After an error: drop queued operations and complete the launched ones, so that the group
        is usable again (pending requests would make its next collective hang)."""
        self._ops = []
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - called while another error propagates
            pass
