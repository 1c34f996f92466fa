"""The mask of one ring step, described by global token positions, never as a dense matrix.

A ``BlockMask`` says which keys of the block held at one ring step each local query may see.
Visibility of query ``i`` and key ``j`` (all positions are global, in the unsharded sequence):

- causal: ``k_pos[j] <= q_pos[i]``;
- sliding window ``W``: causal ``q_pos[i] - k_pos[j] < W``; non-causal ``|q_pos[i] - k_pos[j]| < W``;
- documents: ``q_doc[b, i] == k_doc[b, j]`` and ``q_doc[b, i] >= 0`` (document id ``-1`` marks a
  padding token, which sees nothing and is seen by nothing).

Positions and document ids live on the host (CPU) so that tiles can be classified without a device
sync; ``device_tensors`` gives cached copies for kernels that read them on the device.

Tile classes: ``EMPTY`` (nothing visible: skip), ``FULL`` (everything visible: no mask needed),
``PARTIAL`` (evaluate the mask element-wise). The classification is conservative: a tile called
EMPTY or FULL is exactly that; a tile called PARTIAL may still be either.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BlockMask", "EMPTY", "FULL", "PARTIAL"]

EMPTY, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Mask between a rank's queries and one key/value block.

    q_pos: [local_q] int64 global positions of the queries (CPU).
    k_pos: [local_k] int64 global positions of the keys (CPU).
    causal: keys after the query are hidden.
    window: sliding-window size, or None.
    q_doc: [1 or batch, local_q] int32 document ids (-1 = padding), or None (one document).
    k_doc: [1 or batch, local_k] int32 document ids, or None.
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    causal: bool = True
    window: int | None = None
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def has_docs(self) -> bool:
        return self.q_doc is not None

    def visible(self, qs: slice = slice(None), ks: slice = slice(None)) -> torch.Tensor:
        """Dense bool mask of the tile ``[qs, ks]``: ``[batch or 1, tile_q, tile_k]``."""
        qp = self.q_pos[qs][:, None]
        kp = self.k_pos[ks][None, :]
        vis = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool)
        if self.causal:
            vis &= kp <= qp
        if self.window is not None:
            dist = qp - kp if self.causal else (qp - kp).abs()
            vis &= dist < self.window
        vis = vis[None]
        if self.q_doc is not None:
            qd = self.q_doc[:, qs][:, :, None]
            kd = self.k_doc[:, ks][:, None, :]
            vis = vis & (qd == kd) & (qd >= 0)
        return vis

    def classify(self, qs: slice = slice(None), ks: slice = slice(None)) -> int:
        """EMPTY, FULL or PARTIAL for the tile ``[qs, ks]``, from min/max bounds only."""
        qp, kp = self.q_pos[qs], self.k_pos[ks]
        if qp.numel() == 0 or kp.numel() == 0:
            return EMPTY
        q_lo, q_hi = int(qp.min()), int(qp.max())
        k_lo, k_hi = int(kp.min()), int(kp.max())
        full = True
        if self.causal:
            if k_lo > q_hi:
                return EMPTY
            full &= k_hi <= q_lo
        if self.window is not None:
            w = self.window
            if self.causal:
                if q_lo - k_hi >= w:
                    return EMPTY
                full &= q_hi - k_lo < w
            else:
                if q_lo - k_hi >= w or k_lo - q_hi >= w:
                    return EMPTY
                full &= max(q_hi - k_lo, k_hi - q_lo) < w
        if self.q_doc is not None:
            qd, kd = self.q_doc[:, qs], self.k_doc[:, ks]
            qd_lo, qd_hi = int(qd.min()), int(qd.max())
            kd_lo, kd_hi = int(kd.min()), int(kd.max())
            if qd_hi < 0 or kd_hi < 0 or qd_hi < kd_lo or kd_hi < qd_lo:
                return EMPTY
            full &= qd_lo == qd_hi == kd_lo == kd_hi
        return FULL if full else PARTIAL

    def is_empty(self) -> bool:
        """True when the bounds show that no query of the block sees any key (skip the ring step).

        Conservative, O(local_seq): a block it calls non-empty may still be empty; the kernels then
        skip its tiles one by one.
        """
        return self.classify() == EMPTY

    def device_tensors(self, device: torch.device) -> dict:
        """Cached device copies: ``q_pos``, ``k_pos`` (int32) and ``q_doc``, ``k_doc`` (int32 or None)."""
        key = str(device)
        if key not in self._cache:

            def move(t):
                return None if t is None else t.to(device=device, dtype=torch.int32).contiguous()

            self._cache[key] = {
                "q_pos": move(self.q_pos),
                "k_pos": move(self.k_pos),
                "q_doc": move(self.q_doc),
                "k_doc": move(self.k_doc),
            }
        return self._cache[key]
