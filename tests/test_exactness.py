"""``hf_ring.check_exactness``: its verdict on correct and on broken runs, and the model it leaves as it found it.

The numbers it reports are the suite's own measure (``tests/test_properties.py``); here: that it passes what is exact,
fails what is not (a ring output off by 0.1%), and restores the model (attention, mode, dtypes, gradients).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.hf_models import make_batch, make_model


def _state(model) -> dict:
    """What the check must leave as it was: each parameter's tensor (values and dtype) and gradient object."""
    return {n: (p.detach().clone(), p.grad) for n, p in model.named_parameters()}


def _same_state(model, before: dict) -> bool:
    return all(
        p.dtype == before[n][0].dtype and torch.equal(p.detach(), before[n][0]) and p.grad is before[n][1]
        for n, p in model.named_parameters()
    )


def _worker(rank: int, world_size: int) -> dict:
    import hf_ring
    from hf_ring import hf_attention
    from hf_ring.ring_config import CONFIG_ATTR

    out = {}
    for kind in ("plain", "padded", "packed"):
        model = make_model("llama")
        model.train()
        for p in model.parameters():  # (gradients the caller had: the check puts them back)
            p.grad = torch.full_like(p, 7.0)
        before = _state(model)
        report = hf_ring.check_exactness(model, make_batch(kind, 45)[0])
        patched = any(hasattr(m, CONFIG_ATTR) for m in model.modules())
        out[kind] = {"report": report, "restored": _same_state(model, before) and model.training and not patched}
    model = make_model("llama", dtype=torch.bfloat16)
    out["bf16"] = {"report": hf_ring.check_exactness(model, make_batch("plain", 45)[0])}
    out["moe"] = {"report": hf_ring.check_exactness(make_model("gpt_oss"), make_batch("packed", 40)[0])}

    # a model already patched: its settings, and patched afterwards with the very same configuration
    model = make_model("llama")
    hf_ring.apply_ring_attention(model, layout="contiguous")
    cfg = next(getattr(m, CONFIG_ATTR) for m in model.modules() if hasattr(m, CONFIG_ATTR))
    report = hf_ring.check_exactness(model, make_batch("padded", 45)[0])
    again = [getattr(m, CONFIG_ATTR, None) for m in model.modules() if hasattr(m, CONFIG_ATTR)]
    out["patched"] = {"report": report, "restored": bool(again) and all(c is cfg for c in again)}

    # a broken ring (its output 0.1% off) must fail
    true_ring = hf_attention.ring_attention
    hf_attention.ring_attention = lambda *a, **k: true_ring(*a, **k) * 1.001
    try:
        out["broken"] = {"report": hf_ring.check_exactness(make_model("llama"), make_batch("plain", 45)[0])}
    finally:
        hf_attention.ring_attention = true_ring

    def error(fn) -> str:
        try:
            fn()
        except ValueError as e:
            return str(e)
        return "no error"

    batch = make_batch("plain", 45, seed=1 + rank)[0]  # (each rank its own batch)
    out["different"] = error(lambda: hf_ring.check_exactness(make_model("llama"), batch))
    out["no_labels"] = error(lambda: hf_ring.check_exactness(make_model("llama"), {"input_ids": batch["input_ids"]}))
    out["settings"] = error(lambda: hf_ring.check_exactness(model, make_batch("plain", 45)[0], layout="zigzag"))
    out["after"] = hf_ring.check_exactness(make_model("llama"), make_batch("plain", 45)[0]).ok  # the group goes on
    return out


def test_check_exactness_passes_exact_runs_fails_a_broken_one_and_restores_the_model():
    results = run_distributed(_worker, 2, timeout=300)
    for r in results:
        for kind in ("plain", "padded", "packed", "bf16", "patched"):
            report = r[kind]["report"]
            assert report.ok and report.ranks == 2 and report.model_grad_error is not None, (kind, str(report))
            assert report.reference_dtype == (torch.float32 if kind == "bf16" else torch.float64), kind
            assert report.grad_error <= report.grad_bound and "OK" in str(report), str(report)
            assert r[kind].get("restored", True), kind
        assert r["patched"]["report"].layout == "contiguous"
        assert r["plain"]["report"].grad_bound < 2e-4  # (fp32: twice the model's own error, 1e-7, plus 1e-4)
        moe = r["moe"]["report"]  # Transformers' grouped expert products refuse float64: no yardstick, said so
        assert moe.ok and moe.reference_dtype is None and moe.model_grad_error is None and "float64" in moe.note
        broken = r["broken"]["report"]
        assert not broken.ok and broken.grad_error > 10 * broken.grad_bound and "FAILED" in str(broken), str(broken)
        assert "different batches" in r["different"], r["different"]
        assert "with labels" in r["no_labels"], r["no_labels"]
        assert "leave layout unset" in r["settings"], r["settings"]
        assert r["after"]
    assert results[0]["plain"]["report"] == results[1]["plain"]["report"]  # the same report on every rank


def test_check_exactness_on_one_process():
    import hf_ring

    report = hf_ring.check_exactness(make_model("mistral"), make_batch("padded", 45)[0], reference_dtype=None)
    assert report.ok and report.ranks == 1 and report.reference_dtype is None and report.loss_error < 1e-5, str(report)
    with pytest.raises(ValueError, match="reference_dtype must be"):
        hf_ring.check_exactness(make_model("mistral"), make_batch("plain", 45)[0], reference_dtype=torch.int64)


def test_the_plugin_checks_with_its_settings_and_its_chunked_loss():
    """``RingAttentionPlugin.check_exactness`` (one process): the plugin's layout, and the chunked loss on during the
    check (the loss the plugin will train) and off afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hf_ring import loss
    from hf_ring.accelerate import RingAttentionPlugin

    model = make_model("llama")
    seen = []
    chunked = loss.apply_chunked_loss

    def spy(target, **kwargs):
        seen.append(kwargs)
        return chunked(target, **kwargs)

    loss.apply_chunked_loss = spy
    try:
        plugin = RingAttentionPlugin(cp_size=1, layout="contiguous", loss_chunk_size=16)
        report = plugin.check_exactness(Accelerator(cpu=True), model, make_batch("packed", 45)[0])
    finally:
        loss.apply_chunked_loss = chunked
        AcceleratorState._reset_state(reset_partial_state=True)
    assert report.ok and report.layout == "contiguous" and report.ranks == 1, str(report)
    assert seen == [{"chunk_size": 16, "backend": "torch"}] and not loss.is_chunked(model)
