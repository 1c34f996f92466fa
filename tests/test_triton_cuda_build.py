"""The CUDA tile configurations compile for Hopper and for consumer GPUs, on a machine without a GPU.

``benchmarks/compile_kernels.py`` compiles the forward, dQ and dK/dV kernels ahead of time with
Triton's own ``ptxas`` for a chosen architecture (every mask feature on) and reports shared memory,
registers and stack. This guards the GPU path in CI: a kernel change that stops compiling for
sm_90, or a configuration that needs more shared memory than the GPU has, fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

pytestmark = pytest.mark.skipif(
    not (NVIDIA_BIN / "ptxas").exists(), reason="this Triton build has no bundled ptxas (NVIDIA backend)"
)


def test_hopper_and_consumer_configs_compile_and_fit():
    """bf16 at head_dim 128 (the benchmark target) on sm_90, also with logit softcapping (Gemma2's cap) and with ALiBi
    (BLOOM's, MPT's), DeepSeek's multi-head latent attention (queries and keys 192, values 128) on sm_90, and the
    tightest case: head_dim 256 on sm_86."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = []
    cells = (("90", "128", []), ("90", "128", ["--softcap", "50"]), ("90", "128", ["--alibi"]),
             ("90", "192", ["--v-head-dim", "128"]), ("86", "256", []))  # fmt: skip
    for arch, head_dim, extra in cells:
        cmd = [sys.executable, "benchmarks/compile_kernels.py", "--arch", arch, "--dtypes", "bf16",
               "--head-dims", head_dim, *extra]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines += [ln for ln in proc.stdout.splitlines() if ln.startswith("sm_")]
    assert len(lines) == 15, "\n".join(lines)
    assert sum("cap50" in ln for ln in lines) == 3 and sum("dv128" in ln for ln in lines) == 3
    assert sum("alibi" in ln for ln in lines) == 3
    for line in lines:
        shared = int(re.search(r"shared=\s*(\d+) \(ok\)", line).group(1))
        registers = int(re.search(r"registers=\s*(\d+)", line).group(1))
        assert shared > 0 and 0 < registers <= 255, line
