"""What each sequence mixer computes on its rank's shard (``patches.linear``'s ``ShardedLinear`` runs one of these).

Each function is a Transformers module's forward without a cache, with the module's own projections, norms and
kernels, and its look-back along the sequence (convolution inputs, recurrent states) from the ranks before it
through ``hf_ring.linear_attention``. ``computation(module)`` picks the function, ``kernels(module)`` the
Transformers module whose kernels its forward calls.
"""

from __future__ import annotations

import importlib
import math
import sys

import torch
import torch.nn.functional as F

from ..linear_attention import causal_conv1d, gated_delta_rule, mamba2_scan, mamba_scan

__all__ = ["computation", "kernels", "masked", "output"]


def _project(m, hidden_states):
    """``(mixed_qkv [b, n, 2 key_dim + value_dim], z [b, n, v_heads, d_v], b, a [b, n, v_heads])``: Qwen3.5's
    separate projections, Qwen3-Next's fused, head-interleaved ones, or OLMo Hybrid's (q / k / v, its gate g)."""
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hidden_states), m.in_proj_ba(hidden_states))
        mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v)], dim=-1)
        return mixed, z, b, a
    batch, n, _ = hidden_states.shape
    if hasattr(m, "g_proj"):  # OLMo Hybrid
        mixed = torch.cat([m.q_proj(hidden_states), m.k_proj(hidden_states), m.v_proj(hidden_states)], dim=-1)
        z = m.g_proj(hidden_states).reshape(batch, n, -1, m.head_v_dim)
        return mixed, z, m.b_proj(hidden_states), m.a_proj(hidden_states)
    z = m.in_proj_z(hidden_states).reshape(batch, n, -1, m.head_v_dim)
    return m.in_proj_qkv(hidden_states), z, m.in_proj_b(hidden_states), m.in_proj_a(hidden_states)


def output(m) -> torch.nn.Module:
    """The module's output projection (OLMo Hybrid's ``o_proj``, Qwen4-Exp's per-layer embedding's ``value_proj``,
    RecurrentGemma's ``linear_out``, the others' ``out_proj``; Inkling's short convolutions: their ``conv1d``)."""
    if hasattr(m, "static_weight"):  # (Inkling 2's dynamic convolution: its tap projection)
        return m.weight_proj
    for name in ("o_proj", "value_proj", "linear_out", "conv1d" if hasattr(m, "conv_idx") else "out_proj"):
        if hasattr(m, name):
            return getattr(m, name)
    return m.out_proj if hasattr(m, "out_proj") else m.q_proj  # (ZAYA's CCA projection has no output projection)


def kernels(module):
    """The Transformers module defining ``module``'s class, whose ``causal_conv1d_fn`` (and recurrence kernel:
    ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``) its forward calls: looked up along the class's bases, since FSDP2's
    ``fully_shard`` gives a sharded module a class of its own, defined elsewhere."""
    if hasattr(module, "slope_rate"):  # MiniMax's lightning attention: Mamba2's scan (``_lightning``)
        return importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    for cls in type(module).__mro__:
        found = sys.modules.get(cls.__module__)
        if found is not None and hasattr(found, "causal_conv1d_fn"):
            return found
    raise ValueError(f"{type(module).__name__}: found no causal_conv1d_fn beside its class (not a Transformers module)")


