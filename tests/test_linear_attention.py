"""Linear-attention layers (Gated DeltaNet, Kimi Delta Attention, Mamba2, Mamba) under context parallelism:
``hf_ring.linear_attention`` against the unsharded computation (real gloo ranks), and the Transformers
integration's refusals, raised on every rank.

The kernels are Transformers' own ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``,
``mamba2_chunk_scan`` and ``mamba_selective_scan`` (fp32 inside), the
convolution Transformers' ``causal_conv1d_fn``; the reference runs them on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring import layout as L
from hf_ring.comm import StateGather
from hf_ring.linear_attention import causal_conv1d, chunks, diagonal_scan, gated_delta_rule, mamba2_scan, mamba_scan
from tests.dist_utils import run_distributed
from tests.hf_models import (
    RTOL_DECAY,
    error_of,
    errors,
    grads,
    make_batch,
    make_model,
    per_document_step,
    rel,
    ring_step,
    transformers_at_least,
)

# the same fp32 arithmetic regrouped (states composed across chunks, outputs corrected): rounding only; measured
# at 2 and 3 ranks up to 1.5e-7 on the outputs and 5e-7 on the gradients (the decays'), packed documents included
TOL = {"out": 1e-6, "grad": 2e-6}
RTOL = 1e-5  # the models' loss and gradients (fp32), as tests/test_hf_parity.py

# (batch, seq, k_heads, v_heads, d_k, d_v, conv kernel): GQA-like heads (v_heads a multiple), odd sizes
SHAPES = [(2, 36, 2, 4, 16, 12, 4), (2, 60, 1, 1, 8, 20, 3)]


def _kernel():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule

    return causal_conv1d_fn, torch_chunk_gated_delta_rule


def _inputs(shape):
    b, n, hk, hv, dk, dv, kernel = shape
    g = torch.Generator().manual_seed(sum(shape))
    channels = 2 * hk * dk + hv * dv
    x = torch.randn(b, channels, n, generator=g)
    weight = torch.randn(channels, kernel, generator=g) / kernel
    decay = -torch.rand(b, n, hv, generator=g)  # log decays <= 0
    beta = torch.rand(b, n, hv, generator=g)
    upstream = torch.randn(b, n, hv, dv, generator=g)  # the output's gradient
    return x, weight, decay, beta, upstream


def _layer(x, weight, decay, beta, shape, plan, gather, documents=None, kernel=None):
    """Convolution then the gated delta rule, as the Gated DeltaNet runs them (``[batch, seq, v_heads, d_v]``;
    ``kernel``: another rule's, Kimi Delta Attention's)."""
    conv_fn, gdn = _kernel()
    kernel = kernel or gdn
    b, _, hk, hv, dk, dv, k_size = shape
    b = x.shape[0]
    y = causal_conv1d(x, lambda t: conv_fn(t, weight, None, activation="silu"), k_size, plan, gather, documents)
    y = y.transpose(1, 2)
    n = y.shape[1]
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(b, n, hk, dk), k.reshape(b, n, hk, dk), v.reshape(b, n, hv, dv)
    return gated_delta_rule(
        q, k, v, decay, beta, kernel=kernel, plan=plan, gather=gather, documents=documents,
        use_qk_l2norm_in_kernel=True, chunk_size=8,
    )  # fmt: skip


# packed documents per shape: boundaries inside chunks and on them, a document shorter than the convolution, one
# starting a token before a chunk (at 2 ranks: only part of the halo is its own), padding (-1) between documents;
# rows of their own, or one row for the whole batch
DOCUMENTS = {
    36: torch.tensor([[0] * 7 + [1] * 2 + [2] * 17 + [3] * 10, [0] * 18 + [1] * 18]),
    60: torch.tensor([[0] * 25 + [-1] * 5 + [1] * 30]),
}


def _per_document(layer, leaves, shape, documents):
    """``layer`` of each document alone (the reference for packed documents), in place in the whole sequence
    (``leaves``: the convolution's input first, then its weight, then per-token tensors and parameters)."""
    x = leaves[0]
    rows = []
    for r in range(x.shape[0]):
        ids = documents[0 if documents.shape[0] == 1 else r]
        parts = {}
        for d in ids.unique().tolist():
            at = (ids == d).nonzero().flatten()
            one = chunks(len(at), rank=0, world_size=1, layout="zigzag")
            mine = [t[r : r + 1][:, :, at] if i == 0 else t[r : r + 1, at] if t.dim() >= 3 else t
                    for i, t in enumerate(leaves)]  # fmt: skip
            parts[d] = (at, layer(*mine, shape, one, None)[0])
        order = torch.cat([at for at, _ in parts.values()]).argsort()
        rows.append(torch.cat([y for _, y in parts.values()])[order])
    return torch.stack(rows)


# Mamba2 (batch, seq, heads, head_dim, groups, d_state, conv kernel): heads sharing B and C in groups, odd sizes
MAMBA_SHAPES = [(2, 36, 4, 6, 2, 8, 4), (2, 60, 3, 4, 1, 5, 3)]


def _mamba_inputs(shape):
    b, n, h, p, groups, d_state, kernel = shape
    g = torch.Generator().manual_seed(sum(shape) + 1)
    channels = h * p + 2 * groups * d_state
    x = torch.randn(b, channels, n, generator=g)
    weight = torch.randn(channels, kernel, generator=g) / kernel
    dt = torch.randn(b, n, h, generator=g)  # before the softplus
    A = -0.5 - torch.rand(h, generator=g)
    D = torch.randn(h, generator=g)
    upstream = torch.randn(b, n, h, p, generator=g)
    return x, weight, dt, A, D, upstream


def _mamba_layer(x, weight, dt, A, D, shape, plan, gather, documents=None):
    """Convolution then Mamba2's scan, as Bamba's mixer runs them (``[batch, seq, heads, head_dim]``); the kernel's
    chunk (32) is longer than the ranks' chunks and most documents, which then run in chunks of 16 or 32."""
    from transformers.models.bamba.modeling_bamba import causal_conv1d_fn, mamba2_chunk_scan

    b, _, h, p, groups, d_state, k_size = shape
    b = x.shape[0]
    y = causal_conv1d(x, lambda t: causal_conv1d_fn(t, weight, None, activation="silu"), k_size, plan, gather,
                      documents).transpose(1, 2)  # fmt: skip
    n = y.shape[1]
    xs, B, C = torch.split(y, [h * p, groups * d_state, groups * d_state], dim=-1)
    return mamba2_scan(
        xs.reshape(b, n, h, p), torch.nn.functional.softplus(dt), A, B.reshape(b, n, groups, d_state),
        C.reshape(b, n, groups, d_state), kernel=mamba2_chunk_scan, chunk_size=32, D=D, plan=plan, gather=gather,
        documents=documents,
    )  # fmt: skip


# Mamba (batch, seq, channels, d_state, conv kernel): a decay per channel and state entry
MAMBA1_SHAPES = [(2, 36, 6, 5, 4), (1, 60, 4, 3, 3)]


def _mamba1_inputs(shape):
    b, n, d, s, kernel = shape
    g = torch.Generator().manual_seed(sum(shape) + 2)
    x = torch.randn(b, d, n, generator=g)
    weight = torch.randn(d, kernel, generator=g) / kernel
    dt = torch.randn(b, n, d, generator=g)  # before the softplus
    B, C = torch.randn(b, n, s, generator=g), torch.randn(b, n, s, generator=g)
    A = -0.5 - torch.rand(d, s, generator=g)
    D = torch.randn(d, generator=g)
    upstream = torch.randn(b, n, d, generator=g)
    return x, weight, dt, B, C, A, D, upstream


def _mamba1_layer(x, weight, dt, B, C, A, D, shape, plan, gather, documents=None):
    """Convolution then Mamba's scan, as Mamba's mixer runs them (``[batch, seq, channels]``), with Transformers'
    PyTorch scan made to return its last state without a gradient, as mamba-ssm's does on a GPU (a guard: the
    sharded scan reads the final state from the outputs, and asks for none)."""
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn, mamba_selective_scan

    def kernel(*args, **kwargs):
        out = mamba_selective_scan(*args, **kwargs)
        return (out[0], out[1].detach()) if kwargs.get("return_last_state") else out

    k_size = shape[-1]
    y = causal_conv1d(x, lambda t: causal_conv1d_fn(t, weight, None, activation="silu"), k_size, plan, gather,
                      documents).transpose(1, 2)  # fmt: skip
    return mamba_scan(y, torch.nn.functional.softplus(dt), A, B, C, kernel=kernel, D=D, plan=plan, gather=gather,
                      documents=documents)  # fmt: skip


# Kimi Delta Attention (same shape tuple as SHAPES, as many key as value heads): a decay per key channel
KDA_SHAPES = [(2, 36, 2, 2, 8, 12, 4)]


def _kda_inputs(shape):
    x, weight, _, beta, upstream = _inputs(shape)
    b, n, _, h, dk, _, _ = shape
    decay = -torch.rand(b, n, h, dk, generator=torch.Generator().manual_seed(5))
    return x, weight, decay, beta, upstream


def _kda_layer(x, weight, decay, beta, shape, plan, gather, documents=None):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return _layer(x, weight, decay, beta, shape, plan, gather, documents, kernel=chunk_kimi_delta_attention)


DIAGONAL_SHAPES = [(2, 36, 6, 4), (1, 60, 5, 3)]  # (batch, seq, channels, conv kernel)


def _diagonal_inputs(shape):
    b, n, d, kernel = shape
    g = torch.Generator().manual_seed(sum(shape) + 3)
    x = torch.randn(b, d, n, generator=g)
    weight = torch.randn(d, kernel, generator=g) / kernel
    gate = torch.randn(b, n, d, generator=g) + 2.0  # (its sigmoid: the decays, most near 1, so states carry far)
    upstream = torch.randn(b, n, d, generator=g)
    return x, weight, gate, upstream


def _diagonal_layer(x, weight, gate, shape, plan, gather, documents=None):
    """Convolution then RecurrentGemma's recurrence (``diagonal_scan``), the gates zeroed at each document's first
    token as the model's reset zeroes them (so a document starts afresh)."""
    y = causal_conv1d(x, lambda t: torch.nn.functional.conv1d(t, weight[:, None], padding=shape[-1] - 1,
                                                              groups=t.shape[1])[..., : t.shape[-1]],
                      shape[-1], plan, gather, documents).transpose(1, 2)  # fmt: skip
    a = torch.sigmoid(gate)
    if documents is not None:
        at = torch.tensor([i * plan.length + o for i in plan.index for o in range(plan.length)])
        starts = documents[:, at] != documents[:, (at - 1).clamp_min(0)]
        a = a * ~starts[:, :, None]
    return diagonal_scan(y, a, plan=plan, gather=gather)


def test_the_diagonal_recurrence_by_doubling_is_the_loop_over_tokens():
    """``diagonal_scan``'s scan (``Recurrence``: doubling steps, its own backward) against the loop over tokens the
    model runs, float64, lengths around powers of two, a zero gate (a reset) inside; and torch's gradcheck."""
    from hf_ring._scans import Recurrence

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 7, 8, 9, 33):
        a = torch.rand(2, n, 5, generator=g, dtype=torch.float64)
        a[0, n // 2] = 0.0
        x = torch.randn(2, n, 5, generator=g, dtype=torch.float64)
        a.requires_grad_(True)
        x.requires_grad_(True)
        h, states = torch.zeros(2, 5, dtype=torch.float64), []
        for t in range(n):
            h = a[:, t] * h + x[:, t]
            states.append(h)
        ref = torch.stack(states, dim=1)
        got = Recurrence.apply(a, x)
        upstream = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        want = torch.autograd.grad((ref * upstream).sum(), (a, x))
        mine = torch.autograd.grad((got * upstream).sum(), (a, x))
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12), n
        assert all(torch.allclose(m, w, rtol=1e-12, atol=1e-12) for m, w in zip(mine, want)), n
        assert torch.autograd.gradcheck(Recurrence.apply, (a, x))


