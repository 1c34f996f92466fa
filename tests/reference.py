"""Plain attention on the unsharded sequence: the reference every numeric test compares with; and one ring step
through a kernel backend (``backend_step``), checked against the torch backend (``steps_match_torch_backend``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["backend_step", "dense_mask", "fused_op_calls", "reference_attention", "sdpa_attention", "rel_err", "doc_ids_from_cu",
           "steps_match_torch_backend", "virtual_ring"]  # fmt: skip


def doc_ids_from_cu(cu: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[1, seq_len] document id of every token from cu_seqlens boundaries."""
    return torch.bucketize(torch.arange(seq_len), cu.long()[1:], right=True)[None]


def dense_mask(seq_len: int, causal=True, window: int | None = None, docs: torch.Tensor | None = None, blocks=None):
    """[1 or batch, 1, S, S] bool visibility, written independently of hf_ring's BlockMask.

    ``blocks``: [1 or batch, S] ids of bidirectional blocks (Transformers' ``block_sequence_ids``: equal ids >= 0
    see each other both ways, OR-ed with the causal mask before the window applies)."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    vis = torch.ones(seq_len, seq_len, dtype=torch.bool)
    if causal:
        vis &= j <= i
    vis = vis[None, None]
    if blocks is not None:
        g = blocks[:, None]
        vis = vis | ((g[..., :, None] == g[..., None, :]) & (g[..., :, None] >= 0))
    if window is not None:
        vis = vis & (((i - j) if causal else (i - j).abs()) < window)
    if docs is not None:
        d = docs[:, None]
        vis = vis & (d[..., :, None] == d[..., None, :]) & (d[..., :, None] >= 0)
    return vis


def reference_attention(
    q, k, v, *, causal=True, window=None, docs=None, scale=None, softcap=None, sinks=None, dtype=torch.float64,
    blocks=None, keep=None, bias=None, alibi=None,
):  # fmt: skip
    """Softmax attention in ``dtype`` with K/V repeated to the query heads; empty rows give 0.

    ``bias``: [batch, heads, S, E]: each query's additive bias by backward distance (Inkling's relative position bias):
    the score of key j for query i gets ``bias[..., i, i - j]`` when ``0 <= i - j < E``. ``alibi``: [heads] slopes: the
    score of key j for query i gets ``-slope * (i - j)`` (ALiBi).
    ``softcap``: scores become ``softcap * tanh(s / softcap)`` before masking (Gemma2). ``sinks``: [heads]
    logits appended to every row's softmax and dropped after it (gpt-oss's learned sinks), or [batch, heads, S]: one per
    query (Inkling 2's). ``keep``: [batch, 1 or heads, S, S]
    bool, ANDed with the mask (a selection of keys per query: DeepSeek sparse attention).
    """
    g = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(g, 1)
    v = v.to(dtype).repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        n, extent = q.shape[2], bias.shape[-1]
        dist = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        for d in range(min(extent, n)):  # one diagonal at a time
            s = s + (dist == d) * bias.to(dtype)[..., :, d : d + 1]
    if alibi is not None:
        n = q.shape[2]
        s = s - alibi.to(dtype)[:, None, None] * (torch.arange(n)[:, None] - torch.arange(n)[None, :]).to(dtype)
    mask = dense_mask(q.shape[2], causal, window, docs, blocks)
    s = s.masked_fill(~(mask if keep is None else mask & keep), -math.inf)
    if sinks is not None:
        col = sinks.to(dtype)[None, :, None, None] if sinks.dim() == 1 else sinks.to(dtype)[..., None]
        col = col.expand(*s.shape[:-1], 1)
        return torch.softmax(torch.cat([s, col], -1), -1)[..., :-1] @ v
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def sdpa_attention(q, k, v, *, causal=True, window=None, docs=None, scale=None):
    """PyTorch's own SDPA in the inputs' dtype (the low-precision yardstick of STYLE.md)."""
    g = q.shape[1] // k.shape[1]
    mask = dense_mask(q.shape[2], causal, window, docs)
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask, scale=scale
    )
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are 0); NaN anywhere gives inf."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return math.inf
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def virtual_ring(
    q, k, v, do, n: int, layout: str, *, backend="torch", causal=True, window=None, docs=None, blocks=None
):
    """``ring_attention`` over ``n`` virtual ranks in one process, on full-sequence tensors: every rank's output
    and gradients put back in sequence order, ``(out, dq, dk, dv)`` (dk/dv fp32: the accumulators that leave
    each rank, summed where they would arrive). ``LoopbackComm`` hands each rank the blocks the others send."""
    import hf_ring
    from hf_ring.layout import positions
    from hf_ring.ring import _halves, _message

    kw = dict(layout=layout, backend=backend, causal=causal, sliding_window=window, document_ids=docs, block_ids=blocks)
    if n == 1:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = hf_ring.ring_attention(*leaves, **kw)
        return (out.detach(), *torch.autograd.grad(out, leaves, do))
    pos = [positions(q.shape[2], rank=r, world_size=n, layout=layout, device=q.device) for r in range(n)]
    blocks = [_message(k.index_select(2, p), v.index_select(2, p)) for p in pos]  # what each rank sends first
    out, dq = torch.zeros(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device), torch.zeros_like(q)
    dk, dv = torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)
    for r, p in enumerate(pos):
        leaves = [x.index_select(2, p).requires_grad_() for x in (q, k, v)]
        comm = hf_ring.LoopbackComm(r, n, blocks, record=True)
        o = hf_ring.ring_attention(*leaves, comm=comm, **kw)
        grads = torch.autograd.grad(o, leaves, do.index_select(2, p))
        out[:, :, p], dq[:, :, p] = o.detach(), grads[0]
        for step, acc in enumerate(comm.sent):  # what left rank r at this step belongs to block (r - step) mod n
            gk, gv = _halves(acc, k.shape[3])
            dk[:, :, pos[(r - step) % n]] += gk
            dv[:, :, pos[(r - step) % n]] += gv
    return out, dq, dk, dv


def backend_step(backend, q, k, v, do, mask, scale):
    """``(out, dq, dk, dv)`` of one ring step through a kernel backend's ``forward`` and ``backward`` (fp32
    accumulators on q's device, the final LSE and output handed to the backward, as the ring does)."""
    b, hq, lq, device = *q.shape[:3], q.device
    out = torch.zeros(b, hq, lq, v.shape[-1], device=device)
    lse = torch.full((b, hq, lq), -math.inf, device=device)
    backend.forward(q, k, v, mask, scale, out, lse)
    delta = (do.float() * out).sum(-1)
    dq, dk, dv = (torch.zeros(x.shape, device=device) for x in (q, k, v))
    backend.backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, out=out.to(q.dtype))
    return out, dq, dk, dv


