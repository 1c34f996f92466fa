"""The whole GPU check in one command: install, the GPU tests, the kernel and ring benchmarks, each phase
within its own time limit, everything it writes in one flat folder.

    python3 benchmarks/gpu_session.py --out "$OUT"            # about 8 minutes at most on one H100 / H200
    python3 benchmarks/gpu_session.py --out "$OUT" --only install longest --longest 524288
    python3 benchmarks/gpu_session.py --out DIR --dry-run     # CPU: every phase on tiny shapes (the tests)

Sized for a device lease of 15 minutes with 10 minutes per command: the default phases' limits add up to
470 s, so one call ends with time left to rerun a phase. A phase that runs over its limit is stopped
(its whole process group); the rows it finished are already in its CSV file (the benchmarks append each
row as they measure it) and the next phase starts. ``longest`` (one forward + backward of a Llama-3.1-8B
shape at ``--longest`` tokens, chunked loss and offload) takes minutes at 512K tokens: it runs only when
asked for, best in a call of its own.

Written under ``--out`` (flat, at most 8 files, as the device tool brings them back):
``session.log`` (each phase's command, output, exit status and seconds), ``summary.csv`` (one row per
phase), ``bench_kernel.csv``, ``bench_ring_sim.csv`` and ``longest_gpu.csv``. What the phases print is
also summed up on stdout. The exit status is 0 when every phase passed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _cpu import append_rows

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SUMMARY = ["date", "device", "phase", "status", "seconds", "limit_s", "command"]
#: The benchmarks' shape for a dry run: fp32 in Triton's interpreter, 2 query heads on 1 key/value head.
TINY = ["--device", "cpu", "--dtype", "fp32", "--q-heads", "2", "--kv-heads", "1"]


def phases(args) -> list[tuple[str, list[str], int]]:
    """(name, command, limit in seconds) of every phase, in order; the shapes are the issue's targets
    (bf16, 32 query : 8 key/value heads, head_dim 128, zig-zag, 8 virtual ranks of 8K tokens)."""
    py, out = sys.executable, str(args.out)
    if args.dry_run:
        kernel = [*TINY, "--seqlens", "32", "--head-dims", "16", "--kinds", "causal", "--passes", "fwd+bwd"]
        ring = [*TINY, "--ranks", "2", "--tokens", "16", "--head-dim", "16"]
        longest = ["--dry-run", "--dry-run-budget", str(args.longest or 64), "--start", "64", "--step", "16"]
        tests = [str(REPO / "tests" / "test_gpu_hot_path.py")]
    else:
        kernel = ["--seqlens", "4096", "16384", "--head-dims", "128"]
        ring = ["--ranks", "8", "--tokens", "8192"]
        n = str(args.longest or 0)
        longest = ["--start", n, "--limit", n, "--step", n]
        tests = [str(REPO / "tests")]
    every = [
        (
            "env",
            [
                py,
                "-c",
                "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, "
                "triton.__version__, transformers.__version__); print(torch.cuda.get_device_name() "
                "if torch.cuda.is_available() else 'no CUDA device')",
            ],
            30,
        ),  # fmt: skip
        ("install", [py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(REPO)], 60),
        ("tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *tests], 180),
        ("bench_kernel", [py, str(BENCH / "bench_kernel.py"), *kernel, "--results-dir", out], 80),
        ("bench_ring_sim", [py, str(BENCH / "bench_ring_sim.py"), *ring, "--results-dir", out], 120),
        (
            "longest",
            [py, str(BENCH / "bench_longest_gpu.py"), "--configs", "chunked+offload", *longest, "--results-dir", out],
            540,
        ),  # fmt: skip
    ]
    wanted = args.only or [name for name, _, _ in every if name != "longest" or args.longest]
    if args.dry_run:
        wanted = [name for name in wanted if name != "install"]  # the dry run uses the installed checkout
    return [p for p in every if p[0] in wanted]


def run_phase(name: str, cmd: list[str], limit: int, log: Path, env: dict | None = None) -> tuple[str, float]:
    """Run ``cmd`` with its output appended to ``log``; stop its process group after ``limit`` seconds.
    Returns the status (``ok``, ``exit N`` or ``timeout``) and the seconds it ran."""
    with log.open("a") as f:
        f.write(f"\n===== {name}: {' '.join(cmd)} (limit {limit} s)\n")
        f.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
        seconds = time.monotonic() - t0
        f.write(f"===== {name}: {status} after {seconds:.1f} s\n")
    return status, seconds


def stage(root: Path = REPO) -> None:
    """Where ``pip install`` cannot run (no build backend, no registry): the link ``hf_ring/patches`` ->
    ``patches/`` in the checkout at ``root``, so ``hf_ring.patches`` imports from the tree as it does installed
    (with ``root`` on ``PYTHONPATH``; the tests put it first on their path anyway)."""
    link = root / "hf_ring" / "patches"
    if not link.is_symlink():
        link.symlink_to(Path("..") / "patches", target_is_directory=True)


def _tail(log: Path, start: int, lines: int = 25) -> str:
    """The last ``lines`` lines ``log`` gained after byte ``start``."""
    with log.open("rb") as f:
        f.seek(start)
        return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the log and the CSV files ($OUT)")
    p.add_argument(
        "--only", nargs="+", choices=["env", "install", "tests", "bench_kernel", "bench_ring_sim", "longest"]
    )
    p.add_argument("--longest", type=int, help="the longest phase's sequence length in tokens (runs it)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter: checks the plumbing")
    args = p.parse_args(argv)
    if args.only and "longest" in args.only and not args.longest:
        p.error("the longest phase needs --longest TOKENS")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "session.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    device = "cpu (dry run)" if args.dry_run else _device_name()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    planned = phases(args)
    print(
        f"{device}: phases {', '.join(n for n, _, _ in planned)} within {sum(s for _, _, s in planned)} s", flush=True
    )
    failed = []
    for name, cmd, limit in planned:
        start = log.stat().st_size if log.exists() else 0
        status, seconds = run_phase(name, cmd, limit, log, env)
        if name == "install" and status != "ok":  # import the checkout in place instead
            stage(REPO)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
            with log.open("a") as f:
                f.write(f"===== install: pip gave {status}; hf_ring imported from {REPO} (hf_ring/patches linked)\n")
            status = f"staged ({status} from pip)"
        append_rows(args.out / "summary.csv", SUMMARY, [{"date": date, "device": device, "phase": name,
                    "status": status, "seconds": f"{seconds:.1f}", "limit_s": limit, "command": " ".join(cmd)}])  # fmt: skip
        print(f"\n----- {name}: {status} in {seconds:.1f} s (limit {limit} s)\n{_tail(log, start)}", flush=True)
        if status != "ok" and not status.startswith("staged"):
            failed.append(name)
    print(f"\nfailed: {', '.join(failed)}" if failed else "\nevery phase passed")
    return 1 if failed else 0


def _device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except Exception as e:  # noqa: BLE001 - the env phase reports the details
        return f"torch not importable ({type(e).__name__})"


if __name__ == "__main__":
    sys.exit(main())
