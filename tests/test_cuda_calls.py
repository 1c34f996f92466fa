"""The CUDA calls of the ``sdpa`` and ``cudnn`` backends, checked on any machine.

- ``FakeTensorMode`` runs PyTorch's registered meta kernels for ``cuda`` tensors without a GPU: our calls
  to the flash, memory-efficient and cuDNN attention ops and their backwards are checked against the
  installed PyTorch's op schemas (argument count and types), and the outputs we take from them against
  their shapes and dtypes (with GQA, with values of their own head_dim, with the strided tensors
  Transformers hands over).
- The glue around the ops whose layouts differ from the flash op's (the memory-efficient op's LSE rows
  padded to a multiple of 32, cuDNN's ``[B, H, L, 1]`` LSE, neither taking GQA) runs on CPU against
  stand-ins of those ops with exactly those layouts, written here from the meta kernels' shapes; the
  stand-ins refuse anything else (fewer key/value heads, an LSE of another shape, cuDNN's strided inputs, an output
  and its gradient given to the memory-efficient backward in another layout than its forward returns).
  Numbers of the real ops on CUDA: test_gpu_hot_path.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_ring
from hf_ring.kernels import cudnn_backend, sdpa_backend, triton_importable
from hf_ring.kernels.mask import BlockMask

from .reference import steps_match_torch_backend

fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor")
CUDA = torch.device("cuda", 0)
CUDA_OPS = {"flash": sdpa_backend.FLASH, "efficient": sdpa_backend.EFFICIENT, "cudnn": sdpa_backend.CUDNN}


def _fake_cuda(mode, shape, dtype, transposed=False):
    """A fake CUDA tensor of ``shape``; ``transposed``: a [b, s, h, d] tensor seen as [b, h, s, d]."""
    if transposed:
        b, h, s, d = shape
        meta = torch.empty((b, s, h, d), dtype=dtype, device="meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, CUDA).transpose(1, 2)
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, CUDA)


@pytest.mark.parametrize("op", list(CUDA_OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_cuda_op_calls_match_the_op_schemas(op, dtype, heads, causal, transposed):
    hq, hkv = heads
    b, lq, lk, d = 2, 72, 72 if causal else 160, 128  # 72: the efficient op's LSE has 96 rows
    fused = CUDA_OPS[op]
    mode = fake_tensor.FakeTensorMode()
    with mode:
        q = _fake_cuda(mode, (b, hq, lq, d), dtype, transposed)
        k, v = (_fake_cuda(mode, (b, hkv, lk, d), dtype, transposed) for _ in range(2))
        assert fused.takes(q, v)
        out, lse = fused.fwd(q, k, v, causal, 0.09)
        assert (out.shape, out.dtype, out.device) == ((b, hq, lq, d), dtype, CUDA)
        assert (lse.shape, lse.dtype, lse.device) == ((b, hq, lq), torch.float32, CUDA)
        do = _fake_cuda(mode, (b, hq, lq, d), dtype, transposed)
        dq, dk, dv = fused.bwd(do, q, k, v, out, lse, causal, 0.09)
        assert (dq.shape, dq.dtype, dq.device) == ((b, hq, lq, d), dtype, CUDA)
        for g in (dk, dv):  # per key/value head, or per query head (then summed over the group)
            assert g.shape[1] in (hkv, hq) and g.dtype == dtype
            assert sdpa_backend._kv_heads(g, hkv).shape == (b, hkv, lk, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_efficient_op_takes_values_of_their_own_head_dim(dtype):
    mode = fake_tensor.FakeTensorMode()
    with mode:
        q, k = (_fake_cuda(mode, (1, 4, 40, 192), dtype) for _ in range(2))
        v = _fake_cuda(mode, (1, 4, 40, 128), dtype)
        assert sdpa_backend.fused_op(q, v).name == "efficient"
        out, lse = sdpa_backend.EFFICIENT.fwd(q, k, v, True, 0.1)
        assert out.shape == (1, 4, 40, 128) and lse.shape == (1, 4, 40)
        dq, dk, dv = sdpa_backend.EFFICIENT.bwd(out, q, k, v, out, lse, True, 0.1)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("dtype,d,sdpa,cudnn", [
    (torch.bfloat16, 128, "flash", "cudnn"), (torch.float16, 80, "flash", "cudnn"),
    (torch.bfloat16, 256, "flash", "flash"), (torch.float32, 128, "efficient", "efficient"),
    (torch.bfloat16, 68, None, None), (torch.bfloat16, 512, None, None), (torch.float64, 64, None, None),
])  # fmt: skip
def test_cuda_routes_each_step_to_the_first_op_that_takes_it(dtype, d, sdpa, cudnn):
    pos = torch.arange(64)
    diagonal, windowed = BlockMask(q_pos=pos, k_pos=pos, causal=True), BlockMask(q_pos=pos, k_pos=pos, window=16)
    fallback = "triton" if triton_importable() else "torch"
    assert diagonal.pieces() == [("causal", slice(0, 64), slice(0, 64))]  # (cached: the fake mode runs no real op)
    mode = fake_tensor.FakeTensorMode()
    with mode:
        q = _fake_cuda(mode, (1, 4, 64, d), dtype)
        for backend, want in (("sdpa", sdpa), ("cudnn", cudnn)):
            op = sdpa_backend.fused_op(q, q, backend)
            assert (op and op.name) == want, backend
            # what the benchmarks record: the op, or the fallback where no op takes the inputs or the mask
            assert sdpa_backend.step_op(q, q, diagonal, backend=backend) == (want or fallback)
            assert sdpa_backend.step_op(q, q, windowed, backend=backend) == fallback
            assert sdpa_backend.step_op(q, q, diagonal, softcap=30.0, backend=backend) == fallback
        # values of another head_dim: only the memory-efficient op
        other = sdpa_backend.fused_op(q, _fake_cuda(mode, (1, 4, 64, d // 2), dtype))
        assert (other and other.name) == ("efficient" if sdpa and d // 2 % 8 == 0 else None)


def test_cudnn_backend_refuses_cpu_tensors_by_name():
    q = torch.randn(1, 2, 16, 8)
    assert "CUDA only" in cudnn_backend.unsupported(q, q, q)
    with pytest.raises(ValueError, match="cuDNN attention runs on CUDA only"):
        hf_ring.ring_attention(q, q, q, backend="cudnn")


# Stand-ins of the memory-efficient and cuDNN ops on CPU, with their layouts -------------------------------


def _attend(q, k, v, causal, scale):
    """fp32 scores (top-left causal mask) and their natural-log LSE."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return s, s.logsumexp(-1)


