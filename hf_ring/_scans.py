"""The recurrences of ``hf_ring.linear_attention`` as one driver (``drive``) runs them over the CP group.

Each recurrence is a small class (``DeltaRule``, ``Mamba2``, ``Mamba``, ``Diagonal``): its kernel call, its carry
``[F | P]`` (the zero-state final state beside the transition), how two carries compose, and how a starting state
corrects the outputs. ``drive`` runs a rank's chunks at once, all-gathers every chunk's carry, composes the states each
of its chunks starts from, and corrects; with packed documents it cuts the chunks where a document starts.
``linear_attention``'s module docstring derives it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .chunks import Chunks, Uses, by_run, groups, padded, row

__all__ = [
    "READOUT_BLOCK",
    "DecayedReadout",
    "DeltaRule",
    "Diagonal",
    "Mamba",
    "Mamba2",
    "Recurrence",
    "drive",
    "identity_start",
    "widened",
]


class Diagonal:
    """``diagonal_scan`` as ``drive`` drives it: inputs ``(x, a)``; the carry of a piece is ``[F | P]`` (``[2 *
    channels]``: the zero-state final state beside the product of the gates)."""

    def run(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        x, a = inputs
        h = Recurrence.apply(a, x)
        return h, torch.cat([h[:, -1], a.prod(dim=1)], dim=-1)

    def cut(self, carry: torch.Tensor) -> torch.Tensor:
        final, _ = carry.chunk(2, dim=-1)
        return torch.cat([final, torch.zeros_like(final)], dim=-1)

    def empty(self, carry: torch.Tensor) -> torch.Tensor:
        return carry.new_zeros(*carry.shape[:-1], carry.shape[-1] // 2)

    def step(self, carry: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        final, product = carry.chunk(2, dim=-1)
        return product * state + final

    def kernel_state(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def output(self, out: torch.Tensor, inputs: list, state: torch.Tensor | None) -> torch.Tensor:
        return out if state is None else out + torch.cumprod(inputs[1], dim=1) * state[:, None]


class Recurrence(torch.autograd.Function):
    """``h_t = a_t * h_{t-1} + x_t`` from ``h_0 = 0`` over dim 1 of ``[batch, seq, channels]`` tensors, forward and
    backward each one scan by doubling (``_doubling``: ``log2(seq)`` vectorised steps instead of ``seq`` small
    ones), keeping only ``a`` and ``h`` for the backward. The backward is the same recurrence run from the end:
    ``dx_t = dh_t + a_{t+1} dx_{t+1}``, ``da_t = dx_t h_{t-1}``. The sums are taken in another order than a loop
    over tokens (fp32: rounding only)."""

    @staticmethod
    def forward(ctx, a, x):
        h = _doubling(a, x)
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, h = ctx.saved_tensors
        after = torch.empty_like(a)  # a_{t+1}, none after the last token
        after[:, :-1] = a[:, 1:]
        after[:, -1:] = 0
        dx = _doubling(after, grad, reverse=True)
        da = dx.clone()
        da[:, 1:] *= h[:, :-1]
        da[:, :1] = 0
        return da, dx


def _doubling(a: torch.Tensor, x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """The inclusive scan of ``h_t = a_t * h_{t-1} + x_t`` (``h_0 = 0``) over dim 1, without autograd (``reverse``:
    ``h_t = a_t * h_{t+1} + x_t`` from the end): after the step of span ``d`` each ``(a_t, x_t)`` holds the
    composition of the ``2d`` steps ending (starting) at ``t``. Two working copies and one step's temporary."""
    with torch.no_grad():
        a, x = a.clone(), x.clone()
        d, n = 1, x.shape[1]
        while d < n:
            to, fro = (slice(None, n - d), slice(d, None)) if reverse else (slice(d, None), slice(None, n - d))
            x[:, to] = torch.addcmul(x[:, to], a[:, to], x[:, fro])
            if 2 * d < n:
                a[:, to] = a[:, to] * a[:, fro]
            d *= 2
    return x


