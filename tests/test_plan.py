"""The GPU hot path on CPU: plans built once per batch, PyTorch's fused ops per ring step, no redundant copies.

- ``BlockMask.pieces`` (what the ``sdpa`` and ``flash_attn`` backends run) covers exactly the visible
  pairs, for every layout, world size, rank and source block;
- the ``sdpa`` backend really runs PyTorch's fused ops where they express the step and matches the
  torch backend everywhere (its ring-level exactness runs in test_ring.py next to the torch backend);
- a patched model makes at most 2 collectives per forward + backward, the same for 2 and 6 layers,
  and still catches ranks that disagree, on every rank, once per forward; a dynamic-RoPE model one more
  (its largest position), not one per layer;
- one stacked K/V message per forward, none rebuilt in the backward; strided q/k/v are not copied;
- document ids of any integer range give the same attention as small ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import hf_ring
from hf_ring.kernels import BlockMask, sdpa_backend, torch_backend

from .dist_utils import run_distributed
from .reference import backend_step, fused_op_calls, reference_attention, rel_err, steps_match_torch_backend

FP32_TOL = 1e-5  # the same math in a different order: fp32 rounding only


def _render(mask: BlockMask, pieces) -> torch.Tensor:
    """The visibility that running ``pieces`` covers, as a dense [Lq, Lk] bool matrix."""
    vis = torch.zeros(mask.q_pos.numel(), mask.k_pos.numel(), dtype=torch.bool)
    for kind, qs, ks in pieces:
        n, m = qs.stop - qs.start, ks.stop - ks.start
        block = torch.ones(n, m, dtype=torch.bool)
        if kind == "causal":
            assert n == m
            block = block.tril()
        assert not vis[qs, ks].any(), "pieces overlap"
        vis[qs, ks] = block
    return vis


@pytest.mark.parametrize("layout", hf_ring.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_pieces_cover_exactly_the_visible_pairs(layout, world, causal):
    full = 8 * world * 2
    pos = [hf_ring.positions(full, rank=r, world_size=world, layout=layout) for r in range(world)]
    for rank in range(world):
        for src in range(world):
            mask = BlockMask(pos[rank], pos[src], causal=causal)
            pieces = mask.pieces()
            assert pieces is not None, (layout, world, rank, src)
            assert torch.equal(_render(mask, pieces), mask.visible()[0]), (layout, world, rank, src)


def test_pieces_refuse_what_a_causal_flag_cannot_express():
    p = torch.arange(16)
    assert BlockMask(p, p, causal=True, window=4).pieces() is None
    assert (
        BlockMask(
            p, p, q_doc=torch.zeros(1, 16, dtype=torch.int32), k_doc=torch.zeros(1, 16, dtype=torch.int32)
        ).pieces()
        is None
    )
    assert BlockMask(p + 2, p, causal=True).pieces() is None  # a diagonal two keys off
    assert BlockMask(p, torch.arange(0, 32, 2), causal=True).pieces() is None  # different steps


@pytest.mark.parametrize("layout", hf_ring.LAYOUTS)
def test_sdpa_steps_run_fused_ops_and_match_torch_backend(layout, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 40, generator=g).transpose(1, 2).transpose(1, 2)  # a strided view
    k, v = (torch.randn(2, 24, 2, 40, generator=g).transpose(1, 2) for _ in range(2))  # [B, L, H, D] views
    do = torch.randn(2, 4, 24, 40, generator=g)
    calls = fused_op_calls(monkeypatch)
    steps_match_torch_backend(layout, q, k, v, do)
    passes = [p for _, p in calls]  # every expressible step ran PyTorch's fused ops, forward and backward
    assert passes.count("fwd") > 0 and passes.count("bwd") == passes.count("fwd")


def test_sdpa_falls_back_for_windows_and_documents(monkeypatch):
    calls = fused_op_calls(monkeypatch)
    p = torch.arange(24)
    docs = torch.tensor([[0] * 10 + [1] * 14], dtype=torch.int32)
    q, k, v, do = (torch.randn(1, 2, 24, 16) for _ in range(4))
    for mask in (BlockMask(p, p, window=5), BlockMask(p, p, q_doc=docs, k_doc=docs)):
        mine, ref = (
            backend_step(sdpa_backend, q, k, v, do, mask, 0.25),
            backend_step(torch_backend, q, k, v, do, mask, 0.25),
        )
        assert max(rel_err(a, r) for a, r in zip(mine, ref)) <= FP32_TOL
    assert calls == []


def test_document_ids_of_any_integer_range():
    """Ids past int32 and below -1 (padding) are relabelled: the same attention as small ids."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    small = torch.tensor([[0] * 9 + [1] * 12 + [2] * 7 + [-1] * 4])
    huge = torch.where(small == 0, 2**40, torch.where(small == 1, 2**31 - 1, torch.where(small == 2, 2**30, -7)))
    for backend in ("torch", "sdpa"):
        a = hf_ring.ring_attention(q, k, v, document_ids=small, backend=backend)
        b = hf_ring.ring_attention(q, k, v, document_ids=huge, backend=backend)
        assert torch.equal(a, b), backend
    ref = reference_attention(q.double(), k.double(), v.double(), docs=small)
    assert rel_err(b, ref) <= FP32_TOL
    assert torch.equal(b[:, :, 28:], torch.zeros_like(b[:, :, 28:]))  # padding (any negative id) sees nothing


