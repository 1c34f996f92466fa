"""The ``"triton"`` backend: fused Triton kernels for the local block of one ring step.

Same contract as ``torch_backend`` (``forward`` merges into fp32 ``out`` / natural-log ``lse`` in
place; ``backward`` accumulates into fp32 ``dq`` / ``dk`` / ``dv``). The kernels live in
``triton_fwd`` (forward with the merge fused into its epilogue) and ``triton_bwd`` (dQ and dK/dV);
this module picks a tile configuration, validates shapes and registers the launchers as
``torch.library`` custom ops (``hf_ring::ring_step_fwd``, ``hf_ring::ring_step_bwd``) with fake
implementations, so code calling ``ring_attention`` can be traced by ``torch.compile``.

Devices: CUDA tensors run compiled kernels. CPU tensors run in Triton's interpreter, which is only
available when ``TRITON_INTERPRET=1`` was set before ``triton`` was imported (tests do this); then
a small tile configuration with fp32 arithmetic is used (the interpreter has no bf16 math).
float64 inputs are delegated to ``torch_backend``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton

from . import torch_backend
from .mask import BlockMask
from .triton_bwd import _dq_kernel, bwd_launch
from .triton_fwd import fwd_launch

__all__ = [
    "ALIBI", "SOFTCAP", "KernelConfig", "backward", "cuda_config", "default_config", "forward", "interpreted", "unsupported",
]  # fmt: skip

SOFTCAP = True  # attention logit softcapping, a compile-time option of the kernels
ALIBI = True  # ALiBi's slopes (``bias=`` [q_heads]), a compile-time option of the kernels


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of the three kernels (tiles: powers of two, at least 16).

    block_m / block_n: query / key tile of the forward kernel. dq_block_m / dq_block_n: the dQ
    kernel. dkv_block_n / dkv_block_m: key tile held by a dK/dV program / query tile it walks.
    scan: tiles classified per step of the in-kernel scan. upcast: convert tiles to fp32 before
    every dot (always on for fp32 inputs; required in the interpreter).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    dq_block_m: int = 128
    dq_block_n: int = 32
    dq_num_warps: int = 8
    dq_num_stages: int = 3
    dkv_block_n: int = 128
    dkv_block_m: int = 32
    dkv_num_warps: int = 8
    dkv_num_stages: int = 2
    scan: int = 16
    upcast: bool = False

    def __post_init__(self):
        for f in ("block_m", "block_n", "dq_block_m", "dq_block_n", "dkv_block_n", "dkv_block_m", "scan"):
            n = getattr(self, f)
            if n < 1 or n & (n - 1) or (f != "scan" and n < 16):
                raise ValueError(f"KernelConfig.{f} must be a power of two (>= 16 for tiles), got {n}")

    def to_list(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values) -> KernelConfig:
        kw = dict(zip([f.name for f in dataclasses.fields(cls)], values))
        return cls(**{**kw, "upcast": bool(kw["upcast"])})


def _cfg(fwd, dq, dkv, scan=16, upcast=False) -> KernelConfig:
    """From ``(block_m, block_n, warps, stages)`` of the forward, ``(m, n, ...)`` of dQ, ``(n, m, ...)`` of dK/dV."""
    names = ("block_m", "block_n", "num_warps", "num_stages", "dq_block_m", "dq_block_n", "dq_num_warps",
             "dq_num_stages", "dkv_block_n", "dkv_block_m", "dkv_num_warps", "dkv_num_stages")  # fmt: skip
    return KernelConfig(**dict(zip(names, (*fwd, *dq, *dkv))), scan=scan, upcast=upcast)


#: The interpreter config: small tiles so that test shapes span several tiles, fp32 arithmetic.
INTERPRETER_CONFIG = _cfg((32, 16, 1, 1), (32, 16, 1, 1), (32, 16, 1, 1), scan=4, upcast=True)

# CUDA configs by (input class, padded head_dim). Each one compiles for its targets within their
# shared memory (sm_90 / sm_80 / sm_100: large, >= 160 KiB per block; sm_86 / sm_89 / sm_120: small,
# ~99 KiB); `benchmarks/compile_kernels.py` reports shared memory, registers and stack per kernel.
# fp16/bf16: FlashAttention-2-style tiles. fp32 (IEEE dots, FMA, register-hungry): small tiles
# chosen for the least stack use (register spills) on Triton 3.6 and 3.9, one table for all.
_FP32 = {
    ("fp32", 64): _cfg((32, 16, 4, 2), (32, 16, 4, 2), (64, 16, 4, 1)),
    ("fp32", 128): _cfg((32, 16, 4, 1), (32, 16, 4, 1), (32, 16, 4, 1)),
    ("fp32", 256): _cfg((16, 16, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1)),
}
_LARGE_SMEM = {
    ("half", 64): _cfg((128, 64, 4, 3), (128, 32, 4, 3), (128, 32, 8, 2)),
    ("half", 128): _cfg((128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 2)),
    ("half", 256): _cfg((64, 64, 8, 2), (32, 32, 4, 1), (32, 32, 4, 1)),
    **_FP32,
}
_SMALL_SMEM = {
    ("half", 64): _cfg((128, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 2)),
    ("half", 128): _cfg((64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 2)),
    ("half", 256): _cfg((64, 32, 4, 1), (32, 32, 4, 1), (32, 32, 4, 1)),
    **_FP32,
}


def default_config(device: torch.device, dtype: torch.dtype, head_dim: int) -> KernelConfig:
    """The tile configuration for inputs of ``dtype`` and ``head_dim`` on ``device``.

    CPU means the interpreter (``INTERPRETER_CONFIG``). On CUDA: 128x64 forward tiles and the
    FlashAttention-2 backward split (dQ 128x32, dK/dV 128x32) for fp16/bf16 and head_dim <= 128;
    smaller tiles for head_dim 256 and for GPUs with ~99 KiB of shared memory per block (consumer
    parts); small spill-free tiles for fp32 inputs (IEEE fp32 dots).
    """
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return cuda_config(torch.cuda.get_device_capability(device), dtype, head_dim)


def cuda_config(capability: tuple[int, int], dtype: torch.dtype, head_dim: int) -> KernelConfig:
    """The tile configuration on a GPU of compute ``capability`` (e.g. ``(9, 0)``), no GPU needed."""
    d = min(256, max(64, triton.next_power_of_2(head_dim)))
    kind = "fp32" if dtype == torch.float32 else "half"
    large = tuple(capability) in ((8, 0), (9, 0), (10, 0))
    return (_LARGE_SMEM if large else _SMALL_SMEM)[(kind, d)]


def interpreted() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1`` was set before import)."""
    return type(_dq_kernel).__name__ == "InterpretedFunction"