class DeltaRule:
    """The gated delta rule as ``drive`` drives it: inputs ``(q, k, v widened, g, beta)``; the carry of a piece is
    ``[F | P]`` (``[heads, d_k, d_v + d_k]``: the zero-state final state beside the product of the transitions,
    what the identity's columns of the starting state ``[0 | I]`` end as)."""

    def __init__(self, kernel: Callable, dk: int, dv: int, kwargs: dict):
        self.kernel, self.dk, self.dv, self.kwargs = kernel, dk, dv, kwargs

    def run(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta = inputs
        start = identity_start(q.shape[0], v.shape[2], self.dk, self.dv, q.device)
        out, final = self.kernel(q, k, v, g=g, beta=beta, initial_state=start, output_final_state=True, **self.kwargs)
        return out, final.float()

    def cut(self, carry: torch.Tensor) -> torch.Tensor:
        """The carry of a piece whose document ends in it: its state, no transition (the next one starts anew)."""
        return torch.cat([carry[..., : self.dv], torch.zeros_like(carry[..., self.dv :])], dim=-1)

    def empty(self, carry: torch.Tensor) -> torch.Tensor:
        return carry.new_zeros(*carry.shape[:-1], self.dv)

    def step(self, carry: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return carry[..., self.dv :] @ state + carry[..., : self.dv]

    def kernel_state(self, state: torch.Tensor) -> torch.Tensor:
        """A composed state as the kernel takes it (``[batch, heads, d_k, d_v]``, as composed)."""
        return state

    def output(self, out: torch.Tensor, inputs: list, state: torch.Tensor | None) -> torch.Tensor:
        y = out[..., : self.dv].float()
        if state is None:
            return y
        return y + torch.einsum("blhk,bhkv->blhv", out[..., self.dv :].float(), state)


class Mamba2:
    """Mamba2's scan as ``drive`` drives it: inputs ``(x, dt, B, C)``; the carry of a piece is ``[F | a]``
    (``[heads, head_dim * d_state + 1]``: the zero-state final state, flattened, beside the product of the
    decays)."""

    def __init__(self, kernel: Callable, chunk_size: int, A: torch.Tensor, D: torch.Tensor | None):
        self.kernel, self.chunk_size, self.A, self.D = kernel, chunk_size, A, D
        self.state_shape = None  # (head_dim, d_state), from the first call

    def run(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        x, dt, B, C = inputs
        self.state_shape = (x.shape[-1], B.shape[-1])
        # pieces shorter than the model's chunk (packed documents) in chunks of the next power of two (at least 16):
        # the kernel pads every call to a multiple of its chunk; the result is the same up to rounding
        n = x.shape[1]
        chunk = self.chunk_size if n >= self.chunk_size else min(self.chunk_size, max(16, 1 << (n - 1).bit_length()))
        out, final = self.kernel(x, dt, self.A, B, C, chunk, D=self.D, return_final_states=True)
        decay = (dt * self.A).sum(dim=1).exp()  # [n, heads]; zero-padded ends (dt = 0) leave it as it is
        return out.float(), torch.cat([final.float().flatten(-2), decay[..., None]], dim=-1)

    def cut(self, carry: torch.Tensor) -> torch.Tensor:
        return torch.cat([carry[..., :-1], torch.zeros_like(carry[..., -1:])], dim=-1)

    def empty(self, carry: torch.Tensor) -> torch.Tensor:
        return carry.new_zeros(*carry.shape[:-1], carry.shape[-1] - 1)

    def step(self, carry: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return carry[..., -1:] * state + carry[..., :-1]

    def kernel_state(self, state: torch.Tensor) -> torch.Tensor:
        """A composed state as the kernel takes it: ``[batch, heads, head_dim, d_state]``."""
        return state.unflatten(-1, self.state_shape)

    def output(self, out: torch.Tensor, inputs: list, state: torch.Tensor | None) -> torch.Tensor:
        if state is None:
            return out
        _, dt, _, C = inputs
        C = C.repeat_interleave(out.shape[2] // C.shape[2], dim=2)  # [n, len, heads, d_state]
        decay = torch.cumsum(dt * self.A, dim=1).exp()  # [n, len, heads]
        state = state.unflatten(-1, (out.shape[-1], C.shape[-1]))  # [n, heads, head_dim, d_state]
        return out + decay[..., None] * torch.einsum("blhs,bhps->blhp", C, state)


class Mamba:
    """Mamba's (Mamba1's) scan as ``drive`` drives it: inputs ``(x, dt, B, C)``; the carry of a piece is ``[F | S |
    k]`` (``[channels * d_state + channels + 1]``: the zero-state final state, flattened; the step sizes summed per
    channel, whose ``exp(A S)`` is the piece's transition; 1, or 0 once ``cut``: no transition).

    The final state is read from the kernel's outputs, not its returned state (mamba-ssm's backward drops the
    returned state's gradient): ``d_state`` tokens appended with ``dt = 0`` (no decay, no input) and ``C`` the unit
    vectors output ``F`` itself, through the kernel's own backward."""

    def __init__(self, kernel: Callable, A: torch.Tensor):
        self.kernel, self.A = kernel, A

    def run(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        x, dt, B, C = inputs
        n, length, d_state = x.shape[0], x.shape[1], self.A.shape[1]
        eye = torch.eye(d_state, dtype=C.dtype, device=C.device).expand(n, d_state, d_state)
        x, dt, B = (torch.cat([t, t.new_zeros(n, d_state, t.shape[-1])], dim=1) for t in (x, dt, B))
        C = torch.cat([C, eye], dim=1)
        y = self.kernel(x.transpose(1, 2), dt.transpose(1, 2), self.A, B.transpose(1, 2), C.transpose(1, 2), D=None,
                        z=None)  # fmt: skip
        y = y.transpose(1, 2).float()  # [n, length + d_state, channels]
        total = dt.sum(dim=1)  # [n, channels]; zero-padded ends (dt = 0) leave it as it is
        final = y[:, length:].transpose(1, 2)  # [n, channels, d_state]
        carry = torch.cat([final.flatten(-2), total, torch.ones_like(total[..., :1])], dim=-1)
        return y[:, :length], carry

    def _parts(self, carry: torch.Tensor) -> tuple:
        n = self.A.numel()
        return carry[..., :n], carry[..., n:-1], carry[..., -1:]

    def cut(self, carry: torch.Tensor) -> torch.Tensor:
        state, total, through = self._parts(carry)
        return torch.cat([state, torch.zeros_like(total), torch.zeros_like(through)], dim=-1)

    def empty(self, carry: torch.Tensor) -> torch.Tensor:
        return carry.new_zeros(*carry.shape[:-1], self.A.numel())

    def step(self, carry: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        final, total, through = self._parts(carry)
        return (total[..., None] * self.A).exp().flatten(-2) * through * state + final

    def kernel_state(self, state: torch.Tensor) -> torch.Tensor:
        """A composed state as the kernel takes it: ``[batch, channels, d_state]``."""
        return state.unflatten(-1, tuple(self.A.shape))

    def output(self, out: torch.Tensor, inputs: list, state: torch.Tensor | None) -> torch.Tensor:
        if state is None:
            return out
        _, dt, _, C = inputs
        return out + DecayedReadout.apply(C, torch.cumsum(dt, dim=1), self.A, self.kernel_state(state))


READOUT_BLOCK = 1 << 24
"""How many ``[tokens, channels, d_state]`` fp32 values ``DecayedReadout`` makes at a time (64 MiB: 128 tokens of
a row at 8192 channels x 16 states)."""


class DecayedReadout(torch.autograd.Function):
    """``out[n, t, c] = sum_s C[n, t, s] exp(A[c, s] T[n, t, c]) X[n, c, s]``: what a starting state ``X`` adds to a
    Mamba piece's outputs (``T``: the step sizes summed up to ``t``). Computed over blocks of tokens, forward and
    backward (recomputed there), so no ``[tokens, channels, d_state]`` tensor is held, as an einsum would for its
    backward (512 KiB per token at 8192 channels x 16 states)."""

    @staticmethod
    def forward(ctx, C, T, A, X):
        ctx.save_for_backward(C, T, A, X)
        out = T.new_empty(T.shape)
        for lo, hi in _blocks(T, A.shape[1]):
            out[:, lo:hi] = (_decays(T[:, lo:hi], A) * X[:, None] * C[:, lo:hi, None, :]).sum(-1)
        return out

    @staticmethod
    def backward(ctx, grad):
        C, T, A, X = ctx.saved_tensors
        dC, dT = torch.empty_like(C), torch.empty_like(T)
        dA, dX = torch.zeros_like(A), torch.zeros_like(X)
        for lo, hi in _blocks(T, A.shape[1]):
            g = grad[:, lo:hi, :, None]  # [n, blk, c, 1]
            gE = g * _decays(T[:, lo:hi], A)  # [n, blk, c, s]
            dC[:, lo:hi] = (gE * X[:, None]).sum(2)
            gEC = gE * C[:, lo:hi, None, :]
            dX += gEC.sum(1)
            part = gEC * X[:, None]  # d out / d exponent
            dT[:, lo:hi] = (part * A).sum(-1)
            dA += (part * T[:, lo:hi, :, None]).sum((0, 1))
        return dC, dT, dA, dX


def _decays(T: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``exp(A[c, s] T[n, t, c])``: [n, t, c, s]."""
    return (T[..., None] * A).exp()


def _blocks(T: torch.Tensor, d_state: int) -> list:
    """Token ranges of ``T`` ([n, tokens, channels]) of about ``READOUT_BLOCK`` values with their states."""
    n, length, c = T.shape
    step = max(1, READOUT_BLOCK // max(1, n * c * d_state))
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)]


def widened(value: torch.Tensor, dk: int) -> torch.Tensor:
    """The values in fp32 with ``dk`` zero columns after their own: the identity's columns of the starting state
    (``identity_start``) then carry P_t."""
    return torch.cat([value.float(), value.new_zeros(*value.shape[:-1], dk, dtype=torch.float32)], dim=-1)


def identity_start(n: int, heads: int, dk: int, dv: int, device) -> torch.Tensor:
    """``n`` starting states ``[0 | I]``: ``[n, heads, d_k, d_v + d_k]`` fp32, zeros beside a d_k identity."""
    start = torch.zeros(n, heads, dk, dv + dk, dtype=torch.float32, device=device)
    start[..., dv:] = torch.eye(dk, dtype=torch.float32, device=device)
    return start


def _compose(scan, every: torch.Tensor, plan: Chunks) -> dict:
    """The state each of this rank's chunks starts from (chunk -> [batch, ...], fp32), composed in sequence order
    from every chunk's carry (``every``: [world, runs, batch, ...])."""
    last = max(plan.index)
    starts, x = {}, scan.empty(every[0, 0])
    for c in range(last + 1):
        if c in plan.index:
            starts[c] = x
        if c < last:
            x = scan.step(every[plan.owner(c)], x)
    return starts


def _last(scan, every: torch.Tensor, plan: Chunks) -> torch.Tensor:
    """The state after the whole sequence (``[batch, ...]`` as the kernel takes it), composed from every chunk's
    carry (``every``: [world, runs, batch, ...])."""
    x = scan.empty(every[0, 0])
    for c in range(plan.total):
        x = scan.step(every[plan.owner(c)], x)
    return scan.kernel_state(x).detach()


def drive(scan, inputs: list, plan: Chunks, gather, documents, dtype, memory: dict | None = None) -> torch.Tensor:
    """A recurrence affine in its starting state (``scan``: ``DeltaRule``, ``Mamba2``, ``Mamba``) over the CP group, on this
    rank's tokens (``inputs``: fp32 [batch, local_seq, ...]), in ``dtype``.

    Without documents: this rank's runs in one kernel call (stacked on the batch) from a zero state; every chunk's
    carry all-gathered; each run's starting state composed in sequence order and its outputs corrected.

    With documents: each batch row's runs cut into segments of one document, run in a few kernel calls
    (``groups``: zero-padded at their ends to the group's longest, at most twice the tokens in all; zero inputs
    leave the state as it is). A segment starting a document starts from zero; only a run's first segment, when
    its document goes on from the chunk before, takes that chunk's state (its output corrected), and a chunk
    passes its transition on only if one document runs through it (else the next chunk's state is its last
    segment's). ``memory`` (``ring_generate``'s prefill): gets the state after the whole sequence."""
    b = inputs[0].shape[0]
    runs = [plan.split(t, dim=1) for t in inputs]  # each [runs, b, n, ...]
    with torch.autocast(inputs[0].device.type, enabled=False):
        if documents is None:
            flat = [t.flatten(0, 1) for t in runs]
            out, carry = scan.run(flat)
            every = gather.gather(carry.unflatten(0, (plan.count, b)))  # [world, runs, b, ...]
            if memory is not None:
                memory["state"] = _last(scan, every, plan)
            starts = _compose(scan, every, plan)
            y = scan.output(out, flat, torch.stack([starts[c] for c in plan.index]).flatten(0, 1))
            return Uses.apply(plan.join(y.to(dtype).unflatten(0, (plan.count, b)), dim=1), every)
        rows, exports = [], []
        for r in range(b):
            _, segments = row(documents, r, plan)
            done: list = [None] * len(segments)  # (out, carry, inputs) of each segment
            for group in groups([s.end - s.start for s in segments]):
                longest = max(segments[i].end - segments[i].start for i in group)
                pieces = [
                    padded([t[segments[i].run, r, segments[i].start : segments[i].end] for i in group], longest)
                    for t in runs
                ]
                out, carry = scan.run(pieces)
                for j, i in enumerate(group):
                    done[i] = (out[j], carry[j], [t[j] for t in pieces])
            rows.append((segments, done))
            state = []
            for i in range(plan.count):
                mine = [j for j, s in enumerate(segments) if s.run == i]
                through = len(mine) == 1 and segments[mine[0]].continues  # one document through the whole chunk
                carry = done[mine[-1]][1]
                state.append(carry if through else scan.cut(carry))
            exports.append(torch.stack(state))
        mine = torch.stack(exports, dim=1)  # [runs, b, ...]
        every = None if gather is None else gather.gather(mine)  # [world, runs, b, ...]
        if memory is not None:
            memory["state"] = _last(scan, mine[None] if every is None else every, plan)
        starts = {} if every is None else _compose(scan, every, plan)
        result = []
        for r, (segments, done) in enumerate(rows):
            pieces = []
            for s, (out, _, ins) in zip(segments, done):
                n = s.end - s.start
                x = starts[plan.index[s.run]][r][None] if s.continues else None
                pieces.append(scan.output(out[None, :n], [t[None, :n] for t in ins], x)[0])
            result.append(by_run(segments, pieces, plan, dim=0))  # [runs, n, ...]
        y = plan.join(torch.stack(result, dim=1).to(dtype), dim=1)
    return y if every is None else Uses.apply(y, every)
