"""Liger-Kernel's model patches (``apply_liger_kernel_to_<family>``: RoPE, the fused linear cross-entropy head,
RMSNorm, SwiGLU; what TRL's ``use_liger_kernel=True`` applies) combined with ring attention on 2 gloo ranks: the
loss and gradients equal the unmodified model's on the unsharded batch. Liger's fused head honours
``shard_batch``'s ``shift_labels`` and ``num_items_in_batch``; its RoPE takes the global positions. On CPU the
kernels run in Triton's interpreter (RoPE and the fused head; RMSNorm and SwiGLU only on a GPU).
"""

from __future__ import annotations

import sys

import pytest
import torch

from hf_ring.loss import liger_unavailable

from .dist_utils import run_distributed
from .hf_models import errors, make_batch, make_model, reference_step, ring_step

pytestmark = pytest.mark.skipif(
    liger_unavailable(torch.device("cpu")) is not None, reason="needs Liger-Kernel and Triton's interpreter"
)

RTOL = 1e-5  # fp32: Liger's kernels reorder sums (RMSNorm, the fused cross-entropy); measured below 1e-6
# Triton's interpreter cannot run Liger's RMSNorm and SwiGLU kernels (they call .to() on a Python float): on CPU
# the RoPE kernel and the fused linear cross-entropy head run, on a GPU every patch
ELEMENTWISE = torch.cuda.is_available()
CASES = [("llama", "plain"), ("llama", "packed"), ("mistral", "padded"), ("qwen2", "packed")]


def _worker(rank: int, world: int) -> dict:
    import liger_kernel.transformers as liger

    import hf_ring

    out, refs = {}, {}
    for family, kind in CASES:  # every reference before any patch: Liger's RoPE patch holds for the whole process
        refs[(family, kind)] = reference_step(make_model(family), make_batch(kind, 40)[1]) if rank == 0 else None
    for family, kind in CASES:
        ours, _ = make_batch(kind, 40)
        model = make_model(family)
        patch = getattr(liger, f"apply_liger_kernel_to_{family}")  # class-level patches too: a process per run
        patch(model=model, rope=True, fused_linear_cross_entropy=True, rms_norm=ELEMENTWISE, swiglu=ELEMENTWISE)
        fused = getattr(model.forward, "__func__", model.forward).__module__.startswith("liger_kernel")
        rope = sys.modules[type(model).__module__].apply_rotary_pos_emb.__module__.startswith("liger_kernel")
        loss, grads = ring_step(model, ours, "zigzag")
        out[(family, kind)] = {"fused": fused and rope, "loss": loss.item()}
        if rank == 0:
            out[(family, kind)]["errors"] = errors(loss, grads, *refs[(family, kind)])
    assert hf_ring  # applied by ring_step
    return out


def test_liger_model_patches_with_ring_attention_match_the_unmodified_model():
    results = run_distributed(_worker, 2, timeout=600)
    for case in CASES:
        r = results[0][case]
        assert r["fused"], f"{case}: Liger's fused linear cross-entropy head or RoPE was not installed"
        assert r["errors"]["loss"] <= RTOL and r["errors"]["grad"] <= RTOL, (case, r["errors"])
        assert results[1][case]["loss"] == r["loss"]