# ----------------------------------------------------------------------------- copies


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "clone" and args[0].dim() == 4:  # a copy of q, k, v, dout or out (not of an O(L) LSE slice)
            name = "clone-4d"
        self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _copies_worker(rank, world):
    torch.manual_seed(rank)
    b, n, hq, hkv, d = 1, 16, 4, 2, 16
    q = torch.randn(b, n, hq, d).transpose(1, 2).requires_grad_()  # Transformers' transposed views
    k = torch.randn(b, n, hkv, d).transpose(1, 2).requires_grad_()
    v = torch.randn(b, n, hkv, d).transpose(1, 2).requires_grad_()
    plans = hf_ring.PlanCache()
    hf_ring.ring_attention(q, k, v, backend="sdpa", plans=plans)  # plan built (positions: cat)
    fwd, bwd = _OpLog(), _OpLog()
    with fwd:
        out = hf_ring.ring_attention(q, k, v, backend="sdpa", plans=plans)
    dout = torch.randn(b, n, hq, d).transpose(1, 2)
    with bwd:
        out.backward(dout)
    return fwd.ops, bwd.ops


def test_one_stacked_message_and_no_copies_of_q_k_v():
    for fwd, bwd in run_distributed(_copies_worker, 2):
        assert fwd.count("stack") + fwd.count("cat") == 1, fwd  # K/V stacked once into the ring message
        assert bwd.count("stack") + bwd.count("cat") == 0, bwd  # the backward reuses it
        for ops in (fwd, bwd):
            assert ops.count("clone-4d") == 0, ops  # no .contiguous() of q, k, v or dout


# ----------------------------------------------------------------------------- plans in a model


def _tiny_llama(layers: int, **overrides):
    import transformers as tf

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    cfg = tf.LlamaConfig(**{**sizes, **overrides})
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


