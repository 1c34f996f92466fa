"""``RingDPOTrainer`` and ``RingKTOTrainer`` (TRL's ``DPOTrainer`` / ``KTOTrainer`` with context parallelism) in
real ``torchrun`` launches on CPU.

Three launches of a tiny random Llama and its reference model (another random Llama), 3 steps of SGD with gradient
accumulation 2, prompts and completions of unequal lengths (right padding):

1. one process: TRL's own ``DPOTrainer``, the reference, for batches of 2 pairs (sigmoid + SFT losses: per-token
   log-probabilities of the chosen completions) and of 4 pairs (sigmoid with WPO weighting: TRL's per-token
   ``log_sum_sq_probs``); and the refusals of ``RingDPOTrainer``;
2. two processes, CP = 2, batches of 2 pairs: the logged losses, every logged metric and the final weights equal
   the reference's;
3. four processes, DP = 2 x CP = 2, 2 pairs per DP group: equal to the single process on batches of 4 pairs
   (the sigmoid loss is a mean over pairs: the mean over 2 replicas of their means is the mean over 4).

The CP = 2 launch also trains LoRA adapters without a reference model (TRL's reference is then the model with its
adapter switched off), against TRL's own trainer doing the same, and run 2 again under DeepSpeed ZeRO-2 (which wraps
the reference model in an engine before hf_ring sees it), and ``RingKTOTrainer`` (unpaired completions, a third of
them undesirable; its KL term from mismatched pairs of the batch) against TRL's ``KTOTrainer``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import (
    SFT_KEYS,
    VOCAB,
    run_trainer,
    run_worker,
    tiny_llama,
    tiny_tokenizer,
    torchrun,
    trainer_args,
)

pytest.importorskip("trl")
pytest.importorskip("datasets")

RTOL = 1e-5  # fp32: ring attention and the gathered log-probabilities reorder sums, nothing else changes
# DeepSpeed's final weights: ZeRO sums the gradients in its buckets' order, and Adam divides each by its running RMS,
# so an entry whose gradient is near zero moves by up to the learning rate on rounding alone (measured 1.06e-5 in
# layer 0's v_proj on an Intel Xeon, 2026-12-06; it passed at 1e-5 on the AMD EPYC machines of earlier CI runs; the
# losses and metrics stay within RTOL)
ZERO_WEIGHTS_RTOL = 2e-5
PAIRS = 2  # per DP group and micro-batch
BETA = 0.5


def _rows(n: int, seed: int = 7) -> list:
    """Text preference pairs of the tiny tokenizer's words: prompts and completions of 4 to 11 tokens."""
    g = torch.Generator().manual_seed(seed)

    def words(k):
        return " ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (k,), generator=g))

    out = []
    for _ in range(n):
        lp, lc, lr = (int(x) for x in torch.randint(4, 12, (3,), generator=g))
        out.append({"prompt": words(lp), "chosen": words(lc), "rejected": words(lr)})
    return out


