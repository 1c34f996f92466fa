"""Recurrent sequence mixers (Gated DeltaNet: Qwen3-Next, Qwen3.5; Mamba2: Granite 4.0-H, Bamba, Nemotron-H,
Falcon-H1; Mamba: Mamba, Falcon-Mamba, Jamba) over a sequence sharded across a CP group, exactly.

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

Mamba2 (``mamba2_scan``) is the same with a scalar decay per head: a chunk's transition is one number per head,
so the kernel runs as it is (from a zero state, returning its final state) and the correction needs only the
cumulative decays and ``C_t``. Mamba (``mamba_scan``) decays each state entry on its own (``exp(dt A)`` with ``A``
per channel and state entry): its carry is the zero-state final state and the chunk's summed step sizes per
channel. The recurrences run through one driver (``_scan``), each described by a small class (``_DeltaRule``,
``_Mamba2``, ``_Mamba``): its kernel call, its carry ``[F | P]``, how a carry composes and how a
starting state corrects the outputs.

Packed documents (``documents=``): each rank cuts its chunks where the document changes; the state and the
convolution start afresh at each document, as if each ran alone (``_scan``).

Limits: the striped layout has no chunks (every token's predecessor lives on another rank) and is refused; chunks
must hold at least K - 1 tokens.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable

import torch

from .chunks import Chunks, Uses, by_run, causal_conv1d, chunks, groups, padded, row
from .comm import StateGather

__all__ = ["Chunks", "chunks", "causal_conv1d", "diagonal_scan", "gated_delta_rule", "mamba2_scan", "mamba_scan"]


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
    documents: torch.Tensor | None = None,
    memory: dict | None = None,
    step_kernel: Callable | None = None,
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
        documents: None, or [1 or batch, full_seq] document ids of the unsharded sequence (the same on every rank):
            the state starts from zero at each document's first token (see ``_scan``).
        memory: ``hf_ring.ring_generate``'s record of this layer: empty, it gets the state after the whole sequence
            (``"state"``, fp32, the same on every rank); holding it, the tokens are the next ones of the sequence
            (the same on every rank), run from it locally, and the record moves on.
        step_kernel: the model's token-by-token kernel (``torch_recurrent_gated_delta_rule``, same signature), for
            a decode step of one token, as the model's own decoding runs it; None: ``kernel``.
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
    decoding = memory is not None and "state" in memory  # (the prefill's convolution has filled its part)
    if decoding or (documents is None and plan.world_size == 1):  # the kernel as the model calls it
        start = memory["state"] if decoding else None
        run = step_kernel if decoding and step_kernel is not None and query.shape[1] == 1 else kernel
        out, final = run(query, key, value, g=g, beta=beta, initial_state=start,
                         output_final_state=memory is not None, **kernel_kwargs)  # fmt: skip
        if memory is not None:
            memory["state"] = final.detach().float()
        return out
    # fp32 into the kernel: its zero-state outputs and u_t are corrected before the one rounding to the input dtype
    # (Transformers' fallback kernel computes in fp32 anyway); fp32 states and their composition, also under autocast.
    # flash-linear-attention's kernels take no fp32 (_kernel_inputs): half-precision inputs go to them as they are
    dk, dv = key.shape[-1], value.shape[-1]
    kernel, dtype = _kernel_inputs(kernel, query.dtype)
    inputs = [t.to(dtype) for t in (query, key, _widened(value, dk))] + [
        g.float(),
        beta.float() if dtype == torch.float32 else beta,
    ]
    return _scan(_DeltaRule(kernel, dk, dv, kernel_kwargs), inputs, plan, gather, documents, query.dtype, memory)


def _fla(kernel: Callable) -> bool:
    """The kernel is flash-linear-attention's (fp16 / bf16 only): called directly, or through Transformers' dispatch
    (``use_kernel_func_from_hub_with_fallback``: the implementation it chose, held in its closure; without one to
    read, fla's whenever fla is installed). Cached per kernel."""
    if kernel not in _FLA:
        _FLA[kernel] = _from_fla(kernel)
    return _FLA[kernel]


_FLA: dict = {}


def _from_fla(kernel: Callable) -> bool:
    def fla(f) -> bool:
        return (getattr(f, "__module__", None) or "").split(".")[0] == "fla"

    if fla(kernel):
        return True
    if not hasattr(kernel, "__wrapped__"):
        return False
    f = kernel
    while f is not None:  # (Transformers' dispatch, under the hub's wrapper)
        try:
            chosen = inspect.getclosurevars(f).nonlocals.get("implementation")
        except (TypeError, ValueError):
            chosen = None
        if chosen is not None:
            return fla(chosen)
        f = getattr(f, "__wrapped__", None)
    return importlib.util.find_spec("fla") is not None


def _kernel_inputs(kernel: Callable, dtype: torch.dtype) -> tuple[Callable, torch.dtype]:
    """``(kernel, dtype of its q / k / v)`` on the composed path: fp32 where the kernel takes it; fla's kernel in the
    inputs' half precision (its outputs then rounded once more before the correction, as the unsharded fla run rounds
    them); for fp32 inputs under fla, Transformers' PyTorch kernel beneath its dispatch (the unsharded model's fla
    call would refuse them)."""
    if not _fla(kernel):
        return kernel, torch.float32
    if dtype in (torch.float16, torch.bfloat16):
        return kernel, dtype
    reference = inspect.unwrap(kernel)
    if reference is kernel:
        raise ValueError(
            f"{getattr(kernel, '__name__', kernel)} (flash-linear-attention) takes no float32 inputs; run the model "
            "in bfloat16 or float16"
        )
    return reference, torch.float32


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    kernel: Callable,
    chunk_size: int,
    D: torch.Tensor | None,
    plan: Chunks,
    gather: StateGather | None,
    documents: torch.Tensor | None = None,
    memory: dict | None = None,
    step_kernel: Callable | None = None,
) -> torch.Tensor:
    """Mamba2's selective state-space scan over the whole sequence, on this rank's tokens::

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,        y_t = h_t C_t + D x_t

    with a ``[head_dim, d_state]`` state per head. The decay is a scalar per head and token, so a chunk that
    starts from ``X`` ends in ``a X + F`` (``a``: the product of its decays) and outputs ``y_t(0) + exp(sum of
    dt A up to t) X C_t``: every rank runs its chunks once from a zero state, all-gathers ``(F, a)`` and corrects.

    Args:
        x: [batch, local_seq, heads, head_dim]; dt: [batch, local_seq, heads], the step sizes after the model's
            bias, softplus and limits; A: [heads], negative; B, C: [batch, local_seq, groups, d_state] (``heads`` a
            multiple of ``groups``); D: [heads] or None. Transformers' layout.
        kernel: the model's chunked scan, ``kernel(x, dt, A, B, C, chunk_size, D=, return_final_states=True) ->
            (y, final_state [batch, heads, head_dim, d_state])`` (Transformers' ``mamba2_chunk_scan`` or the
            mamba-ssm kernel it dispatches to), given the processed ``dt`` (no bias, no softplus).
        plan: this rank's runs (``chunks``). gather: the group's ``StateGather`` (None: one rank).
        documents, memory: as for ``gated_delta_rule`` (the state starts from zero at each document's first token;
            ``ring_generate``'s record, states ``[batch, heads, head_dim, d_state]``).
        step_kernel: the model's one-token update (``mamba2_selective_state_update``, or mamba-ssm's
            ``selective_state_update``: the state updated in place), for a decode step of one token, as the
            model's own decoding runs it; None: ``kernel``.

    Returns:
        [batch, local_seq, heads, head_dim] fp32 (the fallback kernel's output dtype; the model's gated norm rounds).
    """
    decoding = memory is not None and "state" in memory  # a decode step: from the state after the tokens before
    if decoding and step_kernel is not None and x.shape[1] == 1:  # (updates the state in place)
        b, _, h, p = x.shape
        s = B.shape[-1]
        y = step_kernel(memory["state"], x[:, 0], dt[:, 0, :, None].expand(b, h, p), A[:, None, None].expand(h, p, s),
                        B[:, 0], C[:, 0], None if D is None else D[:, None].expand(h, p), dt_softplus=False)  # fmt: skip
        return y[:, None].float()
    if decoding or (documents is None and plan.world_size == 1):  # the kernel as the model calls it
        if memory is None:
            return kernel(x, dt, A, B, C, chunk_size, D=D).float()
        start = {"initial_states": memory["state"]} if decoding else {}
        y, final = kernel(x, dt, A, B, C, chunk_size, D=D, return_final_states=True, **start)
        memory["state"] = final.detach().float()
        return y.float()
    inputs = [t.float() for t in (x, dt, B, C)]
    return _scan(_Mamba2(kernel, chunk_size, A.float(), None if D is None else D.float()), inputs, plan, gather,
                 documents, torch.float32, memory)  # fmt: skip


