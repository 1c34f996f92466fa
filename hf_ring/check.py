"""``python -m hf_ring.check``: ``hf_ring.check_exactness`` from the command line, on a model of yours.

    torchrun --nproc_per_node 8 -m hf_ring.check --model meta-llama/Llama-3.1-8B --dtype bf16 --seq-len 8192 --packed

Every process loads the model (``AutoModelForCausalLM.from_pretrained``: a Hub id or a local folder) on its device
(``cuda:LOCAL_RANK`` when CUDA is there, else the CPU), builds the same batch of random tokens (``--seed``; labels
equal to the tokens; ``--padded``: the last row left-padded by a quarter of its length; ``--packed``: each row
three documents of restarting positions), optionally wraps the model in LoRA adapters (``--lora``: PEFT on every
linear layer, both matrices drawn at random and alike on every process, so that only the adapters take gradients and
all of them are checked), and runs the check over all processes (one CP group). Random tokens may hit a
vision-language model's image placeholder ids: check such models through ``hf_ring.check_exactness`` with a batch
of the processor's.
Rank 0 prints the report; the exit status is 0 when it passed, 1 when it failed.

The batch is random tokens: what is checked is the configuration (family, dtype, layout, backend, padding, packing,
LoRA), and every process runs the whole batch once for the reference, so choose a length one device holds.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

__all__ = ["main", "random_batch"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hf_ring.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hub id or a local folder of a supported causal LM")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the model's dtype (default fp32)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row, before sharding (default 1024)")
    p.add_argument("--batch-size", type=int, default=1, help="rows (default 1)")
    p.add_argument("--padded", action="store_true", help="left-pad the last row by a quarter of its length")
    p.add_argument("--packed", action="store_true", help="three documents per row (restarting position ids)")
    p.add_argument("--lora", action="store_true", help="LoRA adapters on every linear layer (PEFT)")
    p.add_argument("--layout", default="zigzag", help="zigzag (default), striped or contiguous")
    p.add_argument("--backend", default="auto", help="the ring step's kernel (default auto)")
    p.add_argument("--ulysses-size", default=None, help="the Ulysses x Ring hybrid: an int or 'auto'")
    p.add_argument("--reference-dtype", choices=["wider", "none"], default="wider",
                   help="the yardstick: 'wider' (float64 for fp32, fp32 for bf16 / fp16) or 'none'")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the random tokens' seed")
    args = p.parse_args(argv)
    if args.padded and args.packed:
        p.error("--padded and --packed: choose one")
    return args


def random_batch(vocab: int, rows: int, seq_len: int, *, padded: bool = False, packed: bool = False, seed: int = 0):
    """A batch of random tokens in ``[3, vocab)`` (labels equal to them), the same for the same arguments."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq_len), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        pad = seq_len // 4
        mask = torch.ones_like(ids)
        mask[-1, :pad] = 0
        batch["attention_mask"] = mask
        batch["labels"][-1, :pad] = -100
    if packed:
        cuts = [0, seq_len // 5, seq_len // 2, seq_len]
        batch["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])]).expand(rows, -1)
        batch["labels"][:, cuts[1:-1]] = -100  # (no target across a document's start)
    return batch


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from .exactness import check_exactness

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    created = world > 1 and not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype]).to(device)
        if args.lora:
            from peft import LoraConfig, get_peft_model
            from transformers import set_seed

            set_seed(args.seed)  # (the same adapters on every process)
            # (B drawn at random too, not zeros: else A's gradients would be zeros, checked for nothing)
            lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
            model = get_peft_model(model, lora)
        vocab = model.get_input_embeddings().weight.shape[0]
        batch = random_batch(vocab, args.batch_size, args.seq_len, padded=args.padded, packed=args.packed,
                             seed=args.seed)  # fmt: skip
        ulysses = args.ulysses_size
        ulysses = int(ulysses) if ulysses not in (None, "auto") else ulysses
        report = check_exactness(
            model, {k: v.to(device) for k, v in batch.items()}, layout=args.layout, backend=args.backend,
            ulysses_size=ulysses, reference_dtype=None if args.reference_dtype == "none" else "wider",
        )  # fmt: skip
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(report, flush=True)
        if created:  # (every rank alive while the group closes: gloo can abort a process that leaves alone)
            dist.barrier()
        return 0 if report.ok else 1
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
