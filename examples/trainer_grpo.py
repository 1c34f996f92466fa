"""GRPO with LoRA on long prompts (TRL's GRPOTrainer) and context parallelism.

    accelerate launch --config_file examples/accelerate_cpu_2proc.yaml examples/trainer_grpo.py

Each prompt is a stretch of Python source (``--prompt-len`` tokens of the standard library, the demo's data)
followed by a question: name a function the source defines. The reward is verifiable: 1 when the completion's
first word is the name of a function defined in that prompt (the model must look back across the whole prompt),
else 0. ``hf_ring.trainer.RingGRPOTrainer`` generates ``--num-generations`` completions per prompt with
``ring_generate`` (the prompt and its KV cache sharded over the CP group), scores them with the ring, and trains
the LoRA adapters on TRL's GRPO loss, exactly as TRL's own GRPOTrainer would on one device per DP group. The script
ends with the logged losses and rewards.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEMO_MODEL, long_documents, trainer_setup  # noqa: E402

QUESTION = "\n# Question: name one function defined above.\n# Answer: def"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hub id or local folder (default: the demo SmolLM2-135M GGUF)")
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens of source per prompt")
    p.add_argument("--completion-len", type=int, default=8, help="max_completion_length")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--beta", type=float, default=0.0, help="KL coefficient (> 0: the adapter switched off is the reference)"
    )
    p.add_argument("--cp-size", type=int, default=None, help="context-parallel size (default: HF_RING_CP_SIZE or all)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--output-dir", default="outputs/trainer_grpo")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def defined_functions(text: str) -> set:
    return set(re.findall(r"^\s*def ([A-Za-z_]\w*)", text, flags=re.M))


def names_a_function(prompts, completions, **_) -> list:
    """1.0 when the completion starts with the name of a function its prompt defines, 0.25 for another word of the
    prompt, else 0."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        word = re.match(r"\s*([A-Za-z_]\w*)", completion)
        name = word.group(1) if word else None
        out.append(1.0 if name in defined_functions(prompt) else 0.25 if name and name in prompt else 0.0)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig

    from hf_ring.trainer import RingGRPOTrainer

    plugin, cp, dp, model, tokenizer = trainer_setup(args)
    docs = long_documents(tokenizer, args.prompt_len, 8 * args.steps * dp)
    texts = [tokenizer.decode(d["input_ids"]) for d in docs]
    prompts = [{"prompt": t + QUESTION} for t in texts if defined_functions(t)][: args.steps * dp]
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.num_generations,  # one prompt's completions per DP group and step
        num_generations=args.num_generations,
        max_completion_length=args.completion_len,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=args.beta,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=args.seed,
    )
    trainer = RingGRPOTrainer(
        model=model,
        reward_funcs=names_a_function,
        args=config,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=args.lora_r,
            lora_alpha=2 * args.lora_r,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),  # fmt: skip
        ring_plugin=plugin,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        name = DEMO_MODEL if args.model is None else args.model
        length = len(tokenizer(prompts[0]["prompt"])["input_ids"])
        print(f"\nhf_ring + TRL GRPOTrainer: {name}, CP={cp} x DP={dp}, prompts of {length} tokens, "
              f"{args.num_generations} completions of <= {args.completion_len} tokens each")  # fmt: skip
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"  step {h['step']:>3}  loss {h['loss']:+.4f}  reward {h['reward']:.3f}  "
                      f"completion length {h['completions/mean_length']:.1f}")  # fmt: skip
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()  # every rank closes the process group together


if __name__ == "__main__":
    main()