def mamba_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    kernel: Callable,
    D: torch.Tensor | None,
    plan: Chunks,
    gather: StateGather | None,
    documents: torch.Tensor | None = None,
    memory: dict | None = None,
    step_kernel: Callable | None = None,
) -> torch.Tensor:
    """Mamba's (Mamba1's) selective state-space scan over the whole sequence, on this rank's tokens::

        h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t^T,        y_t = h_t C_t + D x_t

    with a ``[channels, d_state]`` state, decayed element by element (``A``: ``[channels, d_state]``). A chunk that
    starts from ``X`` ends in ``exp(A S) * X + F`` (``S``: its step sizes summed per channel) and outputs
    ``y_t(0) + (exp(A s_t) * X) C_t`` (``s_t``: the sum up to ``t``): every rank runs its chunks once from a zero
    state, all-gathers ``(F, S)`` and corrects (over blocks of tokens, ``_DecayedReadout``).

    Args:
        x: [batch, local_seq, channels] (the convolution's output); dt: [batch, local_seq, channels], the step sizes
            after the model's bias and softplus; A: [channels, d_state], negative; B, C: [batch, local_seq, d_state];
            D: [channels] or None. Token-major (Transformers' kernels take channels first; this transposes).
        kernel: the model's scan, ``kernel(x, dt, A, B, C, D=None, z=None) -> y`` with ``x``, ``dt``, ``y``: [batch,
            channels, seq], ``B``, ``C``: [batch, d_state, seq] (Transformers' ``mamba_selective_scan`` or
            mamba-ssm's ``selective_scan_fn`` it dispatches to), given the processed ``dt`` (no bias, no softplus).
        plan, gather, documents, memory: as for ``mamba2_scan`` (states ``[batch, channels, d_state]``).
        step_kernel: the model's one-token update (``mamba_selective_state_update``: the state updated in place),
            for decode steps, token by token as the model's own decoding runs them.

    Returns:
        [batch, local_seq, channels] fp32 (the model gates it and rounds).
    """
    skip = 0.0 if D is None else x.float() * D.float()
    if memory is not None and "state" in memory:  # decode steps: token by token from the state (updated in place)
        ys = [step_kernel(memory["state"], x[:, t].float(), dt[:, t].float(), A.float(), B[:, t].float(),
                          C[:, t].float(), D=None, dt_softplus=False) for t in range(x.shape[1])]  # fmt: skip
        return torch.stack(ys, dim=1).float() + skip
    scan = _Mamba(kernel, A.float())
    inputs = [t.float() for t in (x, dt, B, C)]
    if documents is None and plan.world_size == 1:  # the kernel as the model calls it (fp32, also under autocast)
        with torch.autocast(x.device.type, enabled=False):
            y, carry = scan.run(inputs)
        if memory is not None:
            memory["state"] = scan.kernel_state(carry[..., : A.numel()]).detach()
        return y + skip
    return _scan(scan, inputs, plan, gather, documents, torch.float32, memory) + skip