def _on_device(x: torch.Tensor):
    """Triton launches on the current CUDA device and stream: the tensors' device for the launch (a process whose
    model sits on ``cuda:1`` without ``torch.cuda.set_device(1)``); nothing on CPU."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("hf_ring::ring_step_fwd", mutates_args=("out", "lse"))
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: int | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: list[int],
    softcap: float | None = None,
    blocks: bool = False,
    slopes: torch.Tensor | None = None,
) -> None:
    cfg = KernelConfig.from_list(config)
    with _on_device(q):
        pos = (q_pos, k_pos, q_doc, k_doc)
        fwd_launch(q, k, v, pos, scale, causal, window, out, lse, cfg, softcap, blocks, slopes)


@_fwd_op.register_fake
def _fwd_fake(
    q, k, v, q_pos, k_pos, q_doc, k_doc, scale, causal, window, out, lse, config, softcap=None, blocks=False,
    slopes=None,
) -> None:  # fmt: skip
    return None


@torch.library.custom_op("hf_ring::ring_step_bwd", mutates_args=("dq", "dk", "dv"))
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    scale: float,
    causal: bool,
    window: int | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    config: list[int],
    softcap: float | None = None,
    blocks: bool = False,
    slopes: torch.Tensor | None = None,
) -> None:
    cfg = KernelConfig.from_list(config)
    pos = (q_pos, k_pos, q_doc, k_doc)
    with _on_device(q):
        bwd_launch(do, q, k, v, lse, delta, pos, scale, causal, window, dq, dk, dv, cfg, softcap, blocks, slopes)


@_bwd_op.register_fake
def _bwd_fake(
    do, q, k, v, lse, delta, q_pos, k_pos, q_doc, k_doc, scale, causal, window, dq, dk, dv, config, softcap=None,
    blocks=False, slopes=None,
) -> None:  # fmt: skip
    return None


# --------------------------------------------------------------------------- public API


def unsupported(q, k, v) -> str | None:
    """Why this backend cannot run these inputs, or None (the ring falls back from ``"auto"`` on a reason)."""
    widest = max(q.shape[-1], v.shape[-1])
    if widest > 256:
        return f"head_dim {widest} is above 256"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32)"
    if q.device.type == "cpu" and not interpreted():
        return (
            "CPU tensors run only in Triton's interpreter, which is off (set TRITON_INTERPRET=1 before "
            "triton is first imported, or use CUDA tensors)"
        )
    if q.device.type not in ("cpu", "cuda"):
        return f"device type {q.device.type!r} is not supported (CUDA, or CPU in Triton's interpreter)"
    # inside the ring, keys and values of their own head_dim are views of one [..., D + Dv] message
    row = q.shape[3] if v.shape[3] == q.shape[3] else q.shape[3] + v.shape[3]
    if max(q.shape[2], k.shape[2]) * row >= INT32_LIMIT:
        return "a (batch, head) slice holds 2**31 or more elements, beyond the kernels' int32 offsets"
    return None


def _check(q, k, v, mask: BlockMask, acc: dict) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"expected q [B, Hq, Lq, D], k [B, Hkv, Lk, D] and v [B, Hkv, Lk, Dv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    b, hq, lq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (batch, head_dim, q_heads % kv_heads)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask.q_pos.numel() != lq or mask.k_pos.numel() != k.shape[2]:
        raise ValueError(f"mask positions ({mask.q_pos.numel()}, {mask.k_pos.numel()}) do not match the "
                         f"query / key lengths ({lq}, {k.shape[2]})")  # fmt: skip
    for name, (t, shape) in acc.items():
        if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{name} must be fp32 {shape} on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    reason = unsupported(q, k, v)
    if reason is not None:
        raise ValueError(f"the triton backend cannot run these inputs: {reason}; use backend='torch'")


#: The kernels add (row, column) offsets inside one (batch, head) slice in int32 (the batch and head
#: offsets are int64); a slice reaching this far is copied to the contiguous layout first.
INT32_LIMIT = 2**31


def _slice_span(t: torch.Tensor) -> int:
    """Largest element offset inside one (batch, head) slice of a [B, H, L, D] tensor."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape[2:], t.stride()[2:]) if n > 0)


