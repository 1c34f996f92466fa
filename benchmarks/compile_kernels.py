"""Compile the Triton ring-step kernels for NVIDIA GPUs on any machine, no GPU needed.

For every CUDA tile configuration of ``hf_ring.kernels.triton_backend`` (the table for the chosen
architecture), each kernel (forward, dQ, dK/dV) is compiled ahead of time for that architecture
with every mask feature on (causal, sliding window, documents: the largest variant), with the
argument specialisation a real launch gets (contiguous last dimension, 16-aligned pointers and
strides). Triton's wheel ships ``ptxas`` and ``cuobjdump``, so this runs on a CPU-only machine.
Printed per kernel: shared memory, registers per thread and stack bytes (spills live there);
exit status 1 when a kernel fails to compile or needs more shared memory than its target has.

    python benchmarks/compile_kernels.py                          # sm_90, sm_80, sm_86; bf16 and fp32
    python benchmarks/compile_kernels.py --arch 90 --dtypes bf16 --head-dims 128

Do not set ``TRITON_INTERPRET`` for this script: the interpreter replaces the compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time

#: Shared memory per block (opt-in maximum, bytes) by compute capability.
SMEM_LIMIT = {90: 232448, 100: 232448, 80: 166912, 86: 101376, 89: 101376, 120: 101376}
#: Pointer arguments of the kernels: inputs in the input dtype, positions int32, the rest fp32.
_PTR_DTYPE = {"Q": "in", "K": "in", "V": "in", "DO": "in", "QPOS": "i32", "KPOS": "i32", "QDOC": "i32", "KDOC": "i32",
              "OUT": "fp32", "LSE": "fp32", "DELTA": "fp32", "DQ": "fp32", "DK": "fp32", "DV": "fp32",
              "SLOPES": "fp32"}  # fmt: skip


@dataclasses.dataclass
class Report:
    arch: int
    dtype: str
    head_dim: int
    kernel: str
    tiles: str
    shared: int = 0
    registers: int = -1
    stack: int = -1
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.shared <= SMEM_LIMIT[self.arch]

    def line(self) -> str:
        head = f"sm_{self.arch:<3d} {self.dtype:4s} d={self.head_dim:<3d} {self.kernel:5s} {self.tiles:22s}"
        if self.error:
            return f"{head} FAILED: {self.error}"
        fit = "ok" if self.ok else f"OVER {SMEM_LIMIT[self.arch]}"
        return (f"{head} shared={self.shared:6d} ({fit}) registers={self.registers:3d} "
                f"stack={self.stack:4d} B  [{self.seconds:.1f} s]")  # fmt: skip


def _signature(fn, dtype: str, constexprs: dict):
    """Triton signature and attributes of ``fn`` as a launch with contiguous, aligned tensors sees it."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _PTR_DTYPE:
            sig[name] = "*" + {"in": dtype, "i32": "i32", "fp32": "fp32"}[_PTR_DTYPE[name]]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and not name.endswith("doc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _unit_strides(fn) -> dict:
    """Strides a contiguous launch passes as 1 (Triton specialises them): last dimension, LSE rows."""
    unit = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_gd", "stride_dkd", "stride_dvd", "stride_lm"}
    return {name: 1 for name in fn.arg_names if name in unit}


def _resources(cubin: bytes, cuobjdump: str) -> tuple[int, int]:
    """(registers, stack bytes) of the single kernel in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def compile_kernel(fn, arch: int, dtype: str, constexprs: dict, warps: int, stages: int):
    """Compile one kernel for ``sm_<arch>``: ``(shared bytes, registers, stack bytes)``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**constexprs, **_unit_strides(fn)}
    sig, attrs = _signature(fn, dtype, constexprs)
    kernel = triton.compile(
        ASTSource(fn, sig, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    registers, stack = _resources(kernel.asm["cubin"], cuobjdump) if os.path.exists(cuobjdump) else (-1, -1)
    return int(kernel.metadata.shared), registers, stack


def reports(
    arch: int, dtype: str, head_dim: int, kernels=("fwd", "dq", "dkdv"), config=None, softcap=None, v_head_dim=None,
    alibi: bool = False,
):  # fmt: skip
    """Compile the three kernels of one (arch, dtype, head_dim) cell: yields a ``Report`` per kernel.

    ``softcap``: compile the attention-logit-softcapping variant (a compile-time option) with that cap.
    ``alibi``: compile the ALiBi variant (another compile-time option).
    ``v_head_dim``: the values' head_dim when it differs (multi-head latent attention; the config is chosen for the
    larger of the two, as ``triton_backend`` does)."""
    import torch

    from hf_ring.kernels import triton_backend, triton_bwd, triton_fwd

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    dv = v_head_dim or head_dim
    cfg = config or triton_backend.cuda_config(divmod(arch, 10), torch_dtype, max(head_dim, dv))
    base = dict(**triton_fwd.head_dims(head_dim, dv), SCAN=cfg.scan,
                CAUSAL=True, HAS_WINDOW=True, HAS_DOCS=True, UPCAST=cfg.upcast or dtype == "fp32",
                SOFTCAP=triton_fwd.softcap_constexpr(softcap), ALIBI=bool(alibi))  # fmt: skip
    plan = {
        "fwd": (triton_fwd._fwd_kernel, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages),
        "dq": (triton_bwd._dq_kernel, cfg.dq_block_m, cfg.dq_block_n, cfg.dq_num_warps, cfg.dq_num_stages),
        "dkdv": (triton_bwd._dkdv_kernel, cfg.dkv_block_m, cfg.dkv_block_n, cfg.dkv_num_warps, cfg.dkv_num_stages),
    }
    for name in kernels:
        fn, m, n, warps, stages = plan[name]
        cap = ("" if softcap is None else f" cap{softcap:g}") + ("" if dv == head_dim else f" dv{dv}")
        cap += " alibi" if alibi else ""
        rep = Report(arch, dtype, head_dim, name, f"M{m} N{n} w{warps} s{stages}{cap}")
        t0 = time.perf_counter()
        try:
            rep.shared, rep.registers, rep.stack = compile_kernel(
                fn, arch, dtype, dict(base, BLOCK_M=m, BLOCK_N=n), warps, stages
            )
        except Exception as e:  # a compile failure is a finding, reported and counted
            rep.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
        rep.seconds = time.perf_counter() - t0
        yield rep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80, 86], choices=sorted(SMEM_LIMIT))
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--kernels", nargs="+", default=["fwd", "dq", "dkdv"], choices=["fwd", "dq", "dkdv"])
    p.add_argument("--softcap", type=float, default=None, help="compile the logit-softcapping variant with this cap")
    p.add_argument("--v-head-dim", type=int, default=None, help="the values' head_dim, when it differs (MLA)")
    p.add_argument("--alibi", action="store_true", help="compile the ALiBi variant (slopes per head)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler this script reports on")
        return 2
    import triton

    print(f"triton {triton.__version__}; all mask features on; limits: shared memory per block")
    failed = 0
    for arch in args.arch:
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                for rep in reports(
                    arch, dtype, head_dim, args.kernels, softcap=args.softcap, v_head_dim=args.v_head_dim,
                    alibi=args.alibi,
                ):  # fmt: skip
                    print(rep.line(), flush=True)
                    failed += not rep.ok
    print(f"{failed} kernel(s) failed or do not fit" if failed else "every kernel compiled and fits")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