def diagonal_scan(
    x: torch.Tensor, a: torch.Tensor, *, plan: Chunks, gather: StateGather | None, memory: dict | None = None
) -> torch.Tensor:
    """A diagonal linear recurrence over the whole sequence, on this rank's tokens (RecurrentGemma's RG-LRU)::

        h_t = a_t * h_{t-1} + x_t        (element by element; h_0 = 0 before the sequence)

    A chunk that starts from ``X`` ends in ``P * X + F`` and outputs ``h_t(0) + (a_1 ... a_t) * X`` (``P``: the
    product of its gates): every rank runs its chunks from a zero state (fp32, by doubling: ``_Recurrence``, where
    the model loops over tokens), all-gathers ``(F, P)`` and corrects. A gate of 0 (the model's reset at a document's first token) stops what
    came before, so packed documents need no cut here.

    Args:
        x, a: [batch, local_seq, channels]; plan, gather: as for ``mamba2_scan``.
        memory: ``hf_ring.ring_generate``'s record of this layer: empty, it gets the state after the whole sequence
            (``"state"``, the same on every rank); holding it, ``x`` and ``a`` are the next tokens (the same on every
            rank), run from it token by token, and the record moves on.

    Returns:
        [batch, local_seq, channels] fp32.
    """
    scan, inputs = _Diagonal(), [x.float(), a.float()]
    if memory is not None and "state" in memory:  # decode steps: from the state, no exchange
        h, out = memory["state"], []
        for t in range(x.shape[1]):
            h = inputs[1][:, t] * h + inputs[0][:, t]
            out.append(h)
        memory["state"] = h.detach()
        return torch.stack(out, dim=1)
    if plan.world_size == 1:
        with torch.autocast(x.device.type, enabled=False):
            out = _Recurrence.apply(inputs[1], inputs[0])
        if memory is not None:
            memory["state"] = out[:, -1].detach()
        return out
    return _scan(scan, inputs, plan, gather, None, torch.float32, memory)


