"""RingAttentionPlugin with Accelerate mixed precision (bf16 autocast) in a 2-process CP = 2 launch.

Low-precision rule (house style): against a float64 reference, the CP = 2 loss and gradients may be
off by at most 2x the error of the plain model under the same bf16 autocast, plus a small epsilon.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.train_utils import collate, read_results, rel_err, run_worker, tiny_llama, token_dataset, torchrun

SEQ_LEN = 30
EPS = 2e-3  # bf16 has 8 mantissa bits: allow a small absolute slack on top of 2x the plain bf16 error


def worker(out: Path) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from hf_ring.accelerate import RingAttentionPlugin

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    rank = accelerator.process_index
    data = token_dataset(4, SEQ_LEN)
    full = collate(data[:2])
    res: dict = {}

    ref64 = tiny_llama().double()
    loss64 = ref64(**full).loss
    loss64.backward()
    plain = tiny_llama()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16 = plain(**full).loss
    loss16.backward()

    model = tiny_llama()
    original = model
    plugin = RingAttentionPlugin(cp_size=2)
    model, dl = plugin.prepare(accelerator, model, DataLoader(data, batch_size=2, collate_fn=collate))
    batch = next(iter(dl))
    loss = model(**batch).loss
    accelerator.backward(loss)
    res["loss_err"] = abs(plugin.reduce_loss(loss).double().item() - loss64.item())
    res["plain_loss_err"] = abs(loss16.double().item() - loss64.item())
    grads = dict(original.named_parameters())
    res["grad_err"] = max(rel_err(grads[k].grad, p.grad) for k, p in ref64.named_parameters())
    res["plain_grad_err"] = max(
        rel_err(dict(plain.named_parameters())[k].grad, p.grad) for k, p in ref64.named_parameters()
    )
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    accelerator.wait_for_everyone()


def test_bf16_autocast_matches_within_the_low_precision_rule(tmp_path):
    torchrun(Path(__file__), 2, tmp_path, timeout=300)
    res = read_results(tmp_path, 2)
    for r in res:
        assert r["loss_err"] <= 2 * r["plain_loss_err"] + EPS, r
        assert r["grad_err"] <= 2 * r["plain_grad_err"] + EPS, r  # after DDP: the summed CP shares


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]))
