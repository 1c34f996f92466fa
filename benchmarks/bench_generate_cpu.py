"""Long-context generation on CPU: ``ring_generate`` over 2 processes against one process's ``generate()``.

    .venv/bin/python benchmarks/bench_generate_cpu.py [--lengths 8192,16384] [--new-tokens 32]

For every prompt length it launches ``torchrun`` twice with the demo model (SmolLM2-135M-Instruct, fp32, one
thread per process, glibc's allocator returning freed blocks >= 64 KiB at once so RSS follows live memory):
one process running the unmodified model's ``generate()`` (Transformers' sdpa attention, the whole KV cache), and
CP = 2 processes running ``hf_ring.ring_generate`` (ring prefill, the cache sharded, ``decode_attention``).
Greedy decoding of ``--new-tokens`` tokens from a prompt cut from the standard library's sources. A logits
processor timestamps every step: prefill time is the time to the first step, decode speed the steps after it.
Reported: prefill seconds, prefill parallel efficiency (t_1 / (2 x t_2)), decode tokens/s and their ratio,
per-rank peak RSS, and whether both runs generated the same tokens. Rows go to
``benchmarks/results/generate_cpu.csv`` with the date, CPU and library versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cpu import append_rows, cpu_name

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
FIELDS = ["date", "cpu", "cores", "python", "torch", "transformers", "hf_ring", "model", "prompt_tokens",
          "new_tokens", "processes", "mode", "prefill_s", "prefill_efficiency", "decode_tokens_per_s",
          "decode_ratio", "peak_rss_mib_per_rank", "same_tokens", "status"]  # fmt: skip


def _worker(args) -> None:
    """One rank: generate and write ``rank{r}.json`` (times, peak RSS, the generated tokens)."""
    import torch
    import torch.distributed as dist
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.utils import logging

    sys.path.insert(0, str(REPO / "examples"))
    from _common import PeakMemory, load_model_and_tokenizer, long_documents

    import hf_ring

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, tokenizer = load_model_and_tokenizer(None)
    model.eval()
    ids = long_documents(tokenizer, args.prompt_tokens, 1)[0]["input_ids"][None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    settings = {"max_new_tokens": args.new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id,
                "logits_processor": LogitsProcessorList([Stamp()])}  # fmt: skip
    ring = args.mode == "ring"
    if ring:
        hf_ring.apply_ring_attention(model)
    dist.barrier()
    with PeakMemory(torch.device("cpu")) as mem, torch.no_grad():
        t0 = time.perf_counter()
        out = hf_ring.ring_generate(model, inputs, **settings) if ring else model.generate(**inputs, **settings)
    result = {
        "prefill_s": stamps[0] - t0,
        "decode_tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "peak_rss_mib": mem.peak / 2**20,
        "tokens": out[0, ids.shape[1] :].tolist(),
    }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # (every rank alive while the group closes: gloo can abort a process left alone)
    dist.destroy_process_group()


def _launch(mode: str, nproc: int, length: int, args) -> dict | str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(HERE), "--worker",
               "--mode", mode, "--prompt-tokens", str(length), "--new-tokens", str(args.new_tokens), "--out", tmp]  # fmt: skip
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.time_limit, env=env)
        except subprocess.TimeoutExpired:
            return f"over the {args.time_limit:g} s limit"
        if proc.returncode:
            return f"failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1][:200]}"
        return {r: json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=1800.0)
    ap.add_argument("--csv", default=str(REPO / "benchmarks" / "results" / "generate_cpu.csv"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ring", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-tokens", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return []
    import torch
    import transformers

    import hf_ring

    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "hf_ring": hf_ring.__version__, "model": "SmolLM2-135M-Instruct fp32", "new_tokens": args.new_tokens}  # fmt: skip
    rows = []
    for length in [int(x) for x in args.lengths.split(",") if x]:
        one = _launch("plain", 1, length, args)
        two = _launch("ring", 2, length, args)
        for mode, n, res in (("one process generate()", 1, one), ("ring_generate CP=2", 2, two)):
            row = {**meta, "prompt_tokens": length, "processes": n, "mode": mode}
            if isinstance(res, str):
                rows.append({**row, "status": res})
                continue
            first = res[0]
            row.update(prefill_s=round(first["prefill_s"], 2), decode_tokens_per_s=round(first["decode_tokens_per_s"], 2),
                       peak_rss_mib_per_rank=" ".join(f"{res[r]['peak_rss_mib']:.0f}" for r in sorted(res)),
                       status="ok")  # fmt: skip
            if n == 2 and not isinstance(one, str):
                row["prefill_efficiency"] = round(one[0]["prefill_s"] / (2 * first["prefill_s"]), 3)
                row["decode_ratio"] = round(first["decode_tokens_per_s"] / one[0]["decode_tokens_per_s"], 3)
                row["same_tokens"] = all(res[r]["tokens"] == one[0]["tokens"] for r in res)
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in FIELDS[8:]}), flush=True)
    if args.csv:
        append_rows(Path(args.csv), FIELDS, rows)
    return rows


if __name__ == "__main__":
    main()
