"""``decode_attention``: queries alike on every rank, keys/values spread over the ranks (a sharded KV cache),
against float64 attention on the whole sequence.

The keys of a sequence of P prompt tokens (zig-zag over the ranks, as the ring's prefill leaves them) and G
generated ones (appended round-robin) are spread over 3 gloo ranks; the queries are the newest tokens. Every
rank must return the reference rows, bit-identical across ranks. fp32 within 1e-5 relative (one fp32 merge of
N partial softmaxes; measured ~1e-7).
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.layout import positions

from .dist_utils import run_distributed
from .reference import reference_attention, rel_err

FP32_TOL = 1e-5
P, G = 24, 5  # prompt tokens (zig-zag over the ranks), generated tokens (round-robin)


def _sequence(b=2, hq=4, hkv=2, d=16, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = P + G
    return (
        torch.randn(b, hq, s, d, generator=g),
        torch.randn(b, hkv, s, d, generator=g),
        torch.randn(b, hkv, s, dv or d, generator=g),
    )


def _mine(rank: int, world: int) -> torch.Tensor:
    """Global positions of the keys this rank caches: its zig-zag shard of the prompt, then every world-th new token."""
    prompt = positions(P, rank=rank, world_size=world, layout="zigzag") if world > 1 else torch.arange(P)
    return torch.cat([prompt, torch.arange(P + rank, P + G, world)])


CASES = {  # name: (keyword arguments, number of newest tokens queried)
    "causal": ({}, 1),
    "two_new": ({}, 2),
    "window": ({"sliding_window": 6}, 1),  # most ranks hold no visible key
    "non_causal": ({"causal": False}, 1),
    "softcap_sinks": ({"softcap": 2.0, "sinks": True}, 1),
    "documents": ({"docs": True}, 2),  # packed prompt, padding, a query of a padded row sees nothing
    "value_head_dim": ({"dv": 24}, 2),  # values with their own head_dim (multi-head latent attention)
    "selected": ({"selected": True, "dv": 24}, 2),  # each query's top-k keys (DeepSeek sparse attention), any rank's
    "selected_blocks": ({"selected": 3, "docs": True}, 2),  # blocks of 3 keys per key/value head (MiniMax M3's)
    "alibi": ({"alibi": True, "docs": True}, 2),  # ALiBi's slopes (BLOOM, MPT), by global distance
}


def _case(name, rank, world):
    kw, t = CASES[name]
    kw = dict(kw)
    q, k, v = _sequence(dv=kw.pop("dv", None))
    s = q.shape[2]
    ref_kw = {k2: kw[k2] for k2 in ("causal", "sliding_window", "softcap") if k2 in kw}
    if "sliding_window" in ref_kw:
        ref_kw["window"] = ref_kw.pop("sliding_window")
    sinks = docs = None
    if kw.pop("sinks", False):
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
        ref_kw["sinks"] = sinks
    if kw.pop("docs", False):
        docs = torch.zeros(2, s, dtype=torch.long)
        docs[0, 7:] = 1
        docs[0, 19:] = 2
        docs[1, :] = -1  # row 1: padding only (its queries see nothing, its keys are seen by nothing)
        ref_kw["docs"] = docs
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = ref_kw["alibi"] = torch.tensor([0.5, 2**-0.5, 0.125, 0.0625])
    q_pos = torch.arange(s - t, s)
    k_pos = _mine(rank, world)
    block = kw.pop("selected", False)
    if block is True:  # 6 of every position (repeats, later ones) per query, the same on every rank
        picked = torch.randint(0, s, (2, t, 6), generator=torch.Generator().manual_seed(1))
        keep = torch.zeros(2, s, s, dtype=torch.bool)
        keep[:, q_pos] = torch.zeros(2, t, s, dtype=torch.bool).scatter_(2, picked, True)
        kw["selected"], ref_kw["keep"] = picked, keep[:, None]
    elif block:  # 3 blocks of keys from the fifth per query and key/value head (the last one cut short, none past it)
        hkv, hq, start = k.shape[1], q.shape[1], 4
        picked = torch.randint(-1, -(-s // block) + 1, (2, hkv, t, 3), generator=torch.Generator().manual_seed(1))
        named = (start + picked.clamp_min(0)[..., None] * block + torch.arange(block)).flatten(-2)
        named = torch.where(picked.repeat_interleave(block, -1) >= 0, named, s).clamp_max(s)
        keep = torch.zeros(2, hkv, s, s, dtype=torch.bool)
        keep[:, :, q_pos] = torch.zeros(2, hkv, t, s + 1, dtype=torch.bool).scatter_(-1, named, True)[..., :s]
        kw["selected"] = hf_ring.Selection(picked, block, start)
        ref_kw["keep"] = keep.repeat_interleave(hq // hkv, 1)
    extra = {}
    if docs is not None:
        extra = {"q_doc": docs[:, q_pos], "k_doc": docs[:, k_pos]}
    out = hf_ring.decode_attention(
        q[:, :, q_pos], k[:, :, k_pos], v[:, :, k_pos], q_pos=q_pos, k_pos=k_pos, sinks=sinks, **kw, **extra
    )
    ref = reference_attention(q, k, v, **ref_kw)[:, :, q_pos].float()
    return out, ref, docs


def _worker(rank, world):
    results = {}
    for name in CASES:
        out, ref, docs = _case(name, rank, world)
        results[name] = (out, rel_err(out, ref), None if docs is None else bool((out[1] == 0).all()))
    # a rank that caches no key at all (rank 2 here) still takes part
    q, k, v = _sequence()
    k_pos = torch.arange(P) if rank == 0 else torch.arange(P, P + 2) if rank == 1 else torch.arange(0)
    q_last = q[:, :, P + 1 : P + 2]  # the query at position P + 1 sees keys 0 .. P + 1
    out = hf_ring.decode_attention(q_last, k[:, :, k_pos], v[:, :, k_pos], q_pos=torch.tensor([P + 1]), k_pos=k_pos)
    ref = reference_attention(q[:, :, : P + 2], k[:, :, : P + 2], v[:, :, : P + 2])[:, :, -1:]
    results["empty_rank"] = (out, rel_err(out, ref.float()), None)
    # bad input on one rank: every rank raises the same error before the merge
    errors = {}
    for name, call in (
        (
            "new tokens",
            lambda: hf_ring.decode_attention(
                q[:, :, -1 - rank :], k, v, q_pos=torch.arange(1 + rank), k_pos=torch.arange(k.shape[2])
            ),
        ),  # fmt: skip
        (
            "k_pos",
            lambda: hf_ring.decode_attention(
                q[:, :, -1:], k, v, q_pos=torch.tensor([0]), k_pos=torch.arange(k.shape[2] + (rank == 1))
            ),
        ),  # fmt: skip
    ):
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    results["errors"] = errors
    return results


@pytest.fixture(scope="module")
def three_ranks():
    return run_distributed(_worker, 3, timeout=180)


@pytest.mark.parametrize("name", [*CASES, "empty_rank"])
def test_decode_attention_matches_attention_over_the_whole_cache(three_ranks, name):
    outs = [r[name][0] for r in three_ranks]
    for rank, r in enumerate(three_ranks):
        out, err, padded_zero = r[name]
        assert err <= FP32_TOL, f"rank {rank} {name}: relative error {err:.2e}"
        assert torch.equal(out, outs[0]), f"rank {rank} {name}: differs from rank 0"
        if padded_zero is not None:
            assert padded_zero, "queries of a padded row must give exact zeros"


def test_decode_attention_bad_input_on_one_rank_raises_on_every_rank(three_ranks):
    for rank, r in enumerate(three_ranks):
        errors = r["errors"]
        assert "disagree on new_tokens: [1, 2, 3]" in errors.get("new tokens", ""), (rank, errors)
        wanted = "k_pos must be a tensor" if rank == 1 else "rank(s) [1] rejected their input"
        assert wanted in errors.get("k_pos", ""), (rank, errors)


@pytest.mark.parametrize("name", list(CASES))
def test_one_rank_holds_the_whole_cache(name):
    out, ref, _ = _case(name, 0, 1)
    assert rel_err(out, ref) <= FP32_TOL