def _int32_safe(*tensors, copy: bool = True):
    """The tensors, each copied to the contiguous [B, H, L, D] layout if its (batch, head) slice
    spans more elements than int32 offsets reach (e.g. a [B, L, H, D] view with very long L).

    ``copy=False`` (accumulators, updated in place) raises instead of copying.
    """
    out = []
    for t in tensors:
        if copy and _slice_span(t) >= INT32_LIMIT:
            t = t.contiguous()
        if _slice_span(t) >= INT32_LIMIT:
            raise ValueError(
                f"a {tuple(t.shape)} tensor with strides {t.stride()} spans 2**31 or more elements per "
                "(batch, head): too long for the triton backend's int32 offsets; use more ranks or "
                "backend='torch'"
            )
        out.append(t)
    return out


def _positions(mask: BlockMask, device: torch.device, batch: int):
    if torch.compiler.is_compiling():
        # No side effect on the mask's cache while dynamo traces: a tensor stored there from inside a
        # traced autograd.Function breaks the trace. The copies become part of the graph instead.
        fields = ("q_pos", "k_pos", "q_doc", "k_doc")
        t = {
            f: None if getattr(mask, f) is None else getattr(mask, f).to(device, torch.int32).contiguous()
            for f in fields
        }
    else:
        t = mask.device_tensors(device)
    q_doc, k_doc = t["q_doc"], t["k_doc"]
    if q_doc is not None:
        for doc in (q_doc, k_doc):
            if doc.dim() != 2 or doc.shape[0] not in (1, batch):
                raise ValueError(f"document ids must be [1 or batch={batch}, L], got {tuple(doc.shape)}")
    return t["q_pos"], t["k_pos"], q_doc, k_doc


def _slopes(bias, q) -> torch.Tensor | None:
    """ALiBi's slopes for the kernels ([q_heads] fp32 on q's device), or None; ValueError for a bias by distance (a
    table: the torch backend's, ``ring._biasing`` sends it there)."""
    if bias is None:
        return None
    if bias.dim() != 1:
        raise ValueError("the triton backend takes ALiBi's slopes ([q_heads]), not a bias by distance; use 'torch'")
    return bias.to(q.device, torch.float32).contiguous()