def _leaves(*ts):
    return [t.clone().requires_grad_(True) for t in ts]


# per kind: the layer, its inputs, which leaves are parameters (their gradient summed over the ranks), the bytes
# one chunk sends (its state and its K - 1 convolution inputs, fp32)
KINDS = {
    "gated_delta_net": (_layer, _inputs, (1,), SHAPES,
                        lambda b, n, hk, hv, dk, dv, k: hv * dk * (dv + dk) + (2 * hk * dk + hv * dv) * (k - 1)),
    "kimi_delta": (_kda_layer, _kda_inputs, (1,), KDA_SHAPES,
                   lambda b, n, hk, hv, dk, dv, k: hv * dk * (dv + dk) + (2 * hk * dk + hv * dv) * (k - 1)),
    "mamba2": (_mamba_layer, _mamba_inputs, (1, 3, 4), MAMBA_SHAPES,
               lambda b, n, h, p, g, s, k: h * (p * s + 1) + (h * p + 2 * g * s) * (k - 1)),
    "mamba": (_mamba1_layer, _mamba1_inputs, (1, 5, 6), MAMBA1_SHAPES,
              lambda b, n, d, s, k: d * s + d + 1 + d * (k - 1)),
    "diagonal": (_diagonal_layer, _diagonal_inputs, (1,), DIAGONAL_SHAPES, lambda b, n, d, k: 2 * d + d * (k - 1)),
}  # fmt: skip


