"""What each rank sees when something fails in a CP run, and how long after the failure: the figures of
docs/faq.md's "When something fails".

    .venv/bin/python benchmarks/bench_failures.py [--cases bad_input,caught,killed,stuck,torchrun_raise,torchrun_kill]
        [--timeout 10] [--world-size 2]

Every case runs a tiny random Llama (3 layers) patched with ``hf_ring.apply_ring_attention`` on a gloo group of
``--world-size`` CPU processes; after one healthy training step, rank 1 meets the failure in layer 1 of its
next step:

- ``bad_input``: rank 1 passes a longer shard than the others (every rank raises before any exchange; then a
  correct step runs on the same group);
- ``caught``: rank 1's layer 1 raises (as an out-of-memory error would), rank 1 catches it and calls the model
  again (``find_executable_batch_size`` does);
- ``killed``: rank 1 is killed (SIGKILL) in its backward, under a plain multiprocessing launch (no ``torchrun``
  to end the job);
- ``stuck``: rank 1 stays alive but never reaches the next exchange (``timeout=--timeout`` on every rank);
- ``torchrun_raise`` / ``torchrun_kill``: the same raise (uncaught) or kill under ``torchrun``, timed to the
  end of the job, whose output must show the failing rank's error.

The failing rank writes the moment of its failure to a file; every rank writes what it raised and when. The
table printed gives, per case and rank, the exception type, its first words and the seconds from the failure
to the error; each run appends its rows to ``benchmarks/results/failures_cpu.csv`` with the date, CPU and
library versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cpu import append_rows, cpu_name

REPO = Path(__file__).resolve().parents[1]
CASES = ("bad_input", "caught", "killed", "stuck", "torchrun_raise", "torchrun_kill")
FAILING = 1  # the rank that fails
FIELDS = ["date", "cpu", "cores", "python", "torch", "hf_ring", "world_size", "timeout_s", "case", "rank", "raised",
          "message", "seconds_after_failure"]  # fmt: skip


def _model():
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    model = tf.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def _step(model, batch):
    model(**batch).loss.backward()


def _worker(case: str, rank: int, world: int, timeout: float | None, out: Path) -> None:
    """One rank of one case (the group is initialised); writes ``rank{r}.json`` and the failing rank ``fail``."""
    import torch

    import hf_ring

    torch.set_num_threads(1)
    model = hf_ring.apply_ring_attention(_model(), timeout=timeout)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    batch = hf_ring.shard_batch({"input_ids": ids, "labels": ids})
    _step(model, batch)  # healthy: plans cached, kernels warm
    failing = rank == FAILING
    mark = out / "fail"

    def stamp():
        mark.write_text(repr(time.time()))

    def fail(*_):
        stamp()
        if case in ("killed", "torchrun_kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "stuck":
            time.sleep(3600)
        raise RuntimeError("injected failure in layer 1 (as an out-of-memory error would be)")

    layer = model.model.layers[1]
    if failing and case in ("caught", "stuck", "torchrun_raise"):
        layer.mlp.register_forward_hook(fail)
    elif failing and case in ("killed", "torchrun_kill"):
        layer.mlp.register_full_backward_hook(fail)
    if case == "bad_input":
        ids2 = torch.randint(3, 128, (1, 64 + 8 * world * (rank == FAILING)))
        batch = hf_ring.shard_batch({"input_ids": ids2, "labels": ids2})
        if failing:
            stamp()
    result = {}
    for attempt in range(2):
        try:
            _step(model, batch)
            result.setdefault("raised", "nothing")
        except Exception as e:  # noqa: BLE001 - what the user sees
            result = {"raised": type(e).__name__, "message": str(e), "t": time.time()}
            if failing and case == "caught" and attempt == 0:
                continue  # the failing rank's code catches its error and calls the model again
        break
    if case == "bad_input":  # the group is still usable: a correct step on every rank
        _step(model, hf_ring.shard_batch({"input_ids": ids, "labels": ids}))
        result["then"] = "a correct step ran"
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if case.startswith("torchrun") and "raised" in result and result["raised"] != "nothing":
        raise RuntimeError(result["message"])  # uncaught, as in a user's script: torchrun ends the job
    os._exit(0)  # a stopped group cannot be destroyed cleanly; nothing is left to flush


def _spawned(case, rank, world, port, timeout, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _worker(case, rank, world, timeout, Path(out))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: str, world: int, timeout: float | None, limit: float) -> list[dict]:
    """Rows (one per rank) of one case."""
    import multiprocessing

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        end = None
        if case.startswith("torchrun"):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                   f"--master-port={_free_port()}", str(Path(__file__).resolve()), "--worker", case, "--out", tmp,
                   "--world-size", str(world)] + ([] if timeout is None else ["--timeout", str(timeout)])  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            end = time.time()
            text = proc.stdout + proc.stderr  # a killed rank has no error of its own: torchrun names the signal
            shown = ("SIGKILL" if case == "torchrun_kill" else "injected failure") in text
        else:
            ctx = multiprocessing.get_context("spawn")
            port = _free_port()
            procs = [ctx.Process(target=_spawned, args=(case, r, world, port, timeout, tmp)) for r in range(world)]
            for p in procs:
                p.start()
            deadline = time.time() + limit
            reporting = [r for r in range(world) if r != FAILING or case in ("bad_input", "caught")]
            while time.time() < deadline and not all((out / f"rank{r}.json").exists() for r in reporting):
                time.sleep(0.2)
            for p in procs:
                p.join(timeout=5)
            for p in procs:
                if p.is_alive():
                    p.kill()
        t0 = float((out / "fail").read_text()) if (out / "fail").exists() else None
        rows = []
        for r in range(world):
            f = out / f"rank{r}.json"
            res = json.loads(f.read_text()) if f.exists() else {"raised": "(no report: killed or hung)"}
            seconds = res.get("t", 0) - t0 if "t" in res and t0 is not None else None
            message = res.get("message", res.get("then", ""))
            rows.append({"case": case, "rank": r, "raised": res["raised"], "message": message,
                         "seconds_after_failure": None if seconds is None else round(seconds, 3)})  # fmt: skip
        if end is not None:
            rows.append({"case": case, "rank": "job", "raised": f"torchrun exit {proc.returncode}",
                         "message": ("torchrun's output shows the failing rank's " +
                                     ("signal" if case == "torchrun_kill" else "error")) if shown else
                         "torchrun's output does NOT show the failing rank's failure",
                         "seconds_after_failure": None if t0 is None else round(end - t0, 3)})  # fmt: skip
        return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=float, default=10.0, help="apply_ring_attention(timeout=) in seconds")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--limit", type=float, default=180.0, help="seconds before a case counts as hung")
    ap.add_argument("--csv", default=str(REPO / "benchmarks" / "results" / "failures_cpu.csv"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one rank under torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
        _worker(args.worker, dist.get_rank(), dist.get_world_size(), args.timeout, Path(args.out))
        return []
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    rows = []
    for case in cases:
        rows += run_case(case, args.world_size, args.timeout, args.limit)
    import torch

    import hf_ring

    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "hf_ring": hf_ring.__version__,
            "world_size": args.world_size, "timeout_s": args.timeout}  # fmt: skip
    print("| case | rank | raised | seconds after the failure | message |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['case']} | {row['rank']} | {row['raised']} | {row['seconds_after_failure']} | "
              f"{row['message'][:110]} |")  # fmt: skip
    if args.csv:
        append_rows(Path(args.csv), FIELDS, [{**meta, **row} for row in rows])
    return rows


if __name__ == "__main__":
    main()