def forward(
    q, k, v, mask: BlockMask, scale: float, out: torch.Tensor, lse: torch.Tensor, *, config=None, softcap=None,
    bias=None,
):  # fmt: skip
    """Attend ``q`` to one key/value block and merge into the accumulators in place.

    q: [batch, q_heads, local_q, head_dim]; k: [batch, kv_heads, local_k, head_dim]; v: [batch, kv_heads,
    local_k, v_head_dim] (fp16 / bf16 / fp32, any strides). out: [batch, q_heads, local_q, v_head_dim] fp32;
    lse: [batch, q_heads, local_q] fp32 natural-log, ``-inf`` for rows that saw nothing yet.
    config: a ``KernelConfig`` overriding ``default_config``. softcap: attention logit softcapping
    (a compile-time option of the kernels; None compiles it out). bias: None, or ALiBi's slopes [q_heads] (the
    score gets ``-slope * (q_pos - k_pos)``; a compile-time option too). Returns ``(out, lse)``.
    """
    if q.dtype == torch.float64:
        return torch_backend.forward(q, k, v, mask, scale, out, lse, softcap=softcap, bias=bias)
    slopes = _slopes(bias, q)
    b, hq, lq, d = q.shape
    _check(q, k, v, mask, {"out": (out, (b, hq, lq, v.shape[-1])), "lse": (lse, (b, hq, lq))})
    if lq == 0 or k.shape[2] == 0:
        return out, lse
    q_pos, k_pos, q_doc, k_doc = _positions(mask, q.device, b)
    cfg = config or default_config(q.device, q.dtype, max(d, v.shape[-1]))
    q, k, v = _int32_safe(q, k, v)
    _int32_safe(out, copy=False)
    _fwd_op(
        q, k, v, q_pos, k_pos, q_doc, k_doc, float(scale), bool(mask.causal), mask.window, out, lse, cfg.to_list(),
        None if softcap is None else float(softcap), bool(mask.blocks and q_doc is not None), slopes,
    )  # fmt: skip
    return out, lse


def backward(
    do,
    q,
    k,
    v,
    lse,
    delta,
    mask: BlockMask,
    scale: float,
    dq,
    dk,
    dv,
    *,
    out=None,
    config=None,
    softcap=None,
    bias=None,
    dbias=None,
):
    """Accumulate the gradients of one block into ``dq``, ``dk``, ``dv`` (fp32) in place (``out`` unused).

    q: [batch, q_heads, local_q, head_dim]; do: [batch, q_heads, local_q, v_head_dim]; k, v: as in ``forward``.
    lse: [batch, q_heads, local_q] fp32, the final (global) LSE (``-inf``: the row saw nothing, its
    gradients are 0); delta = rowsum(dO * O), same shape. dq: like q, fp32; dk: like k, dv: like v, fp32.
    softcap, bias: as in ``forward`` (ALiBi's slopes take no gradient: ``dbias`` must be None). Returns
    ``(dq, dk, dv)``.
    """
    if dbias is not None:
        raise ValueError("the triton backend computes no bias gradient (ALiBi's slopes are fixed); use 'torch'")
    if q.dtype == torch.float64:
        return torch_backend.backward(do, q, k, v, lse, delta, mask, scale, dq, dk, dv, softcap=softcap, bias=bias)
    slopes = _slopes(bias, q)
    b, hq, lq, d = q.shape
    acc = {
        "lse": (lse, (b, hq, lq)), "delta": (delta, (b, hq, lq)),
        "dq": (dq, (b, hq, lq, d)), "dk": (dk, tuple(k.shape)), "dv": (dv, tuple(v.shape)),
    }  # fmt: skip
    _check(q, k, v, mask, acc)
    want = (b, hq, lq, v.shape[-1])
    if do.shape != want or do.dtype != q.dtype:
        raise ValueError(f"do must be {q.dtype} {want} (q's rows, v's head_dim), got {do.dtype} {tuple(do.shape)}")
    if lq == 0 or k.shape[2] == 0:
        return dq, dk, dv
    q_pos, k_pos, q_doc, k_doc = _positions(mask, q.device, b)
    cfg = config or default_config(q.device, q.dtype, max(d, v.shape[-1]))
    lse, delta = lse.contiguous(), delta.contiguous()  # the kernels read both with lse's strides
    do, q, k, v = _int32_safe(do, q, k, v)
    _int32_safe(dq, dk, dv, copy=False)
    _bwd_op(
        do, q, k, v, lse, delta, q_pos, k_pos, q_doc, k_doc, float(scale), bool(mask.causal), mask.window,
        dq, dk, dv, cfg.to_list(), None if softcap is None else float(softcap), bool(mask.blocks and q_doc is not None),
        slopes,
    )  # fmt: skip
    return dq, dk, dv