def _grads(do, q, k, v, out, lse, causal, scale):
    """The fused backward's math, given the global output and LSE of the rows."""
    s, _ = _attend(q, k, v, causal, scale)
    p = (s - lse[..., None]).exp()
    do, v = do.float(), v.float()
    ds = p * (do @ v.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
    dq, dk, dv = ds @ k.float() * scale, ds.transpose(-1, -2) @ q.float() * scale, p.transpose(-1, -2) @ do
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


class _StandIns:
    """``_aten`` for the memory-efficient and cuDNN ops: their signatures, LSE layouts and refusals."""

    def __init__(self):
        self.calls = 0

    def _check(self, q, k, v, contiguous):
        self.calls += 1
        assert q.shape[1] == k.shape[1] == v.shape[1], "neither op takes fewer key/value heads"
        assert not contiguous or all(x.is_contiguous() for x in (q, k, v))

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, lse_wanted, dropout, causal, *, scale):
        self._check(q, k, v, False)
        assert bias is None and lse_wanted and dropout == 0.0
        s, lse = _attend(q, k, v, causal, scale)
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), math.nan)  # the tail is unused
        padded[:, :, : lse.shape[2]] = lse
        out = (s - lse[..., None]).exp() @ v.float()
        return out.to(q.dtype), padded, torch.empty(()), torch.empty(())

    def _scaled_dot_product_efficient_attention_backward(
        self, do, q, k, v, bias, out, lse, seed, offset, dropout, wanted, causal, *, scale
    ):
        self._check(q, k, v, False)
        lq = q.shape[2]
        assert lse.shape == (*q.shape[:2], -(-lq // 32) * 32) and list(wanted) == [True, True, True, False]
        # its kernel reads out and dO with the row stride of its forward's output: [B, L, H, D] dense
        assert out.transpose(1, 2).is_contiguous() and do.transpose(1, 2).is_contiguous()
        return (*_grads(do, q, k, v, out, lse[:, :, :lq], causal, scale), None)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, lse_wanted, dropout, causal, debug, *, scale):
        self._check(q, k, v, True)
        assert bias is None and lse_wanted and dropout == 0.0 and not debug
        s, lse = _attend(q, k, v, causal, scale)
        out = (s - lse[..., None]).exp() @ v.float()
        return out.to(q.dtype), lse[..., None], None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_cudnn_attention_backward(
        self, do, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal, *, scale
    ):
        self._check(q, k, v, True)
        assert do.is_contiguous() and out.is_contiguous() and lse.shape == (*q.shape[:3], 1)
        assert (max_q, max_k) == (q.shape[2], k.shape[2])
        return _grads(do, q, k, v, out, lse[..., 0], causal, scale)


@pytest.mark.parametrize("op", ["efficient", "cudnn"])
@pytest.mark.parametrize("layout", hf_ring.LAYOUTS)
def test_glue_of_the_ops_with_their_own_lse_layouts(op, layout, monkeypatch):
    """Ring steps through the op's stand-in (GQA 4:2, strided inputs, rectangles of 12 and 24 rows: LSE rows
    padded) match the torch backend."""
    stand_ins = _StandIns()
    monkeypatch.setattr(sdpa_backend, "_aten", stand_ins)
    anywhere = CUDA_OPS[op]._replace(takes=lambda q, v: True)
    monkeypatch.setitem(sdpa_backend.OPS, "sdpa", (anywhere,))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 24, 4, 40, generator=g).transpose(1, 2)  # [B, L, H, D] seen as [B, H, L, D]
    k, v = (torch.randn(2, 24, 2, 40, generator=g).transpose(1, 2) for _ in range(2))
    do = torch.randn(2, 4, 24, 40, generator=g)
    steps_match_torch_backend(layout, q, k, v, do, (op,))
    assert stand_ins.calls > 0


