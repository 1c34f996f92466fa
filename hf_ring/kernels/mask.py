"""The mask of one ring step, described by global token positions, never as a dense matrix.

A ``BlockMask`` says which keys of the block held at one ring step each local query may see.
Visibility of query ``i`` and key ``j`` (all positions are global, in the unsharded sequence):

- causal: ``k_pos[j] <= q_pos[i]``;
- sliding window ``W``: causal ``q_pos[i] - k_pos[j] < W``; non-causal ``|q_pos[i] - k_pos[j]| < W``;
- documents: ``q_doc[b, i] == k_doc[b, j]`` and ``q_doc[b, i] >= 0`` (document id ``-1`` marks a
  padding token, which sees nothing and is seen by nothing).
- bidirectional blocks (``blocks=True``, causal only: the image tokens of Gemma 3): ``q_doc`` / ``k_doc`` then
  hold block codes instead of document ids: ``-1`` padding, ``0`` an ordinary token, ``c > 0`` a token of block
  ``c``. A query sees a key when both are not padding, the window allows it, and the key is not after the query
  *or* both are in the same block: ``(causal or q_doc == k_doc > 0) and window`` (Transformers' blockwise mask:
  the OR, then the window's AND). One document per row (besides padding); ``ring_attention`` builds the codes.
- a selection (``with_selection``: DeepSeek sparse attention's top-k): ``selected[b, i]`` lists the global key
  positions query ``i`` may see at most; a key outside its list is hidden, whatever the rest allows. A
  ``Selection`` may instead list blocks of ``block`` consecutive positions (MiniMax M3's indexer), and may give
  each key/value head (with its group of query heads) a list of its own: ``selected[b, h, i]``.

Positions and document ids live on the host (CPU) so that tiles can be classified without a device
sync (a selection lives on the kernels' device: it is read per tile, never classified); ``device_tensors``
gives cached copies for kernels that read them on the device (uploaded from pinned memory without blocking,
once per mask: the ring builds its masks once per batch).

``pieces`` cuts a mask into the rectangles that fused attention kernels with only a causal flag can
run exactly: fully visible rectangles, causal diagonals and the shifted diagonal of the striped layout.

Tile classes: ``EMPTY`` (nothing visible: skip), ``FULL`` (everything visible: no mask needed),
``PARTIAL`` (evaluate the mask element-wise). The classification is conservative: a tile called
EMPTY or FULL is exactly that; a tile called PARTIAL may still be either.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BlockMask", "EMPTY", "FULL", "PARTIAL", "Selection", "runs", "selection_error", "upload"]

EMPTY, FULL, PARTIAL = 0, 1, 2


def runs(pos: torch.Tensor) -> list[tuple[slice, int]]:
    """Maximal runs of ``pos`` with a constant step: ``[(slice, step)]`` (step 1 for a run of one)."""
    n = pos.numel()
    if n == 0:
        return []
    if n == 1:
        return [(slice(0, 1), 1)]
    d = pos[1:] - pos[:-1]
    out, start = [], 0
    while start < n:
        if start == n - 1:
            out.append((slice(start, n), 1))
            break
        step = int(d[start])
        change = torch.nonzero(d[start:] != step).flatten()
        end = n if change.numel() == 0 else start + int(change[0]) + 1
        out.append((slice(start, end), step))
        start = end
    return out


def upload(t: torch.Tensor, device: torch.device, keep: list) -> torch.Tensor:
    """``t`` (host) on ``device``. On a GPU it is pinned and copied without blocking; the pinned tensor is
    appended to ``keep``, which the caller holds as long as the copy, so the copy never reads freed memory."""
    if device.type != "cuda":
        return t.to(device)
    t = t.pin_memory()
    keep.append(t)
    return t.to(device=device, non_blocking=True)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The keys each query may see at most, beyond what the other masks allow.

    index: integer tensor, [batch, local_q, K] (one list per query, for every head) or [batch, kv_heads, local_q, K]
        (one list per key/value head, for the query heads of its group); each entry names block ``e`` of the
        unsharded sequence, the ``block`` global positions ``start + e * block`` to ``start + e * block + block - 1``;
        negative entries name nothing; repeats are fine.
    block: positions per block (1: the entries are key positions).
    start: the global position of block 0's first key (``ring_generate``'s prompt after the padding it adds in
        front); keys before it are in no block.
    """

    index: torch.Tensor
    block: int = 1
    start: int = 0

    @staticmethod
    def of(selected) -> Selection:
        """``selected`` as a ``Selection`` (a tensor: one of positions)."""
        return selected if isinstance(selected, Selection) else Selection(selected)