def _trainer(cls, out: Path, name: str, dp: int, per_device: int, lora: bool = False, **extra):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig

    base = {k: v for k, v in trainer_args(out, name).to_dict().items() if k in SFT_KEYS}
    base["per_device_train_batch_size"] = per_device
    # one DP group: the SFT loss too (a mean over the batch's chosen tokens, which DP replicas would average per
    # replica); two: the sigmoid loss with WPO's weights
    losses = {"loss_type": ["sigmoid", "sft"]} if dp == 1 else {"loss_type": ["sigmoid"], "use_weighting": True}
    cfg = DPOConfig(**base, bf16=False, beta=BETA, **losses, **extra.pop("config", {}))
    rows = _rows(3 * 2 * PAIRS * dp)  # steps x accumulation x pairs x DP groups
    if lora:  # (its A matrices drawn from this seed)
        torch.manual_seed(11)
        extra.update(peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    return cls(model=tiny_llama(), ref_model=None if lora else tiny_llama(seed=3), args=cfg,
               train_dataset=Dataset.from_list(rows), processing_class=tiny_tokenizer(), **extra)  # fmt: skip


def _kto(cls, out: Path, name: str, n: int = 24, **extra):
    """KTO on ``n`` unpaired completions, 4 per micro-batch (the KL term pairs each prompt with another's
    completion)."""
    from datasets import Dataset
    from trl import KTOConfig

    base = {k: v for k, v in trainer_args(out, name).to_dict().items() if k in SFT_KEYS}
    base["per_device_train_batch_size"] = 4
    rows = [{"prompt": r["prompt"], "completion": r["chosen"], "label": bool(i % 3)} for i, r in enumerate(_rows(n))]
    return cls(model=tiny_llama(), ref_model=tiny_llama(seed=3), args=KTOConfig(**base, bf16=False, beta=BETA),
               train_dataset=Dataset.from_list(rows), processing_class=tiny_tokenizer(), **extra)  # fmt: skip


def worker(out: Path, world: int, plain: bool = False) -> None:
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingDPOTrainer

    rank = int(os.environ.get("RANK", "0"))
    if plain:  # TRL's own KTOTrainer over 2 DP processes, 26 completions: the last batch short
        from trl import KTOTrainer

        res = {"kto_uneven": run_trainer(_kto(KTOTrainer, out, "plain_kto", n=26))}
        (out / f"plain{world}rank{rank}.json").write_text(json.dumps(res))
        return
    if world == 1:
        from trl import DPOTrainer

        res = {f"dp{dp}": run_trainer(_trainer(DPOTrainer, out, f"ref{dp}", dp, PAIRS * dp)) for dp in (1, 2)}
        res["lora"] = run_trainer(_trainer(DPOTrainer, out, "ref_lora", 1, PAIRS, lora=True))
        from trl import KTOTrainer

        res["kto"] = run_trainer(_kto(KTOTrainer, out, "ref_kto"))
        try:
            _trainer(RingDPOTrainer, out, "refused", 1, PAIRS, config={"precompute_ref_log_probs": True},
                     ring_plugin=RingAttentionPlugin(cp_size=1))  # fmt: skip
            res["refused"] = "no error"
        except ValueError as e:
            res["refused"] = str(e)
    else:
        trainer = _trainer(RingDPOTrainer, out, "ring", world // 2, PAIRS, ring_plugin=RingAttentionPlugin(cp_size=2))
        res = run_trainer(trainer)
        if world == 2:
            lora = _trainer(
                RingDPOTrainer, out, "lora", 1, PAIRS, lora=True, ring_plugin=RingAttentionPlugin(cp_size=2)
            )
            res["lora"] = run_trainer(lora)
            res["deepspeed"] = _on_deepspeed(out)
            from hf_ring.trainer import RingKTOTrainer

            res["kto"] = run_trainer(_kto(RingKTOTrainer, out, "kto", ring_plugin=RingAttentionPlugin(cp_size=2)))
        if world == 4:  # DP 2 x CP 2, the last batch short: KTO's KL term gathered as a plain DP run gathers it
            from hf_ring.trainer import RingKTOTrainer

            kto = _kto(RingKTOTrainer, out, "kto_uneven", n=26, ring_plugin=RingAttentionPlugin(cp_size=2))
            res["kto_uneven"] = run_trainer(kto)
    (out / f"w{world}rank{rank}.json").write_text(json.dumps(res))


def _on_deepspeed(out: Path) -> dict | None:
    """Run 2 under DeepSpeed ZeRO-2 (None without DeepSpeed)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return None
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingDPOTrainer
    from tests.train_utils import OnDeepSpeed, ds_config, reset_accelerate

    reset_accelerate()
    cls = type("DeepSpeedDPO", (OnDeepSpeed, RingDPOTrainer), {})
    trainer = _trainer(cls, out, "deepspeed", 1, PAIRS, config={"deepspeed": ds_config(2)},
                       ring_plugin=RingAttentionPlugin(cp_size=2))  # fmt: skip
    return run_trainer(trainer)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("preference")
    for world in (1, 2, 4):
        torchrun(Path(__file__), world, out, world, timeout=420, env={"DS_ACCELERATOR": "cpu"})
    torchrun(Path(__file__), 2, out, 2, "plain", timeout=420)
    reference = json.loads((out / "w1rank0.json").read_text())
    reference["kto_uneven"] = json.loads((out / "plain2rank0.json").read_text())["kto_uneven"]
    return reference, {w: [json.loads((out / f"w{w}rank{r}.json").read_text()) for r in range(w)] for w in (2, 4)}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-6)


@pytest.mark.parametrize(
    "world, case, run",
    [
        (2, "dp1", None),
        (4, "dp2", None),
        (2, "lora", "lora"),
        (2, "dp1", "deepspeed"),
        (2, "kto", "kto"),
        (4, "kto_uneven", "kto_uneven"),
    ],
    ids=["cp2", "dp2xcp2", "cp2-lora", "cp2-deepspeed", "cp2-kto", "dp2xcp2-kto-short-batch"],
)
def test_ring_preference_trainers_match_trl_on_the_whole_sequences(runs, world, case, run):
    """Losses, every metric TRL logs (rewards, margins, log-probabilities, logits, entropy, token accuracy, token
    count) and the final weights of every rank equal TRL's own trainer on the whole sequences; the model's forward
    keeps the signature generate() reads."""
    reference, launches = runs
    ref = reference[case]
    if run == "deepspeed" and launches[world][0]["deepspeed"] is None:
        pytest.skip("DeepSpeed is not installed")
    for r in launches[world]:
        r = r[run] if run else r
        assert r["signature"] == ref["signature"] and "position_ids" in r["signature"]
        assert max(_rel(a, b) for a, b in zip(r["losses"], ref["losses"], strict=True)) <= RTOL, (r["losses"], ref)
        for got, want in zip(r["history"], ref["history"], strict=True):
            assert got.keys() == want.keys()
            # a reward is beta times a difference of two log-probability sums, near zero while the policy is near its
            # reference (exactly zero at a LoRA run's start): its error scales with those sums, not with itself
            logps = BETA * max((abs(v) for k, v in want.items() if k.startswith("logps/")), default=0.0)
            # a mean logit over the vocabulary is near zero for a random model; its error scales with the logits (0.1)
            for key in want:
                scale = max(abs(want[key]), logps if key.startswith("rewards/") else 0.1 * key.startswith("logits/"))
                err = abs(got[key] - want[key]) / scale if scale else _rel(got[key], want[key])
                assert err <= RTOL, (world, key, got[key], want[key])
        bound = ZERO_WEIGHTS_RTOL if run == "deepspeed" else RTOL
        for name, value in ref["state"].items():
            a, b = torch.tensor(r["state"][name]), torch.tensor(value)
            assert float((a - b).norm() / b.norm()) <= bound, (world, name)


def test_ring_preference_trainers_refuse_what_they_cannot_compute(runs):
    reference, _ = runs
    assert "does not support precompute_ref_log_probs=True" in reference["refused"], reference["refused"]


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "plain")