@pytest.mark.parametrize("backend,device,want", [
    ("nccl", None, "cuda:0"),  # NCCL alone takes no CPU tensor: the current GPU
    ("nccl", "cuda:1", "cuda:1"),
    ("nccl", "cpu", "cuda:0"),
    ("cpu:gloo,cuda:nccl", None, "cpu"),  # a CPU backend beside NCCL: the CPU
    ("cpu:gloo,cuda:nccl", "cuda:1", "cuda:1"),
    ("gloo", "cuda:1", "cpu"),
])  # fmt: skip
def test_small_collectives_put_their_tensor_where_the_groups_backend_takes_it(backend, device, want, monkeypatch):
    """The pre-flight all-gather and the rotary embedding's all-reduce on a group of NCCL alone: on a GPU even when
    the caller has no GPU tensor (an error path where q is not a tensor), which NCCL needs."""
    from hf_ring import comm

    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ring = object.__new__(comm.RingComm)
    ring.group = None
    got = ring._collective_device(None if device is None else torch.device(device))
    assert got == torch.device(want)


def test_flash_backward_leaves_the_variable_length_arguments_undefined(monkeypatch):
    """PyTorch's CUDA flash backward runs its variable-length kernel whenever ``cum_seq_q`` is defined (an empty
    tensor too): dense steps must pass None, as the forward returns them."""
    seen = {}

    class Recording:
        def __getattr__(self, name):
            op = getattr(torch.ops.aten, name)

            def call(*args, **kwargs):
                seen[name] = args
                return op(*args, **kwargs)

            return call

    monkeypatch.setattr(sdpa_backend, "_aten", Recording())
    mode = fake_tensor.FakeTensorMode()
    with mode:
        q, k, v, do = (_fake_cuda(mode, (1, 4, 64, 128), torch.bfloat16) for _ in range(4))
        out, lse = sdpa_backend.FLASH.fwd(q, k, v, True, 0.1)
        sdpa_backend.FLASH.bwd(do, q, k, v, out, lse, True, 0.1)
    args = seen["_scaled_dot_product_flash_attention_backward"]
    assert args[6] is None and args[7] is None  # cum_seq_q, cum_seq_k