class _Collectives:
    """Counts torch.distributed collectives (P2P excluded) while active."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier", "all_gather_object",
             "reduce_scatter", "all_to_all", "gather", "scatter")  # fmt: skip

    def __init__(self):
        self.count = 0
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name)
            self._saved[name] = fn

            def counting(*a, _fn=fn, **kw):
                self.count += 1
                return _fn(*a, **kw)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _plans_worker(rank, world):
    results = {}
    batch = {"input_ids": torch.randint(1, 64, (1, 32)), "labels": torch.randint(1, 64, (1, 32))}
    # dynamic NTK RoPE above 16 positions: its rotary embedding adds one all-reduce per forward (the largest position)
    dynamic = {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    for layers, rope in ((2, None), (6, None), (2, "dynamic"), (6, "dynamic")):
        model = hf_ring.apply_ring_attention(_tiny_llama(layers, **(dynamic if rope else {})))
        counts = []
        for _ in range(3):  # the first step builds the plan, the others reuse it
            local = hf_ring.shard_batch(batch)
            with _Collectives() as c:
                model(**local).loss.backward()
            counts.append(c.count)
        model.gradient_checkpointing_enable()
        with _Collectives() as c:
            model(**hf_ring.shard_batch(batch)).loss.backward()
        counts.append(c.count)
        results[layers if rope is None else (rope, layers)] = counts
    # Gemma 3 calls its rotary embedding once per layer type: still one all-reduce per forward
    from tests.hf_models import DYNAMIC_FULL_LAYERS, make_model

    for rope in (None, "dynamic"):
        model = hf_ring.apply_ring_attention(make_model("gemma3_text", **(DYNAMIC_FULL_LAYERS if rope else {})))
        gemma = {"input_ids": batch["input_ids"] % 90 + 1, "labels": batch["labels"] % 90 + 1}
        with _Collectives() as c:
            model(**hf_ring.shard_batch(gemma)).loss.backward()
        results["gemma3", rope] = c.count
    # ranks that disagree are still caught in a later forward, on every rank, and the group survives
    model = hf_ring.apply_ring_attention(_tiny_llama(2))
    model(**hf_ring.shard_batch(batch))
    other = {"input_ids": batch["input_ids"][:, : 16 if rank == 1 else 32]}
    try:
        model(**hf_ring.shard_batch(other))
        results["disagree"] = None
    except ValueError as e:
        results["disagree"] = str(e)
    model(**hf_ring.shard_batch(batch))  # still usable
    return results


def test_collectives_per_step_do_not_grow_with_layers():
    for rank, res in enumerate(run_distributed(_plans_worker, 2, timeout=300)):
        assert res[2] == res[6], f"rank {rank}: collectives per forward+backward, 2 layers {res[2]}, 6 layers {res[6]}"
        assert all(1 <= c <= 2 for c in res[2]), f"rank {rank}: {res[2]}"  # one check per forward, counted
        dynamic = res["dynamic", 2]
        assert dynamic == res["dynamic", 6] and dynamic == [c + 1 for c in res[2]], (rank, dynamic, res[2])
        assert res["gemma3", "dynamic"] == res["gemma3", None] + 1, rank
        assert res["disagree"] is not None and "disagree on local_seq" in res["disagree"], res["disagree"]


def test_plan_cache_reuses_plans_and_checks_again_after_new_batch(monkeypatch):
    """One rank, no group: a plan is built once per key and document tensor, and shared by copies."""
    import copy

    plans = hf_ring.PlanCache()
    built = []
    from hf_ring import plan as planning

    real = planning.make_plan

    def counting(*a, **kw):
        plan = real(*a, **kw)
        built.append(a[-1] is None)  # True: built from scratch, False: reused after a new check
        return plan

    monkeypatch.setattr(planning, "make_plan", counting)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    docs = torch.tensor([[0] * 5 + [1] * 11])
    for _ in range(3):
        hf_ring.ring_attention(q, k, v, plans=plans, document_ids=docs)
    assert built == [True]
    plans.new_batch()
    hf_ring.ring_attention(q, k, v, plans=plans, document_ids=docs)
    assert built == [True, False]
    hf_ring.ring_attention(q, k, v, plans=plans, document_ids=docs.clone())  # new documents: a new plan
    assert built == [True, False, True]
    assert copy.deepcopy(plans) is plans and len(plans) == 2
    # sinks of the wrong shape after a call without: checked again (the key holds their shape), refused
    with pytest.raises(ValueError, match=r"sinks must be a floating-point tensor \[q_heads=2\]"):
        hf_ring.ring_attention(q, k, v, plans=plans, document_ids=docs, sinks=torch.zeros(1))
    hf_ring.ring_attention(q, k, v, plans=plans, document_ids=docs, sinks=torch.zeros(2))
    assert built == [True, False, True, True]  # (the refused call built nothing)


def test_documents_are_derived_once_per_forward(monkeypatch):
    """One rank, packed position_ids: the host copy that finds the documents runs once per forward, not per layer."""
    from hf_ring import batch_checks

    calls = []
    real = batch_checks.documents_from_positions
    monkeypatch.setattr(batch_checks, "documents_from_positions", lambda p: calls.append(1) or real(p))
    model = _tiny_llama(3)
    ids = torch.randint(1, 64, (1, 24))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]  # two packed documents
    with torch.no_grad():  # the documents one by one through the unmodified model
        reference = torch.cat([model(input_ids=ids[:, :10]).logits, model(input_ids=ids[:, 10:]).logits], 1)
    hf_ring.apply_ring_attention(model)
    for forward in (1, 2):
        logits = model(input_ids=ids, position_ids=pos).logits
        assert len(calls) == forward
    assert rel_err(logits, reference) <= FP32_TOL


def test_plan_cache_keeps_at_most_max_plans():
    plans = hf_ring.PlanCache()
    q = torch.randn(1, 2, 8, 8)
    for scale in range(1, plans.MAX_PLANS + 2):  # one more kind of call than the cache holds
        hf_ring.ring_attention(q, q, q, scale=float(scale), plans=plans)
    assert len(plans) == plans.MAX_PLANS


def test_loopback_comm_checks_its_ranks():
    with pytest.raises(ValueError, match="world_size >= 2"):
        hf_ring.LoopbackComm(0, 1, [])
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        hf_ring.LoopbackComm(3, 2, [])


def test_a_selection_of_a_mask_reuses_its_device_copies():
    """DeepSeek sparse attention selects keys per layer on a step's mask: the positions' device copies, uploaded
    once for the step, go with every selection (no upload per layer), and the selection's own tile masks are its own."""
    p = torch.arange(16)
    mask = BlockMask(p, p, causal=True)
    copies = mask.device_tensors(torch.device("cpu"))
    selected = torch.randint(0, 16, (1, 16, 4))
    chosen = mask.with_selection(selected, 16)
    assert chosen.device_tensors(torch.device("cpu")) is copies
    assert torch.equal(chosen.visible(), mask.visible() & chosen._chosen(slice(None), slice(None), 16))