def _shard(t, i: int, pos, params: tuple):
    """Leaf ``i``'s part on the rank holding ``pos``: a parameter whole, the convolution's input [b, c, n] and the
    per-token tensors [b, n, ...] at those positions."""
    return t if i in params else t[:, :, pos] if i == 0 else t[:, pos]


def _sharded_worker(rank: int, world: int) -> dict:
    out = {}
    for kind, (layer, make_inputs, params, shapes, chunk_values) in KINDS.items():
        for shape in shapes:
            for layout, packed in (("zigzag", False), ("contiguous", False), ("zigzag", True), ("contiguous", True)):
                *leaves, upstream = make_inputs(shape)
                documents = DOCUMENTS[shape[1]] if packed else None
                ref_leaves = _leaves(*leaves)
                if packed:
                    ref = _per_document(layer, ref_leaves, shape, documents)
                else:
                    ref = layer(*ref_leaves, shape, chunks(shape[1], rank=0, world_size=1, layout=layout), None)
                (ref * upstream).sum().backward()
                pos = L.positions(shape[1], rank=rank, world_size=world, layout=layout)
                mine = _leaves(*(_shard(t, i, pos, params) for i, t in enumerate(leaves)))
                gather = StateGather(None)
                plan = chunks(len(pos), rank=rank, world_size=world, layout=layout)
                got = layer(*mine, shape, plan, gather, documents)
                (got * upstream[:, pos]).sum().backward()
                e = {"out": rel(got.detach(), ref.detach()[:, pos])}
                for i, (t, r) in enumerate(zip(mine, ref_leaves)):
                    grad = t.grad.clone()
                    if i in params:
                        torch.distributed.all_reduce(grad)  # a parameter's gradient: every rank's share
                    e[f"grad {i}"] = rel(grad, _shard(r.grad, i, pos, params))
                runs = 2 if layout == "zigzag" else 1
                e["bytes"] = (gather.bytes_received, (world - 1) * runs * shape[0] * chunk_values(*shape) * 4)
                out[(kind, shape, layout, packed)] = e
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_recurrences_match_the_unsharded_sequence(world):
    """Gated DeltaNet, Kimi Delta Attention, Mamba2, Mamba and RecurrentGemma's RG-LRU: outputs and the gradients of the inputs, the decays or step sizes, the
    convolution weight and the parameters, every rank, both layouts with chunks (contiguous: rank 0 needs nothing
    from the others yet joins the backward's collectives); packed documents against each document alone."""
    for rank, results in enumerate(run_distributed(_sharded_worker, world, timeout=300)):
        assert {kind for kind, *_ in results} == set(KINDS)
        for (kind, shape, layout, packed), e in results.items():
            where = f"rank {rank}, {kind}, {layout}, {shape}, {'packed' if packed else 'one document'}"
            assert e["out"] <= TOL["out"], (where, e)
            for key in (k for k in e if k.startswith("grad")):
                assert e[key] <= TOL["grad"], (where, key, e)
            got, expected = e["bytes"]
            assert got == expected, (where, got, expected)  # one state and K - 1 inputs per chunk of each peer


