"""DeepSeek-V4's compressed attention layers: what hf_ring refuses, on every rank, and the patch's own life cycle.

Their parity with the unmodified model is in ``test_hf_parity`` (cases ``deepseek_v4-*``); the merge of the compressed
entries with the ring (``ring_attention(shared=...)``) against plain attention in ``test_ring``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.hf_models import error_of, in_transformers, make_batch, make_model

pytestmark = pytest.mark.skipif(not in_transformers("deepseek_v4"), reason="DeepSeek-V4 needs a later Transformers")


def _errors_worker(rank: int, world_size: int) -> dict:
    """Each refusal's message on this rank, and whether the group still runs a step afterwards."""
    import hf_ring

    model = make_model("deepseek_v4")
    batch, _ = make_batch("plain", 48, family="deepseek_v4")
    packed, _ = make_batch("packed", 48, family="deepseek_v4")

    def step(b, layout="zigzag", **apply):
        hf_ring.apply_ring_attention(model, layout=layout, **apply)
        try:
            model(**hf_ring.shard_batch(b, layout=layout)).loss.backward()
        finally:
            hf_ring.revert_ring_attention(model)

    short, _ = make_batch("plain", 40, family="deepseek_v4")  # zig-zag chunks of 10 tokens over 2 ranks
    out = {
        "striped": error_of(lambda: step(batch, "striped")),
        "chunks": error_of(lambda: step(short)),
        "packed": error_of(lambda: step(packed)),
        "ulysses": error_of(lambda: step(batch, ulysses_size=2)),
    }
    shifted = dict(batch, position_ids=torch.arange(48)[None].expand(2, -1) + 3)  # (windows not ended by a query)
    out["shifted"] = error_of(lambda: step(shifted))
    # only rank 1's positions are wrong (shifted after sharding): every rank raises, at the first layer (a sliding
    # one, which joins the ring's pre-flight exchange), not at the first compressed one, after a ring call
    counted = dict(batch, position_ids=torch.arange(48)[None].expand(2, -1))
    hf_ring.apply_ring_attention(model)
    local = hf_ring.shard_batch(counted)
    local["position_ids"] = local["position_ids"] + rank
    out["one_rank"] = error_of(lambda: model(**local))
    hf_ring.revert_ring_attention(model)
    model.set_attn_implementation("hf_ring")  # switched by name only: the compressors run on one rank's tokens
    out["by_name"] = error_of(lambda: model(**hf_ring.shard_batch(batch)))
    model.set_attn_implementation("eager")
    hf_ring.apply_ring_attention(model)
    out["generate"] = error_of(
        lambda: hf_ring.ring_generate(model, {"input_ids": batch["input_ids"]}, max_new_tokens=2)
    )
    hf_ring.revert_ring_attention(model)
    step(batch)  # the group goes on
    out["after"] = True
    return out


def test_refusals_raise_on_every_rank_and_the_group_goes_on():
    results = run_distributed(_errors_worker, 2, timeout=300)
    for r in results:
        assert "striped layout" in r["striped"] and "layout='zigzag'" in r["striped"], r["striped"]
        # (CSA's windows of 3 and HCA's of 6 over zig-zag's 4 chunks: 4 x lcm(3, 6))
        assert "chunks of 10 tokens" in r["chunks"] and "pad_to_multiple_of=24" in r["chunks"], r["chunks"]
        assert "packed documents" in r["packed"], r["packed"]
        assert "Ulysses" in r["ulysses"], r["ulysses"]
        assert "count each row's tokens from 0" in r["shifted"], r["shifted"]
    for rank, r in enumerate(results):
        want = "count each row's tokens from 0" if rank == 1 else "rejected their input"
        assert want in r["one_rank"], r["one_rank"]
        assert "apply_ring_attention(model)" in r["by_name"] and "compressor" in r["by_name"], r["by_name"]
        assert "ring_generate does not support deepseek_v4" in r["generate"], r["generate"]
        assert r["after"]


def test_apply_defers_the_compressors_and_revert_restores_them():
    import hf_ring
    from hf_ring import compressed

    model = make_model("deepseek_v4")
    batch, _ = make_batch("plain", 48, family="deepseek_v4")
    compressors = [m.self_attn.compressor for m in model.model.layers if m.self_attn.compressor is not None]
    assert len(compressors) == 3  # (CSA, HCA, CSA)
    with torch.no_grad():
        before = model(**batch, use_cache=False).logits
    hf_ring.apply_ring_attention(model)
    assert all("forward" in c.__dict__ for c in compressors)
    with torch.no_grad():
        during = model(**hf_ring.shard_batch(batch)).logits
    assert not any(compressed.ATTR in m.self_attn.__dict__ for m in model.model.layers)  # (each record consumed)
    hf_ring.revert_ring_attention(model)
    assert not any("forward" in c.__dict__ for c in compressors)
    with torch.no_grad():
        after = model(**batch, use_cache=False).logits
    assert torch.equal(before, after)
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-5)  # (fp32 rounding; the suite's parity is tighter)
