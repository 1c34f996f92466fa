"""Longest trainable sequence on one GPU: a Llama-3.1-8B-shaped model, with and without the chunked loss and offload.

    python3 benchmarks/bench_longest_gpu.py [--results-dir DIR] [--configs full,chunked,chunked+offload] \\
        [--start 32768] [--limit 1048576] [--step 16384]
    python3 benchmarks/bench_longest_gpu.py --dry-run    # tiny shape on CPU with a simulated budget (tests)

One process, one GPU, CP = 1 through hf_ring's code path (``apply_ring_attention`` over one rank and
``shard_batch``), random weights in bf16, LoRA r=16 on q/k/v/o, activation checkpointing. For each
configuration (``full``: the model's own loss over the full logits; ``chunked``:
``hf_ring.apply_chunked_loss``; ``+offload``: also ``hf_ring.apply_activation_offload``, the checkpointed
layer inputs in pinned host memory) the script doubles the sequence length from ``--start`` until a forward + backward runs out
of memory, then bisects to ``--step`` tokens. Every trial appends a row (GPU, versions, date, length,
peak allocated memory, step time, status) to ``longest_gpu.csv`` in ``--results-dir``
(default ``benchmarks/results``), and the end prints the longest length per configuration.

``--dry-run`` runs the same search on CPU with a tiny model and a simulated memory budget
(``--dry-run-budget`` tokens): the code path and the bisection, not a figure.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import importlib.metadata as md
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

FIELDS = ["date", "device", "python", "torch", "transformers", "peft", "hf_ring", "model", "dtype", "lora",
          "checkpointing", "loss", "offload", "seq_len", "status", "peak_allocated_gib", "step_seconds"]  # fmt: skip

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)  # fmt: skip


class SimulatedOOMError(RuntimeError):
    """--dry-run: the length is over the simulated budget."""


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name, dist in (("torch", "torch"), ("transformers", "transformers"), ("peft", "peft"), ("hf_ring", "hf-ring")):
        try:
            out[name] = md.version(dist)
        except md.PackageNotFoundError:
            out[name] = ""
    return out


def build_model(shape: dict, max_len: int, device: torch.device, dtype: torch.dtype, chunked: bool, offload: bool):
    """The random-weight model with LoRA, checkpointing, ring attention over one rank, the chosen loss and offload."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_ring

    cfg = LlamaConfig(**shape, max_position_embeddings=max_len, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))  # fmt: skip
    hf_ring.apply_ring_attention(model)
    if chunked:
        hf_ring.apply_chunked_loss(model)
    if offload:
        hf_ring.apply_activation_offload(model)
    model.train()
    return model


def trial(model, seq_len: int, vocab: int, device: torch.device, budget: int | None) -> dict:
    """One forward + backward at ``seq_len``: status, peak allocated GiB (CUDA), seconds."""
    import hf_ring

    if budget is not None and seq_len > budget:
        raise SimulatedOOMError(f"{seq_len} tokens are over the simulated budget of {budget}")
    ids = torch.randint(1, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    batch = hf_ring.shard_batch({"input_ids": ids, "labels": ids.clone()})
    batch = {
        k: v.to(device) if isinstance(v, torch.Tensor) and k != "ring_document_ids" else v for k, v in batch.items()
    }
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()} at {seq_len} tokens")
    model.zero_grad(set_to_none=True)
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else ""
    return {"status": "ok", "peak_allocated_gib": peak, "step_seconds": round(seconds, 2)}


def _run(model, seq_len, vocab, device, budget) -> dict:
    try:
        return trial(model, seq_len, vocab, device, budget)
    except (torch.cuda.OutOfMemoryError, SimulatedOOMError) as e:
        return {"status": f"out of memory ({type(e).__name__})", "peak_allocated_gib": "", "step_seconds": ""}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def search(run, start: int, limit: int, step: int) -> tuple[int | None, list]:
    """Longest length (a multiple of ``step``) for which ``run(length)`` is ok: doubling, then bisection."""
    tried, ok_len, bad_len = [], None, None
    length = start
    while length <= limit:
        r = run(length)
        tried.append((length, r))
        if r["status"] != "ok":
            bad_len = length
            break
        ok_len = length
        length *= 2
    if bad_len is None:
        return ok_len, tried
    lo = ok_len or 0
    hi = bad_len
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        r = run(mid)
        tried.append((mid, r))
        lo, hi = (mid, hi) if r["status"] == "ok" else (lo, mid)
    return (lo or None), tried


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="full,chunked,chunked+offload", help="loss (full, chunked) [+offload]")
    p.add_argument("--start", type=int, default=32768)
    p.add_argument("--limit", type=int, default=1 << 20)
    p.add_argument("--step", type=int, default=16384)
    p.add_argument("--results-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU with a simulated memory budget")
    p.add_argument("--dry-run-budget", type=int, default=200, help="--dry-run: the simulated budget in tokens")
    args = p.parse_args(argv)

    if args.dry_run:
        device, shape, budget = torch.device("cpu"), TINY, args.dry_run_budget
        start, limit, step, dtype = min(args.start, 64), min(args.limit, 512), min(args.step, 16), torch.float32
        name = "tiny Llama (dry run)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to exercise the script on CPU")
            return 2
        device, shape, budget = torch.device("cuda"), LLAMA_31_8B, None
        start, limit, step, dtype = args.start, args.limit, args.step, torch.bfloat16
        name = "Llama-3.1-8B shape, random weights"
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    common = {"date": datetime.date.today().isoformat(), "device": device_name, **_versions(), "model": name,
              "dtype": str(dtype).replace("torch.", ""), "lora": "r=16 q,k,v,o", "checkpointing": True}  # fmt: skip
    out = Path(args.results_dir) / "longest_gpu.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    longest = {}
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for config in args.configs.split(","):
            loss, _, extra = config.partition("+")
            if loss not in ("full", "chunked") or extra not in ("", "offload"):
                raise SystemExit(f"unknown configuration {config!r}: full or chunked, optionally +offload")
            model = build_model(shape, limit, device, dtype, chunked=loss == "chunked", offload=extra == "offload")

            def run(length, config=config, model=model):
                r = _run(model, length, shape["vocab_size"], device, budget)
                loss, _, extra = config.partition("+")
                writer.writerow({**common, "loss": loss, "offload": extra == "offload", "seq_len": length, **r})
                f.flush()
                print(f"{config:16s} {length:>8} tokens: {r['status']} peak {r['peak_allocated_gib']} GiB, "
                      f"{r['step_seconds']} s", flush=True)  # fmt: skip
                return r

            longest[config], _ = search(run, start, limit, step)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\nlongest trainable sequence on {device_name} (multiples of {step}):")
    for config, n in longest.items():
        print(f"  {config}: {n if n else 'none'}")
    print(f"rows appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
