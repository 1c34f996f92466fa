"""apply_ring_attention in one line, shard_batch, and training steps of a tiny Llama on 2 CPU processes.

    torchrun --nproc_per_node 2 examples/apply_ring_attention.py [--steps 3] [--seq-len 250]

Every rank builds the same tiny random model and the same full batch (3 packed documents, as
``DataCollatorWithFlattening`` makes them), keeps its zig-zag shard with ``hf_ring.shard_batch``
and trains on it. Each rank's loss is its share of the global loss; the shares and the gradients
are summed over the context-parallel group (here: the whole world), so every rank takes the same
optimizer step as a single process on the unsharded batch would. Step 0 prints that single-process
loss too, for comparison.
"""

import argparse

import torch
import torch.distributed as dist
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

import hf_ring


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=250, help="total tokens of the packed batch")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same model and batch on every rank
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    lengths = [args.seq_len // 2, args.seq_len // 3, args.seq_len - args.seq_len // 2 - args.seq_len // 3]
    docs = [{"input_ids": torch.randint(0, 256, (n,)).tolist()} for n in lengths]
    batch = DataCollatorWithFlattening(return_tensors="pt")(docs)  # input_ids, labels, position_ids
    with torch.no_grad():
        unsharded = model(**batch).loss.item()  # the reference: one process, whole sequence

    hf_ring.apply_ring_attention(model)  # <- the one line
    local = hf_ring.shard_batch(batch)  # this rank's shard (padded to a multiple of 2 x world size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = model(**local).loss  # this rank's share of the global loss
        loss.backward()
        for p in model.parameters():  # sum the gradients over the CP group
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        total = hf_ring.reduce_loss(loss)  # the global loss, for logging
        if rank == 0:
            extra = f"  (unsharded model: {unsharded:.6f})" if step == 0 else ""
            print(f"step {step}: loss {total.item():.6f}{extra}", flush=True)
    dist.barrier()  # (every rank alive while the group closes: gloo can abort a process left alone)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
