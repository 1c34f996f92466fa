"""torch.compile over the Triton backend: compiled and eager give the same numbers (CPU, one rank, no group).

The launchers are ``torch.library`` custom ops with fake implementations, so dynamo/AOTAutograd
trace them as opaque mutating ops; on CPU the kernels then run in Triton's interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring.kernels import triton_backend
from hf_ring.kernels.mask import BlockMask

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_backend.interpreted()),
    reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)",
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Block(torch.nn.Module):
    """A tiny attention block around ``ring_attention``: projections, GQA 4:2, sliding window."""

    def __init__(self, dim=64, hq=4, hkv=2, window=None):
        super().__init__()
        self.hq, self.hkv, self.d, self.window = hq, hkv, dim // hq, window
        self.q = torch.nn.Linear(dim, hq * self.d)
        self.kv = torch.nn.Linear(dim, 2 * hkv * self.d)
        self.o = torch.nn.Linear(hq * self.d, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.hq, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        a = hf_ring.ring_attention(q, k, v, backend="triton", sliding_window=self.window)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_ring_attention_matches_eager(backend):
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = _Block(window=24).to(DEVICE)
    x = torch.randn(2, 40, 64, device=DEVICE)
    eager_loss = model(x).square().mean()
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x).square().mean()
    loss.backward()
    # Same kernels on both paths; only the surrounding ops may be fused differently.
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_custom_ops_trace_in_one_graph():
    """The forward launcher traces with fullgraph=True: no graph break around the kernel."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 40, 32, device=DEVICE), *torch.randn(2, 1, 2, 40, 32, device=DEVICE)
    mask = BlockMask(q_pos=torch.arange(40), k_pos=torch.arange(40), causal=True)

    def step(q, k, v):
        out = torch.zeros(q.shape, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, device=q.device)
        triton_backend.forward(q, k, v, mask, 0.2, out, lse)
        return out * 2.0, lse

    eager = step(q, k, v)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
