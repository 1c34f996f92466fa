"""The vision tower's work divided over the CP group (Qwen2-VL), side by side with every rank encoding every image.

    .venv/bin/python benchmarks/bench_vision_split_cpu.py [--images 8] [--grid 16] [--steps 5]

Two gloo processes (CP = 2, one thread each) train a Qwen2-VL-shaped model with random weights (a vision tower of
6 blocks, width 256; a 2-layer text model) on one batch of ``--images`` images of ``--grid`` x ``--grid`` patches
each (their tokens and some text in one row, ``shard_batch`` keeping it whole). Each timed step (forward and
backward) runs twice, alternating: as hf_ring runs it (each rank encodes its share of the images, the features
all-gathered) and with the split removed (every rank encodes every image). Reported per mode: the median step time,
the median time each rank spends in its vision tower's forward, the patches each rank encodes, and whether both
modes give the same loss and the same vision-tower gradient. Rows go to ``benchmarks/results/vision_split_cpu.csv``
with the date, CPU and library versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))

from _cpu import append_rows, cpu_name  # noqa: E402

FIELDS = ["date", "cpu", "cores", "python", "torch", "transformers", "hf_ring", "images", "patches_per_image",
          "seq_len", "mode", "patches_per_rank", "step_s", "vision_forward_s", "step_ratio", "vision_ratio",
          "same_result", "status"]  # fmt: skip
IMAGE, VIDEO, START, END = 900, 901, 902, 903


def _model():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=1000, bos_token_id=None, eos_token_id=None, pad_token_id=None, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
                         max_position_embeddings=4096),  # fmt: skip
        vision_config=dict(depth=6, embed_dim=256, num_heads=4, mlp_ratio=4, hidden_size=128, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),  # fmt: skip
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    import torch

    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg).float()


def _batch(images: int, grid: int):
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = grid * grid // 4
    ids, types = [], []
    for _ in range(images):
        text = torch.randint(1, 800, (24,), generator=g).tolist()
        ids += text + [START] + [IMAGE] * tokens + [END]
        types += [0] * (len(text) + 1) + [1] * tokens + [0]
    ids = torch.tensor([ids])
    return {
        "input_ids": ids, "labels": ids.masked_fill(torch.tensor([types]) == 1, -100),
        "mm_token_type_ids": torch.tensor([types]),
        "pixel_values": torch.randn(images * grid * grid, 3 * 2 * 14 * 14, generator=g),
        "image_grid_thw": torch.tensor([[1, grid, grid]] * images),
    }  # fmt: skip


def _worker(rank: int, world: int, args, out: str) -> None:
    import torch
    import torch.distributed as dist
    from hf_ring.patches import _split_vision

    import hf_ring

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = hf_ring.apply_ring_attention(_model())
    split = dict(vars(model.model))  # the split encoders hf_ring installed
    local = hf_ring.shard_batch(_batch(args.images, args.grid))
    spans, rows = [], []

    def before(module, args):  # (returns None: the arguments unchanged)
        spans.append(time.perf_counter())
        rows.append(args[0].shape[0])

    def after(module, args, output):
        spans.append(time.perf_counter() - spans.pop())

    model.model.visual.register_forward_pre_hook(before)
    model.model.visual.register_forward_hook(after)

    def step():
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss = model(**local).loss
        loss.backward()
        dist.barrier()
        took = time.perf_counter() - t
        grad = torch.cat([p.grad.flatten() for p in model.model.visual.parameters()])  # the whole tower's
        dist.all_reduce(grad)  # (the CP gradient sum)
        return took, spans.pop(), float(loss.detach()), grad

    res = {}
    for mode in ("split", "whole"):
        res[mode] = {"step": [], "vision": [], "rows": []}
    for i in range(args.warmup + args.steps):
        for mode in ("split", "whole"):
            if mode == "split":
                vars(model.model).update({k: v for k, v in split.items() if k.startswith("get_")})
            else:
                _split_vision.remove(model)
            rows.clear()
            took, vision, loss, grad = step()
            if i >= args.warmup:
                r = res[mode]
                r["step"].append(took)
                r["vision"].append(vision)
                r["rows"] = rows[0]
                r["loss"], r["grad"] = loss, grad
    same = abs(res["split"]["loss"] - res["whole"]["loss"]) <= 1e-6 * abs(res["whole"]["loss"]) and torch.allclose(
        res["split"]["grad"], res["whole"]["grad"], rtol=1e-4, atol=1e-7
    )
    summary = {mode: {"step_s": statistics.median(r["step"]), "vision_s": statistics.median(r["vision"]),
                      "rows": r["rows"]} for mode, r in res.items()}  # fmt: skip
    summary["same"] = bool(same)
    Path(out, f"rank{rank}.json").write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--grid", type=int, default=16, help="patches per side of each image (even)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--csv", default=str(REPO / "benchmarks" / "results" / "vision_split_cpu.csv"))
    args = ap.parse_args(argv)
    import tempfile

    import torch
    import torch.multiprocessing as mp
    import transformers

    import hf_ring

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, args, tmp), nprocs=2, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "hf_ring": hf_ring.__version__, "images": args.images, "patches_per_image": args.grid**2,
            "seq_len": args.images * (26 + args.grid**2 // 4)}  # fmt: skip
    rows = []
    slowest = {m: max(r[m]["step_s"] for r in ranks) for m in ("split", "whole")}
    vision = {m: max(r[m]["vision_s"] for r in ranks) for m in ("split", "whole")}
    for mode, name in (("split", "each rank its share (hf_ring)"), ("whole", "every rank every image")):
        row = {**meta, "mode": name, "patches_per_rank": " ".join(str(r[mode]["rows"]) for r in ranks),
               "step_s": round(slowest[mode], 3), "vision_forward_s": round(vision[mode], 3),
               "same_result": all(r["same"] for r in ranks), "status": "ok"}  # fmt: skip
        if mode == "split":
            row["step_ratio"] = round(slowest["split"] / slowest["whole"], 3)
            row["vision_ratio"] = round(vision["split"] / vision["whole"], 3)
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in FIELDS[7:]}), flush=True)
    if args.csv:
        append_rows(Path(args.csv), FIELDS, rows)
    return rows


if __name__ == "__main__":
    main()
