"""Bidirectional blocks (``block_ids``: the image tokens of Gemma 3) in the ring, against plain attention.

- every layout, 1 to 4 virtual ranks, the torch and sdpa backends (and triton in its interpreter): output and
  gradients equal dense attention with Transformers' blockwise mask (causal OR same block, then the window, then
  the padding), blocks spanning the ranks' chunk edges, with padding and a sliding window;
- ``BlockMask`` with block codes: its tile classes are conservative (EMPTY hides all, FULL shows all) and its
  element-wise mask is the reference's;
- a ring step whose blocks add nothing to the causal mask keeps the fast paths (no codes; pieces for the fused ops);
- bad ``block_ids`` raise with the cause (the same check runs on every rank before any exchange).
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.kernels import EMPTY, FULL, BlockMask, triton_backend
from hf_ring.ring import _message

from .reference import dense_mask, reference_attention, rel_err, virtual_ring

FP32_TOL = 1e-5  # the same math as the float64 reference in another order: fp32 rounding only
S = 48  # divisible by 2 x 4 (zig-zag over 4 ranks) and 3 x 2


def _inputs(batch=2, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(batch, hq, S, d, generator=g) for _ in range(2))
    k, v = (torch.randn(batch, hkv, S, d, generator=g) for _ in range(2))
    return q, k, v, do


def _blocks(batch=2) -> torch.Tensor:
    """Two image blocks in row 0 (one across chunk edges), one in row 1 starting at id 0; -1 elsewhere."""
    b = torch.full((batch, S), -1)
    b[0, 5:19] = 4
    b[0, 29:42] = 9
    if batch > 1:
        b[1, 20:33] = 0
    return b


def _padding(batch=2) -> torch.Tensor:
    docs = torch.zeros(batch, S, dtype=torch.long)
    docs[-1, :3] = -1  # left padding of the last row
    docs[0, -2:] = -1  # right padding of the first
    return docs


def _check(got, q, k, v, do, **mask):
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, **mask)
    grads = torch.autograd.grad(ref, ref_in, do.double())
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, (ref, *grads)):
        assert rel_err(a, r) < FP32_TOL, (name, rel_err(a, r))


@pytest.mark.parametrize("layout", hf_ring.LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_blocks_match_plain_attention(layout, n, backend):
    if S % hf_ring.layout.required_multiple(layout, n):
        pytest.skip("length not divisible")
    q, k, v, do = _inputs()
    blocks = _blocks()
    for window, docs in ((None, None), (None, _padding()), (7, None), (7, _padding())):
        got = virtual_ring(q, k, v, do, n, layout, backend=backend, window=window, docs=docs, blocks=blocks)
        _check(got, q, k, v, do, window=window, docs=docs, blocks=blocks)


def test_blocks_change_the_result():
    """The negative control: the same inputs without the blocks are far from the blockwise reference."""
    q, k, v, do = _inputs()
    out = virtual_ring(q, k, v, do, 2, "zigzag")[0]
    ref = reference_attention(q, k, v, blocks=_blocks())
    assert rel_err(out, ref) > 1e-2


@pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_backend.interpreted()),
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)",
)
@pytest.mark.parametrize(
    "layout, n", [("zigzag", 2), pytest.param("striped", 3, marks=pytest.mark.slow), ("contiguous", 1)]
)
def test_blocks_triton_kernels(layout, n):
    q, k, v, do = _inputs(d=32)
    blocks = _blocks()
    for window, docs in ((None, _padding()), (7, None)):
        got = virtual_ring(q, k, v, do, n, layout, backend="triton", window=window, docs=docs, blocks=blocks)
        _check(got, q, k, v, do, window=window, docs=docs, blocks=blocks)


@pytest.mark.parametrize("seed", range(6))
def test_block_codes_classify_conservatively(seed):
    g = torch.Generator().manual_seed(seed)
    n = 40
    q_pos = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values
    k_pos = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values
    codes = torch.zeros(2 * n, dtype=torch.int32)
    codes[torch.randint(0, 2 * n, (6,), generator=g)] = -1
    start = int(torch.randint(0, n, (1,), generator=g))
    codes[start : start + 15] = torch.where(codes[start : start + 15] < 0, -1, 3)
    window = None if seed % 2 else 11
    mask = BlockMask(q_pos, k_pos, window=window, q_doc=codes[q_pos][None], k_doc=codes[k_pos][None], blocks=True)
    blocks = torch.where(codes == 3, 0, -1)[None]
    dense = dense_mask(2 * n, window=window, docs=torch.where(codes < 0, -1, 0)[None], blocks=blocks)[0, 0]
    want = dense[q_pos][:, k_pos]
    assert torch.equal(mask.visible()[0], want)
    for t in range(0, n, 8):
        for u in range(0, n, 8):
            tile = mask.classify(slice(t, t + 8), slice(u, u + 8))
            part = want[t : t + 8, u : u + 8]
            if tile == EMPTY:
                assert not part.any(), (t, u)
            if tile == FULL:
                assert part.all(), (t, u)


def _plan(blocks, docs=None, world=2, rank=0):
    """The plan of one rank's call (a loopback ring: the plan is built before any exchange)."""
    q, k, v, _ = _inputs(batch=1)
    pos = [hf_ring.positions(S, rank=r, world_size=world, layout="zigzag") for r in range(world)]
    sent = [_message(k.index_select(2, p), v.index_select(2, p)) for p in pos]
    local = [x.index_select(2, pos[rank]) for x in (q, k, v)]
    plans = hf_ring.PlanCache()
    comm = hf_ring.LoopbackComm(rank, world, sent)
    hf_ring.ring_attention(*local, comm=comm, plans=plans, document_ids=docs, block_ids=blocks, backend="sdpa")
    (entry,) = plans._plans.values()
    return entry[1]