class _Diagonal:
    """``diagonal_scan`` as ``_scan`` drives it: inputs ``(x, a)``; the carry of a piece is ``[F | P]`` (``[2 *
    channels]``: the zero-state final state beside the product of the gates)."""

    def run(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        x, a = inputs
        h = _Recurrence.apply(a, x)
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


class _Recurrence(torch.autograd.Function):
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


class _DeltaRule:
    """The gated delta rule as ``_scan`` drives it: inputs ``(q, k, v widened, g, beta)``; the carry of a piece is
    ``[F | P]`` (``[heads, d_k, d_v + d_k]``: the zero-state final state beside the product of the transitions,
    what the identity's columns of the starting state ``[0 | I]`` end as)."""

    def __init__(self, kernel: Callable, dk: int, dv: int, kwargs: dict):
        self.kernel, self.dk, self.dv, self.kwargs = kernel, dk, dv, kwargs

    def run(self, inputs: list) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta = inputs
        start = _identity_start(q.shape[0], v.shape[2], self.dk, self.dv, q.device)
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


class _Mamba2:
    """Mamba2's scan as ``_scan`` drives it: inputs ``(x, dt, B, C)``; the carry of a piece is ``[F | a]``
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


class _Mamba:
    """Mamba's (Mamba1's) scan as ``_scan`` drives it: inputs ``(x, dt, B, C)``; the carry of a piece is ``[F | S |
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
        return out + _DecayedReadout.apply(C, torch.cumsum(dt, dim=1), self.A, self.kernel_state(state))


READOUT_BLOCK = 1 << 24
"""How many ``[tokens, channels, d_state]`` fp32 values ``_DecayedReadout`` makes at a time (64 MiB: 128 tokens of
a row at 8192 channels x 16 states)."""


class _DecayedReadout(torch.autograd.Function):
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


def _widened(value: torch.Tensor, dk: int) -> torch.Tensor:
    """The values in fp32 with ``dk`` zero columns after their own: the identity's columns of the starting state
    (``_identity_start``) then carry P_t."""
    return torch.cat([value.float(), value.new_zeros(*value.shape[:-1], dk, dtype=torch.float32)], dim=-1)


def _identity_start(n: int, heads: int, dk: int, dv: int, device) -> torch.Tensor:
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


def _scan(scan, inputs: list, plan: Chunks, gather, documents, dtype, memory: dict | None = None) -> torch.Tensor:
    """A recurrence affine in its starting state (``scan``: ``_DeltaRule``, ``_Mamba2``, ``_Mamba``) over the CP group, on this
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
