"""Peak memory per rank of fine-tuning SmolLM2-135M with context parallelism on CPU (LoRA or full; DDP or FSDP2).

    .venv/bin/python benchmarks/bench_memory_cpu.py [--lengths 2048,4096,8192,16384] [--cp-sizes 1,2] \\
        [--budget-gib 8] [--time-limit 900]
    .venv/bin/python benchmarks/bench_memory_cpu.py --full --engines ddp,fsdp2 --cp-sizes 2 --dp-sizes 1,2 \\
        --lengths 2048                                  # full fine-tuning: DDP beside FSDP2, CP=2 and DP=2 x CP=2
    .venv/bin/python benchmarks/bench_memory_cpu.py --losses chunked,full --cp-sizes 2 --lengths 4096,8192
                                                        # hf_ring's chunked loss beside the full logits
    .venv/bin/python benchmarks/bench_memory_cpu.py --malloc mmap ...
                                                        # glibc returns every freed block >= 64 KiB at once

For every (engine, DP size, CP size, sequence length) it launches ``torchrun`` with DP x CP processes
that each run one training step (CP = 1 is the baseline without hf_ring: plain Transformers sdpa
attention) (forward + backward + AdamW, activation checkpointing on unless ``--no-gc``) on the demo
model, LoRA r=16 on q/k/v/o or with ``--full`` every weight, and sample their resident set size; the
figure is the largest peak over the ranks. ``--losses``: ``chunked`` (``hf_ring.apply_chunked_loss``,
the plugin's default; also applied to the CP = 1 baseline) and/or ``full`` (the model's own loss over
the full ``[tokens, vocab]`` logits). FSDP2 shards the model over every process through
Accelerate's own FSDP2 path (Accelerate enables FSDP on GPUs only, so on CPU the worker switches the
Accelerator to FSDP2 as it is on a GPU). Lengths of
one CP size are run in increasing order and stop at the first that fails or runs past the time limit.
The end of the run prints, for each CP size, the longest measured length whose peak fits
``--budget-gib`` per rank.

``--malloc``: ``default`` leaves glibc's allocator as it is; its dynamic mmap threshold rises to 32 MiB
after the first large frees, so later blocks up to 32 MiB come from heaps that keep freed memory
resident, and the peak RSS then tracks the sum of every transient rather than the live tensors (at 16K
tokens CP = 2, 7.1 GiB against 2.4 GiB). ``mmap`` sets ``MALLOC_MMAP_THRESHOLD_=65536`` for the
workers: blocks of 64 KiB and more are mapped and unmapped, so RSS follows the live memory, which is
what a GPU's caching allocator reports. Every run appends a row to ``benchmarks/results/memory_cpu.csv`` with the
date, CPU, library versions and the figures.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cpu import cpu_name

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "examples"))

FIELDS = [
    "date",
    "cpu",
    "cores",
    "python",
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "hf_ring",
    "model",
    "attention",
    "engine",
    "dp_size",
    "cp_size",
    "seq_len",
    "tokens_per_rank",
    "activation_checkpointing",
    "loss",
    "malloc",
    "threads_per_rank",
    "peak_rss_mib_max_rank",
    "peak_rss_mib_per_rank",
    "rss_before_step_mib",
    "step_seconds",
    "status",
]


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name, dist in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("accelerate", "accelerate"),
        ("peft", "peft"),
        ("hf_ring", "hf-ring"),
    ):
        try:
            out[name] = md.version(dist)
        except md.PackageNotFoundError:
            out[name] = "?"
    return out


# ---- one measurement (run by torchrun) -------------------------------------------------------------


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from _common import PeakMemory, _rss_bytes, collate, load_model_and_tokenizer, long_documents
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader

    from hf_ring.accelerate import RingAttentionPlugin

    accelerator = Accelerator(cpu=True)
    if args.engine == "fsdp2":
        from accelerate import FullyShardedDataParallelPlugin, PartialState
        from accelerate.utils import DistributedType

        accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    chunked = args.loss == "chunked"
    plugin = RingAttentionPlugin(cp_size=args.cp_size, chunked_loss=chunked)
    with accelerator.local_main_process_first():
        model, tokenizer = load_model_and_tokenizer(None)
    if not args.no_gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    set_seed(0)
    if not args.full:
        model = get_peft_model(
            model,
            LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        )
    data = long_documents(tokenizer, args.seq_len, accelerator.num_processes // args.cp_size)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loader = DataLoader(data, batch_size=1, collate_fn=collate)
    if args.cp_size == 1:  # the baseline: plain Transformers attention (sdpa), no ring attention
        if chunked:
            from hf_ring import apply_chunked_loss

            apply_chunked_loss(model)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, optimizer, loader = plugin.prepare(accelerator, model, optimizer, loader)
    batch = next(iter(loader))
    model.train()
    before = _rss_bytes()
    t0 = time.perf_counter()
    with PeakMemory(torch.device("cpu")) as mem:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - t0
    figures = torch.tensor([mem.peak / 2**20, before / 2**20, seconds], dtype=torch.float64)
    parts = [torch.zeros_like(figures) for _ in range(accelerator.num_processes)]
    if accelerator.num_processes > 1:
        dist.all_gather(parts, figures)
    else:
        parts = [figures]
    if accelerator.is_main_process:
        Path(args.json).write_text(
            json.dumps(
                {
                    "peaks": [p[0].item() for p in parts],
                    "before": max(p[1].item() for p in parts),
                    "seconds": max(p[2].item() for p in parts),
                    "loss": (plugin.reduce_loss(loss) if args.cp_size > 1 else loss).item(),
                }
            )
        )
    elif args.cp_size > 1:
        plugin.reduce_loss(loss)


# ---- the driver ----------------------------------------------------------------------------------


def run_one(cp: int, seq_len: int, args, threads: int, dp: int = 1, engine: str = "ddp", loss: str = "chunked") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        nproc = dp * cp
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(HERE)]
        cmd += ["--worker", "--cp-size", str(cp), "--seq-len", str(seq_len), "--json", str(out), "--engine", engine]
        cmd += ["--loss", loss]
        if args.no_gc:
            cmd.append("--no-gc")
        if args.full:
            cmd.append("--full")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(REPO)}
        if args.malloc == "mmap":
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.time_limit)
        except subprocess.TimeoutExpired:
            return {"status": f"timeout after {args.time_limit}s", "wall": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-1500:]
            return {"status": f"failed (exit {proc.returncode})", "wall": wall, "log": tail}
        return {"status": "ok", "wall": wall, **json.loads(out.read_text())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384")
    p.add_argument("--cp-sizes", default="1,2")
    p.add_argument("--dp-sizes", default="1", help="data-parallel replicas (processes = dp x cp)")
    p.add_argument("--engines", default="ddp", help="ddp and/or fsdp2 (FSDP2 shards over every process)")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    p.add_argument("--budget-gib", type=float, default=8.0, help="per-rank memory budget for the summary")
    p.add_argument("--time-limit", type=int, default=900, help="seconds per launch")
    p.add_argument("--no-gc", action="store_true", help="no activation checkpointing")
    p.add_argument("--csv", default=str(REPO / "benchmarks" / "results" / "memory_cpu.csv"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cp-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--losses", default="chunked", help="chunked (hf_ring's chunked loss) and/or full (the full logits)")
    p.add_argument("--loss", default="chunked", choices=["chunked", "full"], help=argparse.SUPPRESS)
    p.add_argument("--malloc", default="default", choices=["default", "mmap"], help="glibc allocator setting")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    cores = os.cpu_count() or 1
    common = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "cores": cores, **_versions()}
    common["model"] = "SmolLM2-135M-Instruct " + ("full fine-tuning" if args.full else "LoRA r=16 (q,k,v,o)")
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    _add_columns(Path(args.csv))
    new = not Path(args.csv).exists()
    results = {}
    with open(args.csv, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        configs = [
            (engine, dp, cp, loss)
            for engine in args.engines.split(",")
            for dp in (int(x) for x in args.dp_sizes.split(","))
            for cp in (int(x) for x in args.cp_sizes.split(","))
            for loss in args.losses.split(",")
        ]
        for engine, dp, cp, loss in configs:
            threads = max(1, cores // (dp * cp))
            for seq_len in (int(x) for x in args.lengths.split(",")):
                r = run_one(cp, seq_len, args, threads, dp=dp, engine=engine, loss=loss)
                peaks = r.get("peaks", [])
                row = {
                    **common,
                    "attention": "sdpa (no hf_ring)" if cp == 1 else "hf_ring ring attention",
                    "engine": engine if dp * cp > 1 else "none",
                    "dp_size": dp,
                    "cp_size": cp,
                    "seq_len": seq_len,
                    "tokens_per_rank": seq_len // cp,
                    "activation_checkpointing": not args.no_gc,
                    "loss": loss,
                    "malloc": args.malloc,
                    "threads_per_rank": threads,
                    "peak_rss_mib_max_rank": round(max(peaks)) if peaks else "",
                    "peak_rss_mib_per_rank": " ".join(str(round(x)) for x in peaks),
                    "rss_before_step_mib": round(r["before"]) if "before" in r else "",
                    "step_seconds": round(r["seconds"], 1) if "seconds" in r else "",
                    "status": r["status"],
                }
                writer.writerow(row)
                f.flush()
                results[(engine, dp, cp, loss, seq_len)] = row
                print(
                    f"{engine} DP={dp} CP={cp} {loss} loss seq_len={seq_len:>6}: peak RSS per rank "
                    f"{row['peak_rss_mib_per_rank'] or '-'} MiB, "
                    f"step {row['step_seconds'] or '-'} s, launch {r['wall']:.0f} s, {r['status']}",
                    flush=True,
                )
                if r["status"] != "ok":
                    if "log" in r:
                        print(r["log"])
                    break  # longer sequences of this CP size would not do better
    budget = args.budget_gib * 1024
    print(f"\nlongest measured sequence within {args.budget_gib:g} GiB per rank:")
    for config in sorted({k[:4] for k in results}):
        fits = [
            k[4]
            for k, row in results.items()
            if k[:4] == config and row["status"] == "ok" and row["peak_rss_mib_max_rank"] <= budget
        ]
        print(f"  {config[0]} DP={config[1]} CP={config[2]} {config[3]} loss: {max(fits) if fits else 'none'}")
    print(f"rows appended to {args.csv}")


def _add_columns(path: Path) -> None:
    """Fill in the columns added since older rows were written: ``loss`` (they computed the full logits) and
    ``malloc`` (they ran with glibc's default)."""
    if not path.exists():
        return
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and any(name not in rows[0] for name in FIELDS):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows({"loss": "full", "malloc": "default", **row} for row in rows)


if __name__ == "__main__":
    main()