def test_steps_the_blocks_do_not_reach_keep_the_fast_paths():
    # one block inside rank 0's first zig-zag chunk (tokens 0..11 of 48 over 2 ranks): only rank 0's own step
    # sees it both ways
    blocks = torch.full((1, S), -1)
    blocks[0, 2:9] = 0
    plan = _plan(blocks)
    own, other = plan.masks
    assert own.blocks and own.pieces() is None
    assert not other.blocks and other.q_doc is None and other.pieces() is not None
    # with padding the step keeps its document ids, not the codes
    docs = torch.zeros(1, S, dtype=torch.long)
    docs[0, -3:] = -1
    plan = _plan(blocks, docs)
    assert plan.masks[0].blocks and not plan.masks[1].blocks and plan.masks[1].q_doc is not None


def test_bad_block_ids_raise_with_the_cause():
    q, k, v, _ = _inputs()
    cases = [
        (dict(block_ids=torch.zeros(1, S - 2, dtype=torch.long)), "block_ids must be an integer tensor"),
        (dict(block_ids=torch.zeros(1, S)), "block_ids must be an integer tensor"),
        (dict(block_ids=torch.zeros(1, S, dtype=torch.bool)), "block_ids must be an integer tensor"),
        (dict(block_ids=torch.zeros(1, S, dtype=torch.long), causal=False), "block_ids need causal=True"),
        (
            dict(block_ids=torch.zeros(1, S, dtype=torch.long), cu_seqlens=torch.tensor([0, 20, S])),
            "cannot be combined with packed documents",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            hf_ring.ring_attention(q, k, v, **kwargs)


def test_block_ids_of_any_integer_range():
    q, k, v, do = _inputs()
    small = _blocks()
    huge = torch.where(small >= 0, small * 2**40 + 5, -7)  # relabelled; any negative id is "no block"
    got = virtual_ring(q, k, v, do, 2, "zigzag", blocks=huge)
    _check(got, q, k, v, do, blocks=small)
