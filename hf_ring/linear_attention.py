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
channel. The recurrences run through one driver (``drive``), each described by a small class (``DeltaRule``,
``Mamba2``, ``Mamba``): its kernel call, its carry ``[F | P]``, how a carry composes and how a
starting state corrects the outputs.

Packed documents (``documents=``): each rank cuts its chunks where the document changes; the state and the
convolution start afresh at each document, as if each ran alone (``drive``).

Limits: the striped layout has no chunks (every token's predecessor lives on another rank) and is refused; chunks
must hold at least K - 1 tokens.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable

import torch

from ._scans import DeltaRule, Diagonal, Mamba, Mamba2, Recurrence, drive, widened
from .chunks import Chunks, causal_conv1d, chunks
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
            the state starts from zero at each document's first token (see ``drive``).
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
    inputs = [t.to(dtype) for t in (query, key, widened(value, dk))] + [
        g.float(),
        beta.float() if dtype == torch.float32 else beta,
    ]
    return drive(DeltaRule(kernel, dk, dv, kernel_kwargs), inputs, plan, gather, documents, query.dtype, memory)


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
    return drive(Mamba2(kernel, chunk_size, A.float(), None if D is None else D.float()), inputs, plan, gather,
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
    state, all-gathers ``(F, S)`` and corrects (over blocks of tokens, ``DecayedReadout``).

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
    scan = Mamba(kernel, A.float())
    inputs = [t.float() for t in (x, dt, B, C)]
    if documents is None and plan.world_size == 1:  # the kernel as the model calls it (fp32, also under autocast)
        with torch.autocast(x.device.type, enabled=False):
            y, carry = scan.run(inputs)
        if memory is not None:
            memory["state"] = scan.kernel_state(carry[..., : A.numel()]).detach()
        return y + skip
    return drive(scan, inputs, plan, gather, documents, torch.float32, memory) + skip


def diagonal_scan(
    x: torch.Tensor, a: torch.Tensor, *, plan: Chunks, gather: StateGather | None, memory: dict | None = None
) -> torch.Tensor:
    """A diagonal linear recurrence over the whole sequence, on this rank's tokens (RecurrentGemma's RG-LRU)::

        h_t = a_t * h_{t-1} + x_t        (element by element; h_0 = 0 before the sequence)

    A chunk that starts from ``X`` ends in ``P * X + F`` and outputs ``h_t(0) + (a_1 ... a_t) * X`` (``P``: the
    product of its gates): every rank runs its chunks from a zero state (fp32, by doubling: ``Recurrence``, where
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
    scan, inputs = Diagonal(), [x.float(), a.float()]
    if memory is not None and "state" in memory:  # decode steps: from the state, no exchange
        h, out = memory["state"], []
        for t in range(x.shape[1]):
            h = inputs[1][:, t] * h + inputs[0][:, t]
            out.append(h)
        memory["state"] = h.detach()
        return torch.stack(out, dim=1)
    if plan.world_size == 1:
        with torch.autocast(x.device.type, enabled=False):
            out = Recurrence.apply(inputs[1], inputs[0])
        if memory is not None:
            memory["state"] = out[:, -1].detach()
        return out
    return drive(scan, inputs, plan, gather, None, torch.float32, memory)
