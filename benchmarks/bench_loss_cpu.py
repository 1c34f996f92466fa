"""The chunked loss's two ways of running an lm_head, timed side by side on CPU, with their error against float64.

``hf_ring.chunked_causal_lm_loss`` runs a plain ``nn.Linear`` head as one autograd function over the chunks (the
weight's gradient summed in fp32, the hidden states' gradient written in place); a head it must call as a module
(hooks: FSDP2 around the head alone, DeepSpeed ZeRO-3; LoRA on the head) runs chunk by chunk under activation
checkpointing, autograd summing the chunks' gradients in the weight's dtype. Here the module way is forced the way
users meet it, with a forward pre-hook that does nothing. For each dtype, one process times forward + backward of
the loss of ``--tokens`` hidden states (min / median of ``--repeat`` runs, the two ways alternating) and reports the
relative error of the head's weight gradient against the same loss in float64 (the unchunked product). Rows go to
``benchmarks/results/loss_cpu.csv`` with the CPU, versions and date. Example (SmolLM2-135M's hidden size, a 16K
vocabulary; 8 minutes on 2 cores: CPUs without bf16 matrix units run bf16 products about 35 times slower than fp32,
so the bf16 rows' times say little, their errors do):

    python benchmarks/bench_loss_cpu.py --tokens 2048 --hidden 576 --vocab 16384 --chunk-size 128 --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._cpu import append_rows, cpu_name  # noqa: E402
from hf_ring.loss import chunked_causal_lm_loss  # noqa: E402

FIELDS = ["date", "cpu", "threads", "torch", "dtype", "tokens", "hidden", "vocab", "chunk_size", "way", "min_ms",
          "median_ms", "weight_grad_rel_err", "module_vs_function"]  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _step(hidden, head, targets, chunk_size) -> torch.Tensor:
    """Forward + backward of the loss; the head's weight gradient."""
    head.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_()
    chunked_causal_lm_loss(h, head, shift_labels=targets, chunk_size=chunk_size).backward()
    return head.weight.grad


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main(argv=None) -> list[dict]:
    """Time and check both ways for each dtype; the rows (also appended to the CSV file unless ``--dry-run``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, one repeat, no CSV row")
    args = p.parse_args(argv)
    if args.dry_run:
        args.tokens, args.hidden, args.vocab, args.chunk_size, args.repeat = 64, 16, 96, 16, 1
    torch.manual_seed(0)
    wide_hidden = torch.randn(1, args.tokens, args.hidden, dtype=torch.float64)
    targets = torch.randint(0, args.vocab, (1, args.tokens))
    wide_head = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=torch.float64)
    ref = _step(wide_hidden, wide_head, targets, args.tokens).clone()  # one chunk: the unchunked product
    rows = []
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        hidden = wide_hidden.to(dtype)
        head = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=dtype)
        head.load_state_dict(wide_head.state_dict())
        times = {"function": [], "module": []}
        errors = {}
        for _ in range(args.repeat + 1):  # (the first run of each way warms up, untimed)
            for way in times:
                hook = head.register_forward_pre_hook(lambda m, a: None) if way == "module" else None
                start = time.perf_counter()
                grad = _step(hidden, head, targets, args.chunk_size)
                times[way].append(1e3 * (time.perf_counter() - start))
                if hook is not None:
                    hook.remove()
                errors[way] = _rel(grad, ref)
        ms = {way: (min(t[1:] or t), statistics.median(t[1:] or t)) for way, t in times.items()}
        for way in times:
            row = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "dtype": name, "tokens": args.tokens, "hidden": args.hidden,
                   "vocab": args.vocab, "chunk_size": args.chunk_size, "way": way, "min_ms": round(ms[way][0], 1),
                   "median_ms": round(ms[way][1], 1), "weight_grad_rel_err": f"{errors[way]:.2e}",
                   "module_vs_function": round(ms["module"][1] / ms["function"][1], 3)}  # fmt: skip
            rows.append(row)
            print(", ".join(f"{k}={row[k]}" for k in FIELDS[4:]))
    if not args.dry_run:
        print("rows appended to", append_rows(args.results_dir / "loss_cpu.csv", FIELDS, rows))
    return rows


if __name__ == "__main__":
    main()