def selection_error(selected, q, k, *, device: bool = False) -> str | None:
    """Why ``selected`` is not a selection (a ``Selection`` or its index tensor) for the queries ``q`` [batch, heads,
    tokens, dim] and keys ``k`` [batch, kv_heads, ...], or None; with ``device``, on the queries' device too."""
    sel = Selection.of(selected)
    index, block, start = sel.index, sel.block, sel.start
    batch, length = (q.shape[0], q.shape[2]) if isinstance(q, torch.Tensor) else ("?", "?")
    kv_heads = k.shape[1] if isinstance(k, torch.Tensor) else "kv_heads"
    ok = (
        isinstance(index, torch.Tensor)
        and not index.is_floating_point()
        and not index.is_complex()
        and index.dtype != torch.bool
        and index.dim() in (3, 4)
        and (index.shape[0], index.shape[-2]) == (batch, length)
        and (index.dim() == 3 or index.shape[1] == kv_heads)
        and (not device or index.device == q.device)
    )
    whole = [isinstance(x, int) and not isinstance(x, bool) for x in (block, start)]
    if ok and all(whole) and block >= 1 and start >= 0:
        return None
    got = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
    where = " on the queries' device" if device else ""
    return (
        f"selected must be an integer tensor [batch, tokens, K] = [{batch}, {length}, K] or [batch, kv_heads, "
        f"tokens, K] = [{batch}, {kv_heads}, {length}, K]{where}, or a "
        f"hf_ring.Selection of one with a positive int block and an int start >= 0, got {got} (block {block!r}, "
        f"start {start!r})"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Mask between a rank's queries and one key/value block.

    q_pos: [local_q] int64 global positions of the queries (CPU).
    k_pos: [local_k] int64 global positions of the keys (CPU).
    causal: keys after the query are hidden.
    window: sliding-window size, or None.
    q_doc: [1 or batch, local_q] int32 document ids (-1 = padding), or None (one document).
    k_doc: [1 or batch, local_k] int32 document ids, or None.
    blocks: ``q_doc`` / ``k_doc`` are block codes (see the module docstring), not document ids.
    selected: [batch, local_q, K] or [batch, kv_heads, local_q, K] integer entries naming the global key positions
        (``selected_block`` 1) or blocks of ``selected_block`` positions each query may see at most (negative: none;
        on the kernels' device), or None; ``with_selection`` sets them with ``columns``: for positions, the index in
        this block of the position each entry names (-1: not in the block); for blocks, the block of every key of this
        one (``selected_count`` for a key before the selection's start), and ``selected_count`` the number of blocks
        of the unsharded sequence.
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    causal: bool = True
    window: int | None = None
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    blocks: bool = False
    selected: torch.Tensor | None = None
    selected_block: int = 1
    selected_count: int = 0
    columns: torch.Tensor | None = None
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def has_docs(self) -> bool:
        return self.q_doc is not None

    def visible(self, qs: slice = slice(None), ks: slice = slice(None)) -> torch.Tensor:
        """Dense bool mask of the tile ``[qs, ks]``: ``[batch or 1, tile_q, tile_k]`` (on the positions' device; with
        a selection, on its device; with one per key/value head, ``[batch, kv_heads, tile_q, tile_k]``)."""
        qp = self.q_pos[qs][:, None]
        kp = self.k_pos[ks][None, :]
        vis = torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool, device=qp.device)
        if self.causal:
            vis &= kp <= qp
        vis = vis[None]
        if self.q_doc is not None:
            qd = self.q_doc[:, qs][:, :, None]
            kd = self.k_doc[:, ks][:, None, :]
            if self.blocks:  # the key is not after the query, or both are in one block; neither is padding
                vis = (vis | ((qd == kd) & (qd > 0))) & (qd >= 0) & (kd >= 0)
            else:
                vis = vis & (qd == kd) & (qd >= 0)
        if self.window is not None:
            dist = qp - kp if self.causal else (qp - kp).abs()
            vis = vis & (dist < self.window)[None]
        if self.selected is not None:
            chosen = self._chosen(qs, ks, kp.shape[1])
            vis = vis.to(self.selected.device)
            vis = (vis if chosen.dim() == 3 else vis[:, None]) & chosen
        return vis

    def with_selection(self, selected, seq_len: int) -> BlockMask:
        """This mask with keys outside ``selected`` hidden: a ``Selection``, or its index tensor (entries naming global
        positions < ``seq_len``, the unsharded length), on the kernels' device. Read per tile (``visible``); tiles are
        never called FULL, and there are no ``pieces``."""
        sel = Selection.of(selected)
        device = sel.index.device
        count = -(-max(0, seq_len - sel.start) // sel.block)
        if sel.block == 1:  # (entry e names position start + e: its column, once per mask)
            key = ("columns", str(device), seq_len, sel.start)
            if key not in self._cache:
                after = self.k_pos - sel.start
                kept = after >= 0
                cols = torch.full((max(0, seq_len - sel.start),), -1, dtype=torch.int64)
                cols[after[kept]] = torch.arange(self.k_pos.numel())[kept]
                self._cache[key] = cols.to(device)
        else:
            key = ("block of each key", str(device), sel.block, sel.start, seq_len)
            if key not in self._cache:
                after = self.k_pos - sel.start
                self._cache[key] = torch.where(after >= 0, after // sel.block, count).to(device)
        # (the same positions: their device copies, already uploaded, go with it, so no layer uploads them again)
        shared = {k: v for k, v in self._cache.items() if k == "pinned" or (isinstance(k, tuple) and k[0] == "device")}
        return dataclasses.replace(
            self, selected=sel.index, selected_block=sel.block, selected_count=count, columns=self._cache[key],
            _cache=shared,
        )  # fmt: skip

    def _chosen(self, qs: slice, ks: slice, tile_k: int) -> torch.Tensor:
        """[batch, (kv_heads,) tile_q, tile_k] bool: the keys of the tile that each query's selection lists."""
        if self.selected_block > 1:  # blocks: whether each query lists the block of each key of the tile
            held = self._cache.get("listed")  # (the query tile's, kept while the kernels run over its key tiles)
            if held is None or held[0] != (qs.start, qs.stop):
                n, sel = self.selected_count, self.selected[..., qs, :].long()
                sel = torch.where((sel >= 0) & (sel < n), sel, n)  # else: a spare column, cleared
                listed = torch.zeros(*sel.shape[:-1], n + 1, dtype=torch.bool, device=sel.device)
                listed = listed.scatter_(-1, sel, True)
                listed[..., n] = False  # (which the keys before the first block read)
                held = self._cache["listed"] = ((qs.start, qs.stop), listed)
            return held[1][..., self.columns[ks]]
        sel, start = self.selected[..., qs, :].long(), ks.start or 0
        held = (sel >= 0) & (sel < self.columns.numel())  # (beyond the sequence: no key, as negative entries)
        col = self.columns[torch.where(held, sel, 0)] - start  # [batch, (heads,) tile_q, K]: the column in the tile
        col = torch.where(held & (col >= 0) & (col < tile_k), col, tile_k)  # else: a spare column, cut off
        hit = torch.zeros(*col.shape[:-1], tile_k + 1, dtype=torch.bool, device=col.device)
        return hit.scatter_(-1, col, True)[..., :tile_k]

    def classify(self, qs: slice = slice(None), ks: slice = slice(None)) -> int:
        """EMPTY, FULL or PARTIAL for the tile ``[qs, ks]``, from min/max bounds only."""
        qp, kp = self.q_pos[qs], self.k_pos[ks]
        if qp.numel() == 0 or kp.numel() == 0:
            return EMPTY
        q_lo, q_hi = int(qp.min()), int(qp.max())
        k_lo, k_hi = int(kp.min()), int(kp.max())
        full = True
        if self.causal:
            if k_lo > q_hi and not self._may_share_block(qs, ks):
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
            if self.blocks:  # codes: only padding (-1) hides; one document
                if qd_hi < 0 or kd_hi < 0:
                    return EMPTY
                full &= qd_lo >= 0 and kd_lo >= 0
            else:
                if qd_hi < 0 or kd_hi < 0 or qd_hi < kd_lo or kd_hi < qd_lo:
                    return EMPTY
                full &= qd_lo == qd_hi == kd_lo == kd_hi
        return FULL if full and self.selected is None else PARTIAL

    def _may_share_block(self, qs: slice, ks: slice) -> bool:
        """Whether the bounds allow a query and a key of one block in the tile (their code ranges meet above 0)."""
        if not self.blocks:
            return False
        qd, kd = self.q_doc[:, qs], self.k_doc[:, ks]
        return max(int(qd.min()), int(kd.min()), 1) <= min(int(qd.max()), int(kd.max()))

    def is_empty(self) -> bool:
        """True when the bounds show that no query of the block sees any key (skip the ring step).

        Conservative, O(local_seq): a block it calls non-empty may still be empty; the kernels then
        skip its tiles one by one.
        """
        return self.classify() == EMPTY

    def pieces(self) -> list[tuple[str, slice, slice]] | None:
        """The mask as rectangles a fused kernel with only a causal flag computes exactly, or None.

        ``[(kind, q_slice, k_slice)]``, kind ``"full"`` (every key visible) or ``"causal"`` (query i of
        the slices sees key j iff j <= i, equal lengths). Hidden rectangles are left out. A query run and
        a key run with the same step s and length see each other iff ``j - i <= o`` with ``o =
        floor((q_start - k_start) / s)``: o = 0 is a diagonal (zig-zag and contiguous layouts, and
        striped at or below the own rank), o = -1 the shifted diagonal (striped, a higher source rank:
        queries 1.. against keys ..-1). None for windows, documents, a selection, more than 64 rectangles, or any
        other partial rectangle: those run on a masked kernel. Cached.
        """
        if "pieces" not in self._cache:
            self._cache["pieces"] = self._pieces()
        return self._cache["pieces"]

    def _pieces(self) -> list[tuple[str, slice, slice]] | None:
        if self.window is not None or self.q_doc is not None or self.selected is not None:
            return None
        q_runs, k_runs = runs(self.q_pos), runs(self.k_pos)
        if len(q_runs) * len(k_runs) > 64:
            return None
        pieces = []
        for qs, q_step in q_runs:
            for ks, k_step in k_runs:
                kind = self.classify(qs, ks)
                if kind == EMPTY:
                    continue
                piece = ("full", qs, ks) if kind == FULL else self._diagonal(qs, q_step, ks, k_step)
                if piece is None:
                    return None
                pieces.append(piece)
        return pieces

    def _diagonal(self, qs: slice, q_step: int, ks: slice, k_step: int) -> tuple[str, slice, slice] | None:
        """A partly visible (query run, key run) pair as one causal rectangle, or None if it is none."""
        n = qs.stop - qs.start
        if not self.causal or n != ks.stop - ks.start or (n > 1 and q_step != k_step):
            return None
        o = (int(self.q_pos[qs.start]) - int(self.k_pos[ks.start])) // (q_step if n > 1 else k_step)
        if o == 0:
            return ("causal", qs, ks)
        if o == -1:  # row 0 sees nothing; rows 1.. see keys ..-1 on their diagonal
            return ("causal", slice(qs.start + 1, qs.stop), slice(ks.start, ks.stop - 1))
        return None

    def device_tensors(self, device: torch.device) -> dict:
        """Cached device copies: ``q_pos``, ``k_pos`` (int32) and ``q_doc``, ``k_doc`` (int32 or None).

        On a GPU the host copies are pinned and uploaded without blocking (the cache keeps the pinned
        tensors alive until the mask is dropped, so the copy never reads freed memory).
        """
        key = ("device", str(device))
        if key not in self._cache:
            keep = self._cache.setdefault("pinned", [])

            def move(t):
                return None if t is None else upload(t.to(torch.int32).contiguous(), device, keep)

            self._cache[key] = {
                "q_pos": move(self.q_pos),
                "k_pos": move(self.k_pos),
                "q_doc": move(self.q_doc),
                "k_doc": move(self.k_doc),
            }
        return self._cache[key]