def fused_op_calls(monkeypatch) -> list:
    """``[(op name, "fwd" or "bwd")]``, one entry per call of the sdpa / cudnn backends' fused ops from here on."""
    from hf_ring.kernels import sdpa_backend

    calls = []

    def recorded(op):
        def fwd(*a):
            calls.append((op.name, "fwd"))
            return op.fwd(*a)

        def bwd(*a):
            calls.append((op.name, "bwd"))
            return op.bwd(*a)

        return op._replace(fwd=fwd, bwd=bwd)

    for backend, ops in list(sdpa_backend.OPS.items()):
        monkeypatch.setitem(sdpa_backend.OPS, backend, tuple(recorded(op) for op in ops))
    return calls


def steps_match_torch_backend(layout: str, q, k, v, do, what: tuple = ()) -> None:
    """Every ring step of 3 ranks of 24 tokens (``layout``), forward and backward through the sdpa backend, against
    the torch backend (fp32)."""
    import hf_ring
    from hf_ring.kernels import BlockMask, sdpa_backend, torch_backend

    world, full = 3, 72
    pos = [hf_ring.positions(full, rank=r, world_size=world, layout=layout) for r in range(world)]
    for rank in range(world):
        for src in range(world):
            mask = BlockMask(pos[rank], pos[src], causal=True)
            mine = backend_step(sdpa_backend, q, k, v, do, mask, 0.3)
            ref = backend_step(torch_backend, q, k, v, do, mask, 0.3)
            for name, a, r in zip(("out", "dq", "dk", "dv"), mine, ref):
                # fp32: the same math in another order, rounding only
                assert rel_err(a, r) <= 1e-5, (*what, layout, rank, src, name)
