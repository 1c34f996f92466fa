"""The CUDA calls of the ``sdpa`` backend, checked on any machine with fake CUDA tensors.

``FakeTensorMode`` runs PyTorch's registered meta kernels for ``cuda`` tensors without a GPU: our calls
to ``aten._scaled_dot_product_flash_attention`` and its backward are checked against the installed
PyTorch's op schemas (argument count and types; the meta kernels do not tell ``out`` from ``lse``),
and the outputs we take from them against their shapes and dtypes (with GQA and with the strided
tensors Transformers hands over). The merges around them are device-agnostic and tested on CPU;
numbers on CUDA in test_gpu_hot_path.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_ring.kernels import sdpa_backend

fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
CUDA = torch.device("cuda", 0)


def _fake_cuda(mode, shape, dtype, transposed=False):
    """A fake CUDA tensor of ``shape``; ``transposed``: a [b, s, h, d] tensor seen as [b, h, s, d]."""
    if transposed:
        b, h, s, d = shape
        meta = torch.empty((b, s, h, d), dtype=dtype, device="meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, CUDA).transpose(1, 2)
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_sdpa_cuda_step_calls_match_the_op_schemas(dtype, heads, causal, transposed):
    hq, hkv = heads
    b, lq, lk, d = 2, 96, 96 if causal else 160, 128
    mode = fake_tensor.FakeTensorMode()
    with mode:
        q = _fake_cuda(mode, (b, hq, lq, d), dtype, transposed)
        k, v = (_fake_cuda(mode, (b, hkv, lk, d), dtype, transposed) for _ in range(2))
        assert sdpa_backend.runs_on_fused_ops(q, v)
        out, lse = sdpa_backend._fwd(q, k, v, causal, 0.09)
        assert (out.shape, out.dtype, out.device) == ((b, hq, lq, d), dtype, CUDA)
        assert (lse.shape, lse.dtype, lse.device) == ((b, hq, lq), torch.float32, CUDA)
        do = _fake_cuda(mode, (b, hq, lq, d), dtype, transposed)
        dq, dk, dv = sdpa_backend._bwd(do, q, k, v, out, lse, causal, 0.09)
        assert (dq.shape, dq.dtype, dq.device) == ((b, hq, lq, d), dtype, CUDA)
        for g in (dk, dv):  # per key/value head, or per query head (then summed over the group)
            assert g.shape[1] in (hkv, hq) and g.dtype == dtype
            assert sdpa_backend._kv_heads(g, hkv).shape == (b, hkv, lk, d)


@pytest.mark.parametrize("dtype,d,fused", [
    (torch.bfloat16, 128, True), (torch.float16, 80, True), (torch.bfloat16, 256, True),
    (torch.float32, 128, False), (torch.bfloat16, 68, False), (torch.bfloat16, 512, False),
])  # fmt: skip
def test_sdpa_cuda_routes_only_what_the_fused_op_takes(dtype, d, fused):
    mode = fake_tensor.FakeTensorMode()
    with mode:
        q = _fake_cuda(mode, (1, 4, 64, d), dtype)
        assert sdpa_backend.runs_on_fused_ops(q, q) is fused
        # a value head_dim other than q's (multi-head latent attention) goes to the masked fallback
        assert not sdpa_backend.runs_on_fused_ops(q, _fake_cuda(mode, (1, 4, 64, d // 2), dtype))
