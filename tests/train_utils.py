"""Tiny training runs shared by the Accelerate, Trainer, FSDP2 and DeepSpeed tests (their launched workers
import this module as ``tests.train_utils``; the repository root is on ``PYTHONPATH``).

A tiny random Llama, token datasets, the single-process references (per data-parallel replica, or the
Trainer's token-weighted loss), ``torchrun`` launches and their JSON results, the Trainer / TRL
arguments of those runs, and the switches to FSDP2 and DeepSpeed that Accelerate makes on a GPU (on CPU it
leaves both off), for an ``Accelerator`` or mixed into a Trainer class.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


VOCAB = 97


def tiny_llama(seed: int = 0):
    """A tiny random Llama (GQA: 4 query heads, 2 KV heads, head_dim 12), fp32, eager-free (sdpa) attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def token_dataset(n: int, seq_len: int, seed: int = 1) -> list:
    """``n`` samples of ``seq_len`` tokens; token 0 of sample i is i (to identify it); a few labels are -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (seq_len,), generator=g)
        ids[0] = i % VOCAB
        labels = ids.clone()
        k = int(torch.randint(0, seq_len // 2, (1,), generator=g))
        labels[:k] = -100  # a prompt of varying length: DP groups hold different numbers of targets
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(features: list) -> dict:
    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def full_loss_sum(model, batch) -> tuple[torch.Tensor, int]:
    """(sum of token losses, number of targets) of the unmodified model on a full batch."""
    out = model(**batch)
    n = int((batch["labels"][:, 1:] != -100).sum())
    return out.loss * n, n


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def max_param_rel_err(state_a: dict, state_b: dict) -> float:
    assert state_a.keys() == state_b.keys()
    return max(rel_err(state_a[k], state_b[k]) for k in state_a)


def torchrun(script: Path, nproc: int, *args, timeout: float = 300, env: dict | None = None) -> str:
    """Run ``script`` on ``nproc`` CPU processes with torchrun; return its output, fail the test on error."""
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    try:
        proc = subprocess.run(
            [*cmd, *map(str, args)], env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script.name} {args} did not finish within {timeout}s (a hang?)\n{e.stdout}\n{e.stderr}")
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{script.name} {args} failed (exit {proc.returncode}):\n{out[-12000:]}")
    return out


def run_worker(worker, *args) -> None:
    """A launched script's entry: ``worker(*args)``, then every rank leaves together.

    A rank that finished early used to exit while rank 0 still computed its references; tearing down
    gloo's (and DeepSpeed's) threads at interpreter exit can abort that process (SIGABRT, "terminate called
    without an active exception"), and torchrun then kills the others. A barrier and an explicit
    ``destroy_process_group`` close the group while every rank is alive. Only after success: a rank that
    raised exits with its traceback, and torchrun stops the rest.
    """
    import torch.distributed as dist

    worker(*args)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def read_results(folder: Path, world: int) -> list:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


# ---- the runs' settings and the Trainer ----------------------------------------------------------

SEQ_LEN = 30  # shard_batch pads it to a multiple of 2 x cp with ignored tokens
BATCH = 2
GA = 2  # the Trainer runs: gradient accumulation over 2 micro-batches
STEPS = 3
LR = 0.2


def trainer_args(out: Path, name: str, **kw):
    from transformers import TrainingArguments

    base = dict(
        output_dir=str(out / name),
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=GA,
        max_steps=STEPS,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        train_sampling_strategy="sequential",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def logged_losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def trainer_reference(batches_per_step: list, make=None) -> tuple[list, dict]:
    """Single process, full sequences, the Trainer's loss: token losses of every micro-batch / their targets.

    ``batches_per_step``: per optimizer step, a list of micro-batches, each a list of full batches whose
    documents do not see each other (one entry for unpacked batches, one per document when packed).
    ``make``: builds the model (default ``tiny_llama``).
    """
    model = (make or tiny_llama)()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for micro_batches in batches_per_step:
        parts = [full_loss_sum(model, b) for micro in micro_batches for b in micro]
        total = sum(s for s, _ in parts) / sum(n for _, n in parts)
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "t5 t7" -> [5, 7]
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def sft_trainer(cls, out: Path, train: list, model=None, collate_fn=None, name: str = "sft", **overrides):
    """``cls`` (RingSFTTrainer or a subclass) on a tiny Llama (or ``model``) with the run's settings, fp32, CP = 2.

    ``collate_fn``: builds a batch from samples of tensors (default: stacks them); ``overrides``: SFTConfig arguments
    on top (gradient accumulation, fsdp, ...)."""
    from datasets import Dataset
    from trl import SFTConfig

    from hf_ring.accelerate import RingAttentionPlugin

    sft_args = {k: v for k, v in trainer_args(out, name).to_dict().items() if k in SFT_KEYS}
    cfg = SFTConfig(
        **{**sft_args, **overrides},
        bf16=False,  # fp32 parity; TRL turns bf16 on by default
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
    )
    collate_fn = collate_fn or (lambda samples: {k: torch.stack([s[k] for s in samples]) for k in samples[0]})
    return cls(
        model=model if model is not None else tiny_llama(),
        args=cfg,
        train_dataset=Dataset.from_list([{k: v.tolist() for k, v in f.items()} for f in train]),
        # (a dataset of mixed rows gives None for the keys a row lacks)
        data_collator=lambda rows: collate_fn(
            [{k: torch.tensor(v) for k, v in r.items() if v is not None} for r in rows]
        ),
        processing_class=tiny_tokenizer(),
        ring_plugin=RingAttentionPlugin(cp_size=2),
    )


SFT_KEYS = (
    "output_dir",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "learning_rate",
    "optim",
    "lr_scheduler_type",
    "max_grad_norm",
    "weight_decay",
    "logging_steps",
    "report_to",
    "save_strategy",
    "train_sampling_strategy",
    "use_cpu",
    "disable_tqdm",
    "seed",
)


# ---- plugin runs and their single-process reference, per data-parallel replica -------------------------


def raw_batch(data, index, collate_fn=collate):
    return collate_fn(data[index * BATCH : (index + 1) * BATCH])


def image_samples(n: int, seq_len: int = SEQ_LEN) -> list:
    """``n`` Qwen2-VL samples of ``seq_len`` tokens, each with one image (4 x 4 patches, 4 tokens) at its own place
    (for ``tests.hf_models.make_model("qwen2_vl", images=True)``)."""
    from tests.hf_models import make_batch

    samples = []
    for i in range(n):
        batch, _ = make_batch("video", seq_len, seed=10 + i, family="qwen2_vl")  # row 0: an image at 5..8
        samples.append({
            "input_ids": batch["input_ids"][0], "labels": batch["labels"][0],
            "mm_token_type_ids": batch["mm_token_type_ids"][0],
            "pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"],
        })  # fmt: skip
    return samples


def gemma3_image_samples(n: int) -> list:
    """``n`` Gemma 3 samples of SEQ_LEN tokens, each with one 16-token image (``token_type_ids`` 1) at its own place,
    its tokens seeing each other both ways (for ``tests.hf_models.make_model("gemma3", images=True)``)."""
    from tests.hf_models import GEMMA3_IMAGE_TOKENS, MEDIA_TOKENS, VOCAB

    g = torch.Generator().manual_seed(20)
    samples = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (SEQ_LEN,), generator=g)
        start = 2 + 3 * (i % 4)
        types = torch.zeros_like(ids)
        types[start : start + GEMMA3_IMAGE_TOKENS] = 1
        ids[types == 1] = MEDIA_TOKENS["image_token_id"]
        labels = ids.masked_fill(types == 1, -100)
        pixels = torch.randn(1, 3, 56, 56, generator=g)
        samples.append({"input_ids": ids, "labels": labels, "token_type_ids": types, "pixel_values": pixels})
    return samples


def collate_images(samples: list) -> dict:
    """Token tensors stacked, every sample's image patches and grids concatenated (as Qwen2-VL's processor)."""
    return {k: (torch.cat if k in ("pixel_values", "image_grid_thw") else torch.stack)([s[k] for s in samples])
            for k in samples[0]}  # fmt: skip


def replica_reference(
    data, dp: int, steps: int, dtype=torch.float32, clip: float | None = None, make=None, collate_fn=collate
) -> tuple[list, dict]:
    """Single-process SGD on full sequences: per-step token-weighted losses and final weights.

    ``dtype=torch.bfloat16`` runs forward and backward on a bf16 copy and applies the fp32 gradients to
    the fp32 weights, as an FSDP2 policy with bf16 parameters and fp32 reduction does. ``clip``: the
    gradient-norm clipping of the update (DeepSpeed's ``gradient_clipping``). ``make``: builds the model
    (default ``tiny_llama``); ``collate_fn``: builds a batch from the samples.
    """
    master = (make or tiny_llama)()
    opt = torch.optim.SGD(master.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        model = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
        sums, counts, means = [], [], []
        for d in range(dp):
            s, n = full_loss_sum(model, raw_batch(data, step * dp + d, collate_fn))
            sums.append(s)
            counts.append(n)
            means.append(s / n)
        torch.stack(means).mean().backward()
        if model is not master:
            for p, q in zip(master.parameters(), model.parameters()):
                p.grad = q.grad.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(x.detach().float() for x in sums) / sum(counts)))
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def plugin_train(plugin, accelerator, model, data, steps, out=None, collate_fn=collate):
    from torch.utils.data import DataLoader

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dl = DataLoader(data, batch_size=BATCH, collate_fn=collate_fn)
    model, opt, dl = plugin.prepare(accelerator, model, opt, dl)
    losses, it = [], iter(dl)
    for step in range(steps):
        loss = model(**next(it)).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(plugin.reduce_loss(loss).item())
        if out is not None and step == steps - 2:
            accelerator.save_state(str(out / "state"))
    return model, opt, dl, losses


def full_state(model) -> dict:
    """The unsharded state dict of an FSDP2 model (every rank takes part)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


# The engines Accelerate and the Trainer switch to on a GPU, switched to on CPU ----------------------------


def switch_to_fsdp2(accelerator, fsdp_plugin) -> None:
    """Turn ``accelerator`` to FSDP2 with ``fsdp_plugin``, as Accelerate does on a GPU (on CPU it leaves FSDP off)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    # both shared states: every AcceleratorState() made later copies PartialState's fields over its own
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = fsdp_plugin


class OnFsdp2:
    """Mixed into a Trainer class: its Accelerator switched to the FSDP2 plugin its arguments describe,
    as Accelerate does on a GPU (on CPU it leaves FSDP off)."""

    def create_accelerator_and_postprocess(self):
        from accelerate import FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        switch_to_fsdp2(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
        self.is_fsdp_enabled = True


FSDP2_ARGS = dict(
    fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
)


def zero3_full_state(module) -> dict:
    """The full state dict of a (possibly ZeRO-3 partitioned) module (every rank takes part)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def switch_to_deepspeed(accelerator, ds_plugin, mixed_precision: str | None = None) -> None:
    """Turn ``accelerator`` to DeepSpeed with ``ds_plugin``, as Accelerate does on a GPU (on CPU it leaves it off)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    ds_plugin.set_mixed_precision(mixed_precision or accelerator.state._mixed_precision)
    accelerator.state.deepspeed_plugins = ds_plugin
    # both shared states: every AcceleratorState() made later copies PartialState's fields over its own
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.DEEPSPEED
    ds_plugin.select(_from_accelerator_state=True)
    accelerator.deepspeed_engine_wrapped = None


class OnDeepSpeed:
    """Mixed into a Trainer class: its Accelerator switched to the DeepSpeed plugin its arguments describe."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        switch_to_deepspeed(self.accelerator, self.args.deepspeed_plugin)
        self.is_deepspeed_enabled = True


def ds_config(stage: int) -> dict:
    """The Trainer's DeepSpeed configuration of ZeRO-``stage`` (batch sizes and clipping from its arguments)."""
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }


def reset_accelerate() -> None:
    """Forget the last Accelerator (DeepSpeed allows one model per Accelerator); the process group stays."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state()  # keeps PartialState, the process group
    if PartialState._shared_state:
        PartialState().distributed_type = DistributedType.MULTI_CPU  # switched back from DeepSpeed


def run_trainer(trainer) -> dict:
    """Train; the logged losses, the log history with a loss, the final weights (gathered from FSDP2), and the
    signature of the model's forward (which ``generate()`` reads)."""
    import inspect

    trainer.train()
    history = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    # (FSDP2's parameters are DTensors: every rank gathers each whole)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist() for k, v in model.state_dict().items()}
    from hf_ring.apply import unwrap_transformers_model

    signature = list(inspect.signature(unwrap_transformers_model(model).forward).parameters)  # (generate() reads it)
    return {"losses": logged_losses(trainer), "history": [h for h in history if "loss" in h], "state": state,
            "signature": signature}  # fmt: skip