def test_one_rank_calls_the_kernel_as_it_is_and_striped_is_refused():
    shape = SHAPES[0]
    x, weight, decay, beta, _ = _inputs(shape)
    plan = chunks(shape[1], rank=0, world_size=1, layout="striped")  # one rank: every layout is the identity
    assert (plan.count, plan.total) == (1, 1)
    conv_fn, kernel = _kernel()
    b, n, hk, hv, dk, dv, _ = shape
    y = conv_fn(x, weight, None, activation="silu").transpose(1, 2)
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = (t.reshape(b, n, hk, dk).repeat_interleave(hv // hk, dim=2) for t in (q, k))  # as Transformers' module
    want = kernel(q, k, v.reshape(b, n, hv, dv), g=decay, beta=beta, use_qk_l2norm_in_kernel=True, chunk_size=8)[0]
    assert torch.equal(_layer(x, weight, decay, beta, shape, plan, None), want)
    with pytest.raises(ValueError, match="striped layout"):
        chunks(12, rank=0, world_size=2, layout="striped")
    zigzag = chunks(12, rank=1, world_size=3, layout="zigzag")
    assert (zigzag.count, zigzag.length, zigzag.index, zigzag.total) == (2, 6, (1, 4), 6)
    assert [zigzag.owner(c) for c in range(6)] == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]


def test_one_rank_packing_by_cu_seq_lens_keeps_documents_apart():
    """One rank, no shard_batch: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` reach the linear layers too, and the loss and
    gradients are those of each document alone."""
    batch, _ = make_batch("packed", 40)
    pos = batch["position_ids"][0]
    cu = torch.tensor([*(pos == 0).nonzero().flatten().tolist(), pos.numel()], dtype=torch.int32)
    model = make_model("qwen3_5_text")
    ref_loss, ref_grads = per_document_step(model, batch)
    hf_ring.apply_ring_attention(model)
    model.zero_grad(set_to_none=True)
    loss = model(**batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=40, max_length_k=40).loss
    loss.backward()
    e = errors(loss.detach(), grads(model), ref_loss, ref_grads)
    assert e["loss"] <= RTOL and e["grad"] <= RTOL and e["decay"] <= RTOL_DECAY, e


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba", "jamba"])
def test_one_rank_refuses_packing_by_positions_and_a_cache_with_state(family):
    """One rank: packing signalled only by restarting positions (the attention would keep documents apart, the
    linear layers, given no positions, could not) and a decode step on a cache that holds the layers' states raise;
    the checks exchange as many fields as the ring's pre-flight, whose exchange they join."""
    from hf_ring.patches import linear

    from hf_ring import preflight

    assert len(linear.FIELDS) == len(preflight.FIELDS)
    model = make_model(family)
    ids = make_batch("plain", 40)[0]["input_ids"][:1]
    with torch.no_grad():
        past = model(input_ids=ids, use_cache=True).past_key_values  # the unpatched model fills its cache
    hf_ring.apply_ring_attention(model)
    restart = torch.cat([torch.arange(20), torch.arange(20)])[None]
    with pytest.raises(ValueError, match="restarting position_ids"):
        model(input_ids=ids, position_ids=restart, use_cache=False)
    with pytest.raises(ValueError, match="cache holding earlier tokens"):
        model(input_ids=ids[:, -1:], past_key_values=past, use_cache=True)


class _Recorded:
    """A ``StateGather`` stand-in for virtual ranks run one after another in one process: the first pass records
    what each rank sends (and stops there), the second hands every rank all of them."""

    def __init__(self, sent: dict, rank: int | None = None):
        self.sent, self.rank = sent, rank

    def gather(self, x):
        if self.rank is not None:
            self.sent[self.rank] = x
            raise _SentError
        return torch.stack([self.sent[r] for r in sorted(self.sent)])


class _SentError(Exception):
    pass


def _virtual_ranks(run, tensors: list, world: int, layout: str) -> torch.Tensor:
    """``run(tensors at a rank's positions, plan, gather)`` (a recurrence, per-token tensors [b, n, ...]) of
    ``world`` virtual ranks, reassembled into the full sequence."""
    n = tensors[0].shape[1]
    sent, outs = {}, []
    for rank in range(world):  # pass 1: each rank's chunk states
        pos = L.positions(n, rank=rank, world_size=world, layout=layout).to(tensors[0].device)
        plan = chunks(len(pos), rank=rank, world_size=world, layout=layout)
        with pytest.raises(_SentError):
            run([t[:, pos] for t in tensors], plan, _Recorded(sent, rank))
    for rank in range(world):  # pass 2: every rank with every state
        pos = L.positions(n, rank=rank, world_size=world, layout=layout).to(tensors[0].device)
        plan = chunks(len(pos), rank=rank, world_size=world, layout=layout)
        outs.append(run([t[:, pos] for t in tensors], plan, _Recorded(sent)))
    return L.unshard(outs, dim=1, layout=layout)


def _rule(kernel):
    def run(ts, plan, gather):
        return gated_delta_rule(*ts, kernel=kernel, plan=plan, gather=gather, use_qk_l2norm_in_kernel=True)

    return run


def _rule_inputs(device, dtype, b=2, n=144, hk=2, hv=4, dk=32, dv=48):
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(b, n, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, n, hv, dv, generator=g)
    decay, beta = -torch.rand(b, n, hv, generator=g), torch.rand(b, n, hv, generator=g)
    return [t.to(device=device, dtype=dtype if t.dim() == 4 else torch.float32) for t in (q, k, v, decay, beta)]


def _one_device(kernel, q, k, v, g, beta):
    return gated_delta_rule(q, k, v, g, beta, kernel=kernel, plan=chunks(q.shape[1], rank=0, world_size=1,
                            layout="zigzag"), gather=None, use_qk_l2norm_in_kernel=True)  # fmt: skip


def test_low_precision_rounds_once_under_autocast():
    """bf16 inputs, under autocast too: the ring's error against the fp32 computation is the unsharded bf16
    computation's (its kernel's outputs are corrected in fp32 and rounded once; measured equal to 4 digits at 2, 3
    and 4 ranks; rounding the kernel's bf16 outputs before the correction, a second rounding, measured 1.03x at 2
    ranks and 1.07x at 4)."""
    _, kernel = _kernel()
    exact = _one_device(kernel, *_rule_inputs("cpu", torch.float32))
    low = _rule_inputs("cpu", torch.bfloat16)
    yardstick = rel(_one_device(kernel, *low).float(), exact)
    for world, layout in ((2, "zigzag"), (4, "zigzag"), (3, "contiguous")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ring = _virtual_ranks(_rule(kernel), low, world, layout)
        assert ring.dtype == torch.bfloat16
        assert rel(ring.float(), exact) <= 1.01 * yardstick, (world, layout, rel(ring.float(), exact), yardstick)


def _fla_like(seen: list):
    """A stand-in of flash-linear-attention's chunked kernel, as its module names it: it refuses float32 inputs as
    fla's does, and computes with Transformers' PyTorch kernel (beneath its dispatch); ``seen``: the dtypes given."""
    import inspect

    _, dispatch = _kernel()
    reference = inspect.unwrap(dispatch)

    def chunk_gated_delta_rule(q, k, v, **kwargs):
        seen.append(q.dtype)
        assert q.dtype == k.dtype == v.dtype and q.dtype != torch.float32, "no float32 (as fla)"
        return reference(q, k, v, **kwargs)

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    return chunk_gated_delta_rule


def test_fla_kernels_get_half_precision_inputs_and_float32_goes_to_the_pytorch_kernel():
    """flash-linear-attention's kernels take no float32: on the composed path (several ranks) a bf16 model's inputs
    reach them as bf16 (one more rounding of their outputs: within 1.1x the unsharded bf16 error, measured 1.03x and
    1.07x at 2 and 4 ranks), and a float32 model under Transformers' dispatch to fla runs Transformers' PyTorch kernel
    beneath it, exactly; fla's kernel called directly on float32 is refused by name."""
    seen = []
    fla = _fla_like(seen)
    _, reference = _kernel()
    exact = _one_device(reference, *_rule_inputs("cpu", torch.float32))
    low = _rule_inputs("cpu", torch.bfloat16)
    yardstick = rel(_one_device(reference, *low).float(), exact)
    for world, layout in ((2, "zigzag"), (4, "zigzag")):
        seen.clear()
        ring = _virtual_ranks(_rule(fla), low, world, layout)
        assert set(seen) == {torch.bfloat16}
        assert rel(ring.float(), exact) <= 1.1 * yardstick, (world, layout, rel(ring.float(), exact), yardstick)
    # Transformers' dispatch having chosen fla (the implementation held in its closure, as it holds it): float32
    # inputs run the PyTorch kernel it wraps, exactly; having chosen its PyTorch kernel (fla not installed here), it
    # is not taken for fla's
    import functools
    import inspect

    from hf_ring.linear_attention import _fla

    def dispatcher(implementation):
        @functools.wraps(inspect.unwrap(reference))
        def dispatch(*args, **kwargs):
            return implementation(*args, **kwargs)

        return dispatch

    assert _fla(dispatcher(fla)) and not _fla(reference)
    fp32 = _rule_inputs("cpu", torch.float32)
    seen.clear()
    assert rel(_virtual_ranks(_rule(dispatcher(fla)), fp32, 2, "zigzag"), exact) <= 1e-5 and not seen
    with pytest.raises(ValueError, match="takes no float32 inputs; run the model in bfloat16"):
        _virtual_ranks(_rule(fla), fp32, 2, "zigzag")


def _scan_inputs(dtype, device="cpu", b=2, n=144, h=4, p=16, groups=2, d_state=16):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(b, n, h, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, n, h, generator=g) - 1)
    B, C = (torch.randn(b, n, groups, d_state, generator=g) for _ in range(2))
    return [x.to(device, dtype), dt.to(device), B.to(device, dtype), C.to(device, dtype)]


def _scan_with(kernel=None):
    """A Mamba2 scan (Transformers' PyTorch kernel, or ``kernel``) as ``_virtual_ranks`` runs it."""
    if kernel is None:
        from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan as kernel

    def run(ts, plan, gather):
        h, device = ts[0].shape[2], ts[0].device
        A, D = -torch.linspace(0.05, 1.0, h, device=device), torch.ones(h, device=device)
        return mamba2_scan(*ts[:2], A, *ts[2:], kernel=kernel, chunk_size=32, D=D, plan=plan, gather=gather)

    return run


_scan = _scan_with()


def _against_fp32(run, make_inputs, n: int, worlds: tuple, device: str = "cpu", autocast: bool = False):
    """A scan on bf16 inputs through virtual ranks (under autocast if asked): ``({(world, layout): its error
    against the fp32 unsharded scan}, the unsharded bf16 scan's error)``, the outputs checked to stay fp32."""
    whole = chunks(n, rank=0, world_size=1, layout="zigzag")
    exact = run(make_inputs(torch.float32, device), whole, None)
    low = make_inputs(torch.bfloat16, device)
    yardstick = rel(run(low, whole, None), exact)
    errors = {}
    for world, layout in worlds:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            ring = _virtual_ranks(run, low, world, layout)
        assert ring.dtype == torch.float32
        errors[(world, layout)] = rel(ring, exact)
    return errors, yardstick


CPU_WORLDS = ((2, "zigzag"), (4, "zigzag"), (3, "contiguous"))
GPU_WORLDS = ((2, "zigzag"), (8, "zigzag"), (4, "contiguous"))


def test_mamba2_in_low_precision_under_autocast():
    """bf16 x, B and C, under autocast: the sharded scan's error against the fp32 computation is at most the unsharded
    bf16 scan's (its inputs are taken in fp32 and its output corrected before the model's norm rounds it; measured
    1.000x at 2, 3 and 4 ranks: the inputs' rounding, the same for both, is all of it)."""
    errors, yardstick = _against_fp32(_scan, _scan_inputs, 144, CPU_WORLDS, autocast=True)
    for where, error in errors.items():
        assert error <= 1.01 * yardstick, (where, error, yardstick)


@pytest.mark.gpu
def test_gpu_mamba_ssm_kernel_through_the_sharded_scan():
    """The mamba-ssm kernel Transformers dispatches to on a GPU, from a zero state with its final state returned:
    virtual ranks against the same kernel unsharded, bf16 (2x its own error against fp32 plus an epsilon)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ssd = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined", reason="needs mamba-ssm")
    errors, yardstick = _against_fp32(_scan_with(ssd.mamba_chunk_scan_combined), _scan_inputs, 144, GPU_WORLDS, "cuda")
    for where, error in errors.items():
        assert error <= 2 * yardstick + 1e-3, (where, error, yardstick)


def _selective_inputs(dtype, device="cpu", b=2, n=96, d=8, d_state=4):
    g = torch.Generator().manual_seed(13)
    x = torch.randn(b, n, d, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, n, d, generator=g) - 1)
    B, C = (torch.randn(b, n, d_state, generator=g) for _ in range(2))
    return [x.to(device, dtype), dt.to(device), B.to(device, dtype), C.to(device, dtype)]


def _selective_with(kernel=None):
    """A Mamba scan (Transformers' PyTorch kernel, or ``kernel``) as ``_virtual_ranks`` runs it."""
    if kernel is None:
        from transformers.models.mamba.modeling_mamba import mamba_selective_scan as kernel

    def run(ts, plan, gather):
        d, d_state, device = ts[0].shape[2], ts[2].shape[2], ts[0].device
        A = -torch.linspace(0.05, 1.0, d * d_state, device=device).reshape(d, d_state)
        D = torch.ones(d, device=device)
        return mamba_scan(*ts[:2], A, *ts[2:], kernel=kernel, D=D, plan=plan, gather=gather)

    return run


def test_mamba_in_low_precision_under_autocast():
    """bf16 x, B and C, under autocast: the sharded Mamba scan's error against the fp32 computation is at most the
    unsharded bf16 scan's (inputs taken in fp32, states composed and outputs corrected in fp32)."""
    errors, yardstick = _against_fp32(_selective_with(), _selective_inputs, 96, CPU_WORLDS, autocast=True)
    for where, error in errors.items():
        assert error <= 1.01 * yardstick, (where, error, yardstick)


def test_mamba_readout_of_a_starting_state_in_blocks(monkeypatch):
    """What a starting state adds to a Mamba piece's outputs, computed over blocks of tokens forward and backward:
    against the einsum, and its gradients by finite differences (fp64), in one block and in blocks of 2 tokens."""
    from hf_ring import _scans

    g = torch.Generator().manual_seed(3)
    n, t, c, s = 2, 7, 3, 4
    C = torch.randn(n, t, s, generator=g, dtype=torch.float64).requires_grad_()
    T = torch.rand(n, t, c, generator=g, dtype=torch.float64).cumsum(1).requires_grad_()
    A = (-0.5 - torch.rand(c, s, generator=g, dtype=torch.float64)).requires_grad_()
    X = torch.randn(n, c, s, generator=g, dtype=torch.float64).requires_grad_()
    want = torch.einsum("ntcs,nts,ncs->ntc", (T[..., None] * A).exp(), C, X)
    for block, count in ((_scans.READOUT_BLOCK, 1), (2 * n * c * s, 4)):
        monkeypatch.setattr(_scans, "READOUT_BLOCK", block)
        assert len(_scans._blocks(T, s)) == count
        torch.testing.assert_close(_scans.DecayedReadout.apply(C, T, A, X), want, rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(_scans.DecayedReadout.apply, (C, T, A, X))


def _selective_gradient_errors(run, device: str) -> dict:
    """fp32 gradients of the inputs through virtual ranks (their chunk states gathered with their graphs, so a
    chunk's gradient from the chunks after it flows back) against the unsharded scan's: ``(world, layout) -> rel``."""
    leaves = [t.clone().requires_grad_() for t in _selective_inputs(torch.float32, device)]
    upstream = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(17)).to(device)
    (run(leaves, chunks(96, rank=0, world_size=1, layout="zigzag"), None) * upstream).sum().backward()
    want = [t.grad.clone() for t in leaves]
    errors = {}
    for world, layout in ((2, "zigzag"), (4, "zigzag"), (3, "contiguous")):
        for t in leaves:
            t.grad = None
        (_virtual_ranks(run, leaves, world, layout) * upstream).sum().backward()
        errors[(world, layout)] = max(rel(t.grad, w) for t, w in zip(leaves, want))
    return errors


def test_mamba_gradients_cross_the_virtual_ranks():
    """Every input's gradient (x, step sizes, B, C) through 2 to 4 virtual ranks equals the unsharded scan's (fp32:
    rounding only, 1e-5)."""
    for where, error in _selective_gradient_errors(_selective_with(), "cpu").items():
        assert error <= 1e-5, (where, error)


@pytest.mark.gpu
def test_gpu_mamba_ssm_selective_scan_through_the_sharded_scan():
    """mamba-ssm's ``selective_scan_fn`` (what Transformers' Mamba, Falcon-Mamba and Jamba mixers dispatch to on a
    GPU; its backward drops the gradient of the last state it returns, which the sharded scan does not use):
    virtual ranks against the same kernel unsharded, bf16 outputs (2x its own error against fp32 plus an epsilon)
    and fp32 gradients (1e-4: the kernel's own reductions regrouped)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    interface = pytest.importorskip("mamba_ssm.ops.selective_scan_interface", reason="needs mamba-ssm")
    run = _selective_with(interface.selective_scan_fn)
    errors, yardstick = _against_fp32(run, _selective_inputs, 96, GPU_WORLDS, "cuda")
    for where, error in errors.items():
        assert error <= 2 * yardstick + 1e-3, (where, error, yardstick)
    for where, error in _selective_gradient_errors(run, "cuda").items():
        assert error <= 1e-4, (where, error)


@pytest.mark.gpu
def test_gpu_fla_kda_kernel_through_the_sharded_rule():
    """fla's Kimi Delta Attention kernel (a decay per key channel), which Transformers dispatches Kimi Linear to on a
    GPU: virtual ranks against the same kernel unsharded, bf16 (2x its own error against fp32 plus an epsilon)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kernel = pytest.importorskip("fla.ops.kda", reason="needs flash-linear-attention").chunk_kda

    def inputs(dtype):
        q, k, v, decay, beta = _rule_inputs("cuda", dtype, hk=4, hv=4)
        per_channel = -torch.rand(*decay.shape, q.shape[-1], generator=torch.Generator().manual_seed(8)) / 4
        return [q, k, v, per_channel.to("cuda"), beta]

    exact = _one_device(kernel, *inputs(torch.float32)).float()
    low = inputs(torch.bfloat16)
    yardstick = rel(_one_device(kernel, *low).float(), exact)
    for world, layout in ((2, "zigzag"), (8, "zigzag"), (4, "contiguous")):
        ring = _virtual_ranks(_rule(kernel), low, world, layout)
        assert rel(ring.float(), exact) <= 2 * yardstick + 1e-3, (world, layout, rel(ring.float(), exact), yardstick)


@pytest.mark.gpu
def test_gpu_fla_kernel_through_the_sharded_rule():
    """The fla kernel Transformers dispatches to on a GPU, with values d_v + d_k wide and a starting state: virtual
    ranks against the same kernel unsharded, bf16 (2x its own error against fp32 plus an epsilon)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="needs flash-linear-attention")
    kernel = fla.chunk_gated_delta_rule
    exact = _one_device(kernel, *_rule_inputs("cuda", torch.float32)).float()
    low = _rule_inputs("cuda", torch.bfloat16)
    yardstick = rel(_one_device(kernel, *low).float(), exact)
    for world, layout in ((2, "zigzag"), (8, "zigzag"), (4, "contiguous")):
        ring = _virtual_ranks(_rule(kernel), low, world, layout)
        assert rel(ring.float(), exact) <= 2 * yardstick + 1e-3, (world, layout, rel(ring.float(), exact), yardstick)


def _hf_worker(rank: int, world: int) -> dict:
    """The Transformers integration on a tiny Qwen3.5: its refusals on every rank, the group usable after them."""
    out = {}

    model = hf_ring.apply_ring_attention(make_model("qwen3_5_text"))
    plain, _ = make_batch("plain", 40)
    # ranks that disagree on their shard's length (a batch cut by hand, each rank its own way)
    ids = plain["input_ids"][:, : 8 + 4 * rank]
    pos = torch.arange(ids.shape[1])[None] + 20 * rank
    out["disagree"] = error_of(lambda: model(input_ids=ids, position_ids=pos, use_cache=False))
    # a batch cut by hand without global positions: caught at the first attention layer (layer 0 is linear)
    mine = plain["input_ids"][:, rank * 20 : (rank + 1) * 20]
    out["local_positions"] = error_of(lambda: model(input_ids=mine, use_cache=False))
    local = hf_ring.shard_batch(plain)
    with torch.no_grad():
        out["after"] = float(hf_ring.reduce_loss(model(**local).loss))
    striped = hf_ring.apply_ring_attention(make_model("qwen3_5_text"), layout="striped")
    out["striped"] = error_of(lambda: striped(**hf_ring.shard_batch(plain, layout="striped")))
    ref = make_model("qwen3_5_text")
    with torch.no_grad():
        out["reference"] = float(ref(**plain).loss)
    # LFM2's short convolutions: 5.17's decoder layers call them without the batch's keywords (no padding seen)
    lfm2 = hf_ring.apply_ring_attention(make_model("lfm2"))
    padded, padded_ref = make_batch("padded", 40)
    out["lfm2_padded"] = error_of(lambda: lfm2(**hf_ring.shard_batch(padded)))
    return out


def test_integration_refuses_on_every_rank_and_the_group_stays_usable():
    for r in run_distributed(_hf_worker, 2, timeout=240):
        assert "disagree" in r["disagree"] or "rejected their input" in r["disagree"], r["disagree"]
        assert "striped layout" in r["striped"], r["striped"]
        assert "hf_ring.shard_batch" in r["local_positions"], r["local_positions"]
        assert abs(r["after"] - r["reference"]) <= 1e-5 * abs(r["reference"])
        if transformers_at_least("5.23"):  # (its parity: tests/test_hf_parity.py)
            assert r["lfm2_padded"] == "no error", r["lfm2_padded"]
        else:
            assert "called without them" in r["lfm2_padded"], r["lfm2_padded"]


HYBRID_PACKED = {  # name: (family, layout); LFM2's layers get the batch's keywords from Transformers 5.23 on
    "qwen3_5_text": ("qwen3_5_text", "zigzag"),
    "qwen3_next-contiguous": ("qwen3_next", "contiguous"),
    "lfm2": ("lfm2", "zigzag"),
    "bamba": ("bamba", "zigzag"),
    "olmo_hybrid": ("olmo_hybrid", "zigzag"),
    "kimi_linear": ("kimi_linear", "zigzag"),
    "falcon_h1-contiguous": ("falcon_h1", "contiguous"),
}


def _packed_worker(rank: int, world: int) -> dict:
    out = {}
    for name, (family, layout) in HYBRID_PACKED.items():
        if family == "lfm2" and not transformers_at_least("5.23"):
            continue
        batch, _ = make_batch("packed", 40)  # three documents in one row, cu_seq_lens included
        model = make_model(family)
        if rank == 0:
            ref_loss, ref_grads = per_document_step(model, batch)
        loss, grads = ring_step(model, batch, layout)
        if rank == 0:
            out[name] = errors(loss, grads, ref_loss, ref_grads)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_packed_documents_are_kept_apart_in_every_layer(world):
    """A packed batch through a hybrid: loss and gradients equal those of the model run on each document alone
    (the recurrence and the convolutions start afresh at every document, as the attention does)."""
    results = run_distributed(_packed_worker, world, timeout=300)[0]
    assert results
    for name, e in results.items():
        assert e["loss"] <= RTOL, (name, e)
        assert e["grad"] <= RTOL, (name, e)
        assert e["decay"] <= RTOL_DECAY, (name, e)


def test_pieces_are_grouped_with_at_most_twice_their_tokens_padded():
    from hf_ring.chunks import groups as _groups

    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        lengths = torch.randint(1, 400, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        groups = _groups(lengths)
        assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
        padded = sum(max(lengths[i] for i in group) * len(group) for group in groups)
        assert padded <= 2 * sum(lengths), (lengths, groups)
    assert _groups([8000] + [10] * 50) == [[0, 1], list(range(2, 51))]  # the short ones padded to 10, not 8000