def masked(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``x`` [batch, local_seq, ...] zeroed at padding (Transformers' ``apply_mask_to_padding_states``)."""
    return x if keep is None else (x * keep[:, :, None]).to(x.dtype)


def computation(module):
    """What ``module`` computes, sharded: MiniMax's lightning attention, a Mamba mixer (Zamba's: a scan per head), a
    Mamba2 mixer, Kimi Delta Attention, an LFM2 short convolution or a Gated DeltaNet."""
    if hasattr(module, "slope_rate"):
        return _lightning
    if hasattr(module, "x_proj") and hasattr(module, "dt_proj"):
        return _mamba
    if hasattr(module, "x_proj_weight") and hasattr(module, "dt_proj_weight"):
        return _mamba_heads
    if hasattr(module, "D") and hasattr(module, "A_log"):
        return _mamba2
    if hasattr(module, "forget_gate"):
        return _kimi_delta
    if hasattr(module, "conv_idx"):
        return _residual_conv
    return _short_conv if hasattr(module, "in_proj") else _gated_delta_net


def _short_conv(m, kernels, hidden_states, plan, gather, documents, keep, memory):
    """Transformers' LFM2 short convolution without a cache (gated by its projections), over the CP group."""
    b, c, x = m.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
    weight = m.conv.weight.squeeze(1)

    def conv(t):
        return kernels.causal_conv1d_fn(t, weight, m.conv.bias)

    y = causal_conv1d(b * x, conv, m.conv_kernel_size, plan, gather, documents, memory)
    return m.out_proj((c * y).transpose(-1, -2).contiguous())


RESIDUAL_CONVOLUTIONS = {  # class name -> what the output (convolution + input) is divided by, of the kernel size K
    "InklingShortConvolution": lambda k: 1.0,
    "Inkling2ShortConvolution": lambda k: math.sqrt(k + 1),
    "Inkling2DynamicShortConvolution": lambda k: math.sqrt(2 * k + 1),  # (and taps per token)
    "Inkling2LoopShortConvolution": lambda k: math.sqrt(k + 1),
    "Inkling2LoopDynamicShortConvolution": lambda k: math.sqrt(2 * k + 1),
}
"""Inkling's, Inkling 2's and Inkling 2 Loop's short convolutions, each added to its input (``_residual_conv``)."""


def _residual_divisor(m) -> float:
    for cls in type(m).__mro__:  # (along the bases: FSDP2 gives a sharded module a class of its own)
        if cls.__name__ in RESIDUAL_CONVOLUTIONS:
            return RESIDUAL_CONVOLUTIONS[cls.__name__](m.conv_kernel_size)
    raise ValueError(f"{type(m).__name__} is not a short convolution hf_ring knows")


def _shifts(k: int):
    """A "convolution" for ``causal_conv1d`` that returns each token's window of the k inputs ending at it, lag by
    lag: [batch, channels, n] -> [batch, channels * k, n], entry ``c * k + lag`` the input of channel c lag tokens
    back (zeros before the start)."""

    def stack(t):
        windows = F.pad(t, (k - 1, 0)).unfold(-1, k, 1).flip(-1)  # [batch, channels, n, k]
        return windows.transpose(-1, -2).reshape(t.shape[0], -1, t.shape[-1])

    return stack


def _residual_conv(m, kernels, hidden_states, plan, gather, documents, keep, memory, dynamic_input=None):
    """Transformers' Inkling / Inkling 2 short convolution without a cache: in fp32, its input zeroed at padding,
    convolved over the CP group, added to its input (and divided as the module divides). Inkling 2's dynamic one
    (keys and values of its full layers) weights each token's window by taps of its own (static ones plus ones
    projected from ``dynamic_input``, per key/value head), as its forward does."""
    x = hidden_states.float()
    k = m.conv_kernel_size
    context = masked(x, keep).transpose(1, 2)
    if hasattr(m, "static_weight"):  # Inkling 2's dynamic convolution
        b, n, c = x.shape
        windows = causal_conv1d(context, _shifts(k), k, plan, gather, documents, memory)  # [b, c * k, n]
        windows = windows.view(b, c, k, n).permute(0, 3, 1, 2).reshape(b, n, m.num_heads, -1, k)
        taps = m.weight_proj(dynamic_input).float().view(b, n, m.num_heads, 1, k)
        taps = m.static_weight.float().T.view(m.num_heads, -1, k) + taps
        y = (windows * taps).sum(-1).reshape(b, n, c)
    else:
        weight = m.conv1d.weight.squeeze(1)

        def conv(t):
            return kernels.causal_conv1d_fn(t, weight, m.conv1d.bias)

        y = causal_conv1d(context, conv, k, plan, gather, documents, memory).transpose(1, 2)
    return ((y + x) / _residual_divisor(m)).to(hidden_states.dtype)


def _gated_delta_net(m, kernels, hidden_states, plan, gather, documents, keep, memory):
    """Transformers' Gated DeltaNet forward without a cache, its convolution and recurrence over the CP group."""
    batch, n, _ = hidden_states.shape
    mixed, z, b, a = _project(m, hidden_states)
    weight = m.conv1d.weight.squeeze(1)

    def conv(x):
        return kernels.causal_conv1d_fn(x, weight, m.conv1d.bias, activation=m.activation)

    mixed = causal_conv1d(mixed.transpose(1, 2), conv, m.conv_kernel_size, plan, gather, documents, memory)
    mixed = mixed.transpose(1, 2)
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(batch, n, -1, m.head_k_dim)
    k = k.reshape(batch, n, -1, m.head_k_dim)
    v = v.reshape(batch, n, -1, m.head_v_dim)
    beta = b.sigmoid()
    if getattr(m, "allow_neg_eigval", False):  # OLMo Hybrid: beta in [0, 2]
        beta = beta * 2.0
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    core = gated_delta_rule(
        q, k, v, g, beta, kernel=kernels.torch_chunk_gated_delta_rule, plan=plan, gather=gather, documents=documents,
        memory=memory, step_kernel=getattr(kernels, "torch_recurrent_gated_delta_rule", None),
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    norm = m.o_norm if hasattr(m, "o_norm") else m.norm
    core = norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(batch, n, -1)
    return output(m)(core)


def _kimi_delta(m, kernels, hidden_states, plan, gather, documents, keep, memory):
    """Transformers' Kimi Delta Attention (Kimi Linear; Bailing's linear attention, whose output gate is one
    projection) without a cache: the gated delta rule with a decay per key channel (its transitions are as affine in
    the state; the same widened values carry them)."""
    batch, n, _ = hidden_states.shape
    heads = (batch, n, -1, m.head_dim)
    mixed = torch.cat([m.q_proj(hidden_states), m.k_proj(hidden_states), m.v_proj(hidden_states)], dim=-1)
    weight = m.conv1d.weight.squeeze(1)

    def conv(x):
        return kernels.causal_conv1d_fn(x, weight, m.conv1d.bias, activation=m.activation)

    mixed = causal_conv1d(mixed.transpose(1, 2), conv, m.conv_kernel_size, plan, gather, documents, memory)
    mixed = mixed.transpose(1, 2)
    q, k, v = (t.reshape(heads) for t in torch.split(mixed, [m.qkv_dim] * 3, dim=-1))
    core = gated_delta_rule(
        q, k, v, m.forget_gate(hidden_states), m.b_proj(hidden_states).sigmoid(),
        kernel=kernels.chunk_kimi_delta_attention, plan=plan, gather=gather, documents=documents, memory=memory,
        step_kernel=getattr(kernels, "recurrent_kimi_delta_attention", None), use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    gate = (m.g_proj(hidden_states) if hasattr(m, "g_proj") else m.g_b_proj(m.g_a_proj(hidden_states))).reshape(heads)
    return m.o_proj(m.o_norm(core, gate).reshape(batch, n, -1))


def _mamba2(m, kernels, hidden_states, plan, gather, documents, keep, memory):
    """Transformers' Mamba2 mixer without a cache (Bamba, GraniteMoeHybrid, NemotronH, FalconH1): its convolution
    and scan over the CP group (the unfused path; FalconH1's multipliers and optional norm). The step sizes are
    computed in fp32, as the fused kernels do (Transformers' PyTorch fallback rounds them to the model's dtype)."""
    batch, n, _ = hidden_states.shape
    dtype = hidden_states.dtype
    falcon = hasattr(m, "mup_vector")
    if falcon:
        hidden_states = hidden_states * m.ssm_in_multiplier
    projected = m.in_proj(hidden_states)
    if falcon:
        projected = projected * m.mup_vector
    gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    weight = m.conv1d.weight.squeeze(1)

    def conv(x):
        return kernels.causal_conv1d_fn(x, weight, m.conv1d.bias, activation=m.activation)

    xbc = causal_conv1d(xbc.transpose(1, 2), conv, m.conv_kernel_size, plan, gather, documents, memory)
    xbc = xbc.transpose(1, 2)
    x, B, C = torch.split(masked(xbc, keep), [m.intermediate_size, *(2 * [m.n_groups * m.ssm_state_size])], dim=-1)
    # the step sizes as the kernels make them (bias, softplus, limits)
    dt = F.softplus(dt.float() + m.dt_bias.float())
    decoding = memory is not None and "state" in memory
    if m.time_step_limit is not None and not decoding:  # (Transformers' decode step does not clamp)
        dt = dt.clamp(*m.time_step_limit)
    y = mamba2_scan(
        x.reshape(batch, n, -1, m.head_dim), dt, -m.A_log.float().exp(), B.reshape(batch, n, m.n_groups, -1),
        C.reshape(batch, n, m.n_groups, -1), kernel=kernels.mamba2_chunk_scan, chunk_size=m.chunk_size, D=m.D,
        plan=plan, gather=gather, documents=documents, memory=memory,
        step_kernel=getattr(kernels, "mamba2_selective_state_update", None),
    ).reshape(batch, n, -1)  # fmt: skip
    if falcon and not m.mamba_rms_norm:
        y = y * F.silu(gate)
    else:
        y = m.norm(y, gate)
    return m.out_proj(y.to(dtype))


def _mamba(m, kernels, hidden_states, plan, gather, documents, keep, memory):
    """Transformers' Mamba mixer without a cache (Mamba, Falcon-Mamba, Jamba): its convolution and scan over the CP
    group (the unfused path; Falcon-Mamba's and Jamba's norms of the step sizes, B and C)."""
    dtype = hidden_states.dtype
    x, gate = m.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)
    weight = m.conv1d.weight.squeeze(1)

    def conv(t):
        return kernels.causal_conv1d_fn(t, weight, m.conv1d.bias, activation=m.activation)

    x = masked(causal_conv1d(x, conv, m.conv_kernel_size, plan, gather, documents, memory).transpose(1, 2), keep)
    step, B, C = torch.split(m.x_proj(x), [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
    if hasattr(m, "b_layernorm"):
        step, B, C = m.dt_layernorm(step), m.b_layernorm(B), m.c_layernorm(C)
    if hasattr(m, "dt_layernorm") and hasattr(m.config, "_is_quantized"):  # (as their mixers do for a quantized one)
        dt = m.dt_proj(step) - m.dt_proj.bias
    else:
        dt = (m.dt_proj.weight @ step.transpose(1, 2)).transpose(1, 2)  # (its weight alone, as the mixer takes it)
    dt = F.softplus(dt.float() + (0.0 if m.dt_proj.bias is None else m.dt_proj.bias.float()))
    y = mamba_scan(
        x, dt, -m.A_log.float().exp(), B, C, kernel=kernels.mamba_selective_scan, D=m.D, plan=plan, gather=gather,
        documents=documents, memory=memory, step_kernel=getattr(kernels, "mamba_selective_state_update", None),
    )  # fmt: skip
    return m.out_proj((y * F.silu(gate.transpose(1, 2))).to(dtype))


def _mamba_heads(m, kernels, hidden_states, plan, gather, documents, keep, memory):
    """Transformers' Zamba Mamba mixer without a cache: one convolution over the CP group, then a Mamba scan per head,
    each with its own ``x_proj`` / ``dt_proj`` weights (its ``n_mamba_heads`` split of the channels), over the group.
    The step sizes and the scan in fp32, as mamba-ssm's kernel computes them; each head's state in its own record
    (``memory["heads"][h]``), the convolution's inputs in the layer's."""
    dtype = hidden_states.dtype
    batch, n, _ = hidden_states.shape
    x, gate = m.in_proj(hidden_states).transpose(1, 2).view(batch, -1, 2, n).chunk(2, dim=2)
    weight = m.conv1d.weight.squeeze(1)

    def conv(t):
        return kernels.causal_conv1d_fn(t, weight, m.conv1d.bias, activation=m.activation)

    x = masked(
        causal_conv1d(x.squeeze(2), conv, m.conv_kernel_size, plan, gather, documents, memory).transpose(1, 2), keep
    )
    heads = []
    for h, (x_h, gate_h) in enumerate(
        zip(x.split(m.mamba_head_dim, dim=-1), gate.squeeze(2).split(m.mamba_head_dim, dim=1))
    ):
        step, B, C = torch.split(
            x_h @ m.x_proj_weight[h].transpose(0, 1), [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1
        )
        dt = step @ m.dt_proj_weight[h].transpose(0, 1)
        dt = F.softplus(dt.float() + (0.0 if m.dt_proj_bias is None else m.dt_proj_bias[h].float()))
        head_memory = None if memory is None else memory.setdefault("heads", {}).setdefault(h, {})
        y = mamba_scan(
            x_h, dt, -m.A_log[h].float().exp(), B, C, kernel=kernels.mamba_selective_scan, D=m.D[h], plan=plan,
            gather=gather, documents=documents, memory=head_memory,
            step_kernel=getattr(kernels, "mamba_selective_state_update", None),
        )  # fmt: skip
        heads.append(y * F.silu(gate_h.transpose(1, 2)))
    return m.out_proj(torch.cat(heads, dim=-1).to(dtype))


def _lightning(m, kernels, hidden_states, plan, gather, documents, keep, memory):
    """Transformers' MiniMax lightning attention without a cache: linear attention whose state decays by a fixed
    factor per head and token, ``S_t = exp(-slope) S_{t-1} + v_t k_t^T``, ``o_t = S_t q_t``, which is Mamba2's scan
    with unit step sizes, ``A = -slope``, the values for ``x``, the keys for ``B`` and the queries for ``C`` (a group
    per head): Transformers' ``mamba2_chunk_scan`` (or the mamba-ssm kernel it dispatches to) in chunks of the
    module's block size, over the CP group. Returns ``(output, None)``, as the module."""
    batch, n, _ = hidden_states.shape
    heads = m.num_attention_heads
    qkv = masked(m.act_fn(m.qkv_proj(hidden_states)), keep).reshape(batch, n, heads, 3 * m.head_dim)
    q, k, v = torch.split(qkv, m.head_dim, dim=3)
    steps = torch.ones(batch, n, heads, dtype=torch.float32, device=qkv.device)
    out = mamba2_scan(
        v, steps, -m.slope_rate.float().reshape(heads), k, q, kernel=kernels.mamba2_chunk_scan,
        chunk_size=m.block_size, D=None, plan=plan, gather=gather, documents=documents, memory=memory,
        step_kernel=getattr(kernels, "mamba2_selective_state_update", None),
    )  # fmt: skip
    out = m.norm(out.reshape(batch, n, -1).to(hidden_states.dtype))  # (the module's output is in its dtype)
    return m.out_proj(torch.sigmoid(m.output_gate(hidden_states)) * out), None
