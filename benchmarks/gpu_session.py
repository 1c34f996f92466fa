"""The whole GPU check in one command: install, the GPU tests, the kernel and ring benchmarks, each phase
within its own time limit, everything it writes in one flat folder.

    python3 benchmarks/gpu_session.py --out "$OUT"            # about 9 minutes at most on one H100 / H200
    python3 benchmarks/gpu_session.py --out "$OUT" --only install longest --longest 524288
    python3 benchmarks/gpu_session.py --out DIR --dry-run     # CPU: every phase on tiny shapes (the tests)

Sized for a device lease of 15 minutes with 10 minutes per command: the default phases' limits add up to
540 s, so one call fits a 10-minute command, and no plan over ``BUDGET_S`` (570 s) is started.
A phase that runs over its limit is stopped (its whole process group, also when the session itself is
stopped: no phase outlives the call); the rows it finished are already in its CSV file (the benchmarks
append each row as they measure it) and the next phase starts. ``longest`` (one forward + backward of a
Llama-3.1-8B shape at ``--longest`` tokens, chunked loss and offload) takes minutes at 512K tokens: it runs
only when asked for, with ``install`` alone beside it (a lease of its own).

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
BUDGET_S = 570  # the device tool's 600 s per command, less the start of this script and the transfers
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
    env = ("import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, "
           "transformers.__version__); print('DEVICE', torch.cuda.get_device_name() if torch.cuda.is_available() "
           "else 'no CUDA device')")  # fmt: skip
    every = [
        ("env", [py, "-c", env], 30),
        ("install", [py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(REPO)], 60),
        # (-v: each test's result logged by name as it ends, so a phase stopped at its limit still shows which passed;
        # about 60 cold Triton compiles, 5 to 28 s each on a loaded CPU, come last, in test_triton_gpu.py)
        ("tests", [py, "-m", "pytest", "-v", "--durations=15", "-m", "gpu", "-p", "no:cacheprovider", *tests], 250),
        ("bench_kernel", [py, str(BENCH / "bench_kernel.py"), *kernel, "--results-dir", out], 90),
        ("bench_ring_sim", [py, str(BENCH / "bench_ring_sim.py"), *ring, "--results-dir", out], 110),
        (
            "longest",
            [py, str(BENCH / "bench_longest_gpu.py"), "--configs", "chunked+offload", *longest, "--results-dir", out],
            480,
        ),  # fmt: skip
    ]
    wanted = ["env", *(args.only or [name for name, _, _ in every if name != "longest" or args.longest])]
    if args.dry_run:
        wanted = [name for name in wanted if name != "install"]  # the dry run uses the installed checkout
    return [p for p in every if p[0] in wanted]


def run_phase(name: str, cmd: list[str], limit: int, log: Path, env: dict | None = None) -> tuple[str, float]:
    """Run ``cmd`` with its output appended to ``log`` in a process group of its own (not a session: it goes
    with the call), and stop the group when the phase ends, after ``limit`` seconds at most, or when this
    script is told to stop (SIGTERM, SIGINT). Returns the status (``ok``, ``exit N`` or ``timeout``) and the
    seconds it ran."""
    with log.open("a") as f:
        f.write(f"\n===== {name}: {' '.join(cmd)} (limit {limit} s)\n")
        f.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, process_group=0)

        def stop(signum, frame):  # (the call is being stopped: take the phase along)
            _kill(proc.pid)
            raise SystemExit(128 + signum)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            _kill(proc.pid)  # (and whatever it left behind: a distributed test's workers)
            proc.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        seconds = time.monotonic() - t0
        f.write(f"===== {name}: {status} after {seconds:.1f} s\n")
    return status, seconds


def _kill(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
    device = "cpu (dry run)" if args.dry_run else "unknown"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    planned = phases(args)
    total = sum(limit for _, _, limit in planned)
    if total > BUDGET_S and not args.dry_run:
        p.error(f"phases {', '.join(n for n, _, _ in planned)} may take {total} s, over the {BUDGET_S} s of one call: "
                "ask for fewer with --only (longest: --only install longest)")  # fmt: skip
    print(f"phases {', '.join(n for n, _, _ in planned)} within {total} s", flush=True)
    failed = []
    for name, cmd, limit in planned:
        start = log.stat().st_size if log.exists() else 0
        status, seconds = run_phase(name, cmd, limit, log, env)
        if name == "env" and not args.dry_run:  # (the device as the env phase saw it: no CUDA in this process)
            device = next((ln[7:] for ln in _tail(log, start).splitlines() if ln.startswith("DEVICE ")), device)
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


if __name__ == "__main__":
    sys.exit(main())
