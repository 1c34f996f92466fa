"""LoRA fine-tuning on long documents with the Hugging Face Trainer (or TRL's SFTTrainer) and context parallelism.

    accelerate launch --config_file examples/accelerate_cpu_2proc.yaml examples/trainer_sft.py [--trl] [--packing]

The same model and data as ``finetune_lora_long_context.py``, trained by ``hf_ring.trainer.RingAttentionTrainer``
(``--trl``: ``hf_ring.trainer.RingSFTTrainer``, when TRL is installed). ``--packing`` packs several
shorter documents per sequence with ``DataCollatorWithFlattening`` (documents do not attend to each
other). The loss is token-weighted across CP ranks, DP groups and gradient accumulation; the script
ends with the Trainer's logged losses and an evaluation loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEMO_MODEL, collate, long_documents, trainer_setup  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hub id or local folder (default: the demo SmolLM2-135M GGUF)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per DP group per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cp-size", type=int, default=None, help="context-parallel size (default: HF_RING_CP_SIZE or all)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--trl", action="store_true", help="use TRL's SFTTrainer (RingSFTTrainer)")
    p.add_argument("--packing", action="store_true", help="pack 4 documents per sequence (DataCollatorWithFlattening)")
    p.add_argument("--output-dir", default="outputs/trainer_sft")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorWithFlattening

    plugin, cp, dp, model, tokenizer = trainer_setup(args)
    model = get_peft_model(
        model,
        LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=args.lora_targets.split(",")
        ),
    )

    n = args.steps * args.grad_accum * args.batch_size * dp
    if args.packing:  # 4 shorter documents per packed sequence
        docs = long_documents(tokenizer, args.seq_len // 4, 4 * (n + dp))
        rows = [{"input_ids": d["input_ids"].tolist(), "labels": d["labels"].tolist()} for d in docs]
        train, evals = rows[: 4 * n], rows[4 * n :]
        collator = DataCollatorWithFlattening()
        per_device = 4 * args.batch_size
    else:
        rows = long_documents(tokenizer, args.seq_len, n + dp)
        train, evals = rows[:n], rows[n:]
        collator = collate
        per_device = args.batch_size
    common = dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        remove_unused_columns=False,
    )
    if args.trl:
        from datasets import Dataset
        from trl import SFTConfig

        from hf_ring.trainer import RingSFTTrainer

        to_lists = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.items()} for r in train]
        config = SFTConfig(**common, bf16=False, dataset_kwargs={"skip_prepare_dataset": True})
        trainer = RingSFTTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(to_lists),
            eval_dataset=Dataset.from_list(
                [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in r.items()} for r in evals]
            ),
            data_collator=collator if args.packing else _list_collate,
            processing_class=tokenizer,
            ring_plugin=plugin,
        )
    else:
        from transformers import TrainingArguments

        from hf_ring.trainer import RingAttentionTrainer

        trainer = RingAttentionTrainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=train,
            eval_dataset=evals,
            data_collator=collator,
            ring_plugin=plugin,
        )
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        kind = "TRL SFTTrainer" if args.trl else "Trainer"
        name = DEMO_MODEL if args.model is None else args.model
        print(f"\nhf_ring + {kind}: {name}, CP={cp} x DP={dp}, seq_len {args.seq_len}")
        print("  packing: DataCollatorWithFlattening (4 documents per sequence)" if args.packing else "  no packing")
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"  step {h['step']:>3}  loss {h['loss']:.4f}")
        print(f"  eval loss {metrics['eval_loss']:.4f}")
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # every rank closes the process group together


def _list_collate(features: list) -> dict:
    return {k: torch.tensor([f[k] for f in features]) for k in features[0]}


if __name__ == "__main__":
    main()
