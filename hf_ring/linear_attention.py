"""Linear-attention layers (Gated DeltaNet: Qwen3-Next, Qwen3.5) over a sequence sharded across a CP group, exactly.

A Gated DeltaNet layer runs a short causal convolution over its projected inputs, then the gated delta rule, a
recurrence over the sequence with a ``[d_k, d_v]`` state per value head::

    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,        o_t = S_t^T q_t

Nothing in it looks further back than the state and the last K - 1 convolution inputs, so under context
parallelism each rank needs, for each of its chunks of the sequence (``hf_ring.layout``: zig-zag gives a rank two,
contiguous one), the state its chunk starts from and the K - 1 inputs before it; both live on other ranks.

The recurrence is affine in its starting state: a chunk that starts from ``X`` ends in ``P X + F`` and outputs
``o_t(0) + X^T u_t``, where ``F`` and ``o_t(0)`` are what it gives from a zero state, ``P`` is the product of its
transitions and ``u_t = P_t^T q_t``. One call of the model's own kernel gives all of them: the values widened by
``d_k`` zero columns and the starting state ``[0 | I]`` (then the identity's columns carry ``P_t``). So every rank

1. all-gathers the last K - 1 convolution inputs of every chunk and convolves its chunks with their halo;
2. runs its chunks at once (one kernel call, chunks stacked on the batch) with the widened values;
3. all-gathers ``(F, P)`` of every chunk (fp32, ``[d_k, d_v + d_k]`` per value head and chunk), composes the
   states of the chunks before each of its own in sequence order (``X_{c+1} = P_c X_c + F_c``) and adds
   ``X^T u_t`` to its outputs.

Exact: the single-device arithmetic reordered, with fp32 states (``tests/test_linear_attention.py`` compares with
the unsharded kernel). The price: the kernel's value width grows from ``d_v`` to ``d_v + d_k`` (twice the work at
Qwen3.5's 128 / 128) and two all-gathers per layer and pass (every chunk's state to every rank: ``2N`` chunks x
``H_v d_k (d_v + d_k)`` fp32 values; Qwen3.5-27B, 8 ranks: about 100 MB received per layer). Both all-gathers are
differentiable (``hf_ring.comm.StateGather``): the backward sums what every rank's outputs owe to each chunk.

Limits: the striped layout has no chunks (every token's predecessor lives on another rank) and is refused; chunks
must hold at least K - 1 tokens. Documents packed into one row would need the state to restart at each boundary,
which the Transformers models' own fallback kernels do not do either: the Transformers integration refuses them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import layout as _layout
from .comm import StateGather

__all__ = ["Chunks", "chunks", "gated_delta_rule", "causal_conv1d"]


class Chunks:
    """How this rank's ``local_seq`` tokens cut into runs of consecutive positions: ``count`` runs of ``length``
    tokens each, run ``i`` being chunk ``index[i]`` of the ``total`` chunks of the whole sequence, in order."""

    def __init__(self, count: int, length: int, index: tuple, total: int, world_size: int):
        self.count, self.length, self.index, self.total = count, length, index, total
        self.world_size = world_size

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` with its ``dim`` (this rank's tokens) cut into the runs, stacked on a new leading dimension."""
        return torch.stack(x.split(self.length, dim=dim)) if self.count > 1 else x.unsqueeze(0)

    def join(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Inverse of ``split``: runs stacked on dim 0 back into this rank's tokens along ``dim`` (of a run)."""
        return torch.cat(x.unbind(0), dim=dim) if self.count > 1 else x[0]

    def owner(self, chunk: int) -> tuple[int, int]:
        """``(rank, run)`` holding global chunk ``chunk``."""
        if self.total == self.world_size:  # contiguous (or one rank)
            return chunk, 0
        return (chunk, 0) if chunk < self.world_size else (self.total - 1 - chunk, 1)


def chunks(local_seq: int, *, rank: int, world_size: int, layout: str) -> Chunks:
    """The runs of ``rank``'s tokens (see ``Chunks``); ValueError for the striped layout over several ranks."""
    _layout.check_layout(layout)
    if world_size == 1:
        return Chunks(1, local_seq, (0,), 1, 1)
    if layout == "striped":
        raise ValueError(
            "linear-attention layers (Gated DeltaNet) cannot run on the striped layout: each token's state comes "
            "from the token before it, which lives on another rank; use layout='zigzag' or 'contiguous'"
        )
    if layout == "contiguous":
        return Chunks(1, local_seq, (rank,), world_size, world_size)
    return Chunks(2, local_seq // 2, (rank, 2 * world_size - 1 - rank), 2 * world_size, world_size)


class _Uses(torch.autograd.Function):
    """``y`` itself, made to depend on ``gathered`` too (a zero gradient): a rank whose chunks need nothing from
    the others (the first rank of the contiguous layout) still runs the gather's backward, a collective every
    rank must join."""

    @staticmethod
    def forward(ctx, y, gathered):
        ctx.meta = (gathered.shape, gathered.dtype, gathered.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _previous(every: torch.Tensor, plan: Chunks, fill: torch.Tensor) -> torch.Tensor:
    """For each of this rank's runs, the gathered entry of the chunk before it (``fill`` before the first):
    ``every`` is ``[world, runs, ...]``; returns ``[runs, ...]``."""
    out = []
    for c in plan.index:
        out.append(fill if c == 0 else every[plan.owner(c - 1)])
    return torch.stack(out)


def causal_conv1d(
    x: torch.Tensor, conv: Callable, kernel_size: int, plan: Chunks, gather: StateGather | None
) -> torch.Tensor:
    """A causal convolution over the whole sequence, on this rank's tokens.

    Args:
        x: [batch, channels, local_seq], this rank's tokens (in the layout's order).
        conv: ``conv(x) -> y`` with y[..., t] depending on x[..., t - K + 1 .. t] (zeros before the start), as
            Transformers' ``causal_conv1d_fn`` with the layer's weights.
        kernel_size: K. plan: this rank's runs (``chunks``). gather: the group's ``StateGather`` (None: one rank).

    Returns:
        [batch, channels, local_seq]: what the convolution of the unsharded sequence gives at these tokens.
    """
    halo = kernel_size - 1
    if plan.world_size == 1 or halo == 0:
        return conv(x)
    runs = plan.split(x, dim=2)  # [runs, b, c, n]
    tails = gather.gather(runs[..., -halo:])  # [world, runs, b, c, K - 1]
    before = _previous(tails, plan, torch.zeros_like(runs[0, ..., :halo]))
    y = conv(torch.cat([before, runs], dim=-1).flatten(0, 1))  # runs stacked on the batch
    return _Uses.apply(plan.join(y[..., halo:].unflatten(0, (plan.count, -1)), dim=2), tails)


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    kernel: Callable,
    plan: Chunks,
    gather: StateGather | None,
    **kernel_kwargs,
) -> torch.Tensor:
    """The gated delta rule over the whole sequence, on this rank's tokens.

    Args:
        query, key: [batch, local_seq, k_heads, d_k]; value: [batch, local_seq, v_heads, d_v] (``v_heads`` a
            multiple of ``k_heads``); g (log decay), beta: [batch, local_seq, v_heads]. Transformers' layout.
        kernel: the model's chunked kernel, ``kernel(q, k, v, g=, beta=, initial_state=, output_final_state=,
            **kernel_kwargs) -> (out, final_state)`` (Transformers' ``torch_chunk_gated_delta_rule`` or the fla
            kernel it dispatches to); states ``[batch, v_heads, d_k, d_v]``.
        plan: this rank's runs (``chunks``). gather: the group's ``StateGather`` (None: one rank).
        kernel_kwargs: passed on (``use_qk_l2norm_in_kernel``).

    Returns:
        [batch, local_seq, v_heads, d_v] in query's dtype (the kernel's output dtype).

    With fewer key than value heads, q and k are repeated to the value heads first (each serving
    ``v_heads / k_heads`` consecutive ones), as Transformers 5.17's modules do before their kernel and later
    releases' kernels do inside.
    """
    groups = value.shape[2] // key.shape[2]
    if groups > 1:
        query, key = query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
    if plan.world_size == 1:
        out, _ = kernel(
            query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False, **kernel_kwargs
        )
        return out
    b, _, hv, dv = value.shape
    dk = key.shape[-1]
    dtype = query.dtype
    # fp32 into the kernel: its zero-state outputs and u_t are corrected before the one rounding to the input dtype
    # (Transformers' fallback kernel computes in fp32 anyway); fp32 states and their composition, also under autocast
    q, k, v, gs, bs = (plan.split(t.float(), dim=1).flatten(0, 1) for t in (query, key, value, g, beta))
    wide = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1)  # the identity's columns carry P_t
    start = torch.zeros(q.shape[0], hv, dk, dv + dk, dtype=torch.float32, device=q.device)
    start[..., dv:] = torch.eye(dk, dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):
        out, final = kernel(q, k, wide, g=gs, beta=bs, initial_state=start, output_final_state=True, **kernel_kwargs)
        every = gather.gather(final.float().unflatten(0, (plan.count, b)))  # [world, runs, b, hv, dk, dv + dk]
        # the state each of this rank's chunks starts from, composed in sequence order
        last = max(plan.index)
        starts, x = {}, torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=q.device)
        for c in range(last + 1):
            if c in plan.index:
                starts[c] = x
            if c < last:
                fp = every[plan.owner(c)]
                x = fp[..., dv:] @ x + fp[..., :dv]
        x0 = torch.stack([starts[c] for c in plan.index]).flatten(0, 1)
        fixed = out[..., :dv].float() + torch.einsum("blhk,bhkv->blhv", out[..., dv:].float(), x0)
    return _Uses.apply(plan.join(fixed.to(dtype).unflatten(0, (plan.count, b)), dim=1), every)
