"""RingAttentionTrainer / RingSFTTrainer in a real 2-process ``torchrun`` launch on CPU (CP = 2).

One launch trains a tiny random Llama three times and writes its figures to JSON:

1. ``RingAttentionTrainer`` with padding-free fixed-length batches, gradient accumulation 2, SGD:
   per-step logged losses and final weights equal single-process training on the full sequences
   with the Trainer's token-weighted loss (sum over every micro-batch / their number of targets);
   ``evaluate()`` gives the eval loss a single-process Trainer reports (odd eval set: a short last batch);
2. the same with packing (``DataCollatorWithFlattening``): documents do not see each other, so the
   reference is every document run on its own;
3. TRL's ``SFTTrainer`` through ``RingSFTTrainer`` (skipped when TRL is missing);
4. resume: packed batches, AdamW, a checkpoint after step 2, then a new Trainer with
   ``train(resume_from_checkpoint=...)``: step 3's loss (the third batch: the data position is restored) and the
   final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.train_utils import (
    BATCH,
    GA,
    SEQ_LEN,
    STEPS,
    VOCAB,
    collate,
    full_loss_sum,
    logged_losses,
    max_param_rel_err,
    read_results,
    run_worker,
    sft_trainer,
    tiny_llama,
    token_dataset,
    torchrun,
    trainer_args,
    trainer_reference,
)

RTOL = 1e-5  # fp32: ring attention reorders sums, nothing else changes


def _token_metrics_reference(micro_batches: list) -> list:
    """TRL's logged (entropy, mean_token_accuracy) of the first step, from the initial model on full sequences:
    per micro-batch, the mean over its target tokens (of every rank), then the mean over the micro-batches."""
    model = tiny_llama()
    entropies, accuracies = [], []
    with torch.no_grad():
        for (batch,) in micro_batches:  # one DP group (CP = 2 on 2 ranks)
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
            target = batch["labels"][:, 1:]
            valid = target != -100
            logp = logits.float().log_softmax(-1)
            entropies.append(float(-(logp.exp() * logp).sum(-1)[valid].mean()))
            accuracies.append(float((logits.argmax(-1) == target)[valid].float().mean()))
    return [(sum(entropies) / len(entropies), sum(accuracies) / len(accuracies))]


def _eval_reference(eval_data: list, state: dict, dp: int) -> float:
    """The eval loss a plain ``dp``-process Trainer reports, computed in one process.

    Process d evaluates its shard of the batches (Accelerate pads the last one from the start); its
    loss is dp x (its token-loss sum) / (targets of the step over every process), repeated
    eval-batch-size times, gathered, the padding dropped from the last step, and averaged.
    """
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    model = tiny_llama()
    model.load_state_dict(state)
    sampler = BatchSampler(SequentialSampler(range(len(eval_data))), BATCH, False)
    shards = [list(BatchSamplerShard(sampler, dp, d)) if dp > 1 else list(sampler) for d in range(dp)]
    values = []
    with torch.no_grad():
        for step in range(len(shards[0])):
            parts = [full_loss_sum(model, collate([eval_data[i] for i in shards[d][step]])) for d in range(dp)]
            total = sum(n for _, n in parts)
            gathered = [float(dp * s / total) for s, _ in parts for _ in range(BATCH)]
            if step == len(shards[0]) - 1 and len(eval_data) % (BATCH * dp):
                gathered = gathered[: len(eval_data) % (BATCH * dp)]
            values += gathered
    return sum(values) / len(values)


def _packed_features(n: int, seed: int = 5) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 19, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def worker(out: Path, world: int) -> None:
    import torch.distributed as dist

    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.loss import is_chunked
    from hf_ring.trainer import RingAttentionTrainer

    rank = int(os.environ.get("RANK", "0"))
    dp = world // 2
    res: dict = {}

    # 1: fixed-length batches, gradient accumulation, evaluation
    train = token_dataset(BATCH * GA * STEPS * dp, SEQ_LEN)
    evals = token_dataset(5, SEQ_LEN, seed=3)
    model = tiny_llama()
    trainer = RingAttentionTrainer(
        model=model,
        args=trainer_args(out, "plain"),
        train_dataset=train,
        eval_dataset=evals,
        data_collator=collate,
        ring_plugin=RingAttentionPlugin(cp_size=2),
    )
    trainer.train()
    res["chunked"] = is_chunked(model)  # the plugin's default: the loss without [tokens, vocab] logits
    res["losses"] = logged_losses(trainer)
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    res["total_batch"] = trainer.get_total_train_batch_size(trainer.args)
    plain_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    extra = _packed_and_trl(out, train) if world == 2 else {}
    res.update({k: v for k, v in extra.items() if not k.endswith("_state")})

    if rank == 0:
        # step s, micro-batch m: DP group d gets batch (s * GA + m) * dp + d of the sequential order
        steps = [
            [[collate(train[((s * GA + m) * dp + d) * BATCH :][:BATCH]) for d in range(dp)] for m in range(GA)]
            for s in range(STEPS)
        ]
        ref_losses, ref_state = trainer_reference(steps)
        res["ref_losses"] = ref_losses
        res["weights_err"] = max_param_rel_err(plain_state, ref_state)
        res["eval_ref"] = _eval_reference(evals, ref_state, dp)
        if "packed_state" in extra:

            def doc(f):
                return {"input_ids": torch.tensor([f["input_ids"]]), "labels": torch.tensor([f["labels"]])}

            # one micro-batch per step, holding 3 documents that do not see each other
            feats = extra["feats"]
            packed_steps = [[[doc(f) for f in feats[3 * s : 3 * s + 3]]] for s in range(STEPS)]
            packed_ref_losses, packed_ref_state = trainer_reference(packed_steps)
            res["packed_ref_losses"] = packed_ref_losses
            res["packed_weights_err"] = max_param_rel_err(extra["packed_state"], packed_ref_state)
        if "trl_state" in extra:
            res["trl_weights_err"] = max_param_rel_err(extra["trl_state"], ref_state)
            res["trl_metrics_ref"] = _token_metrics_reference(steps[0])
    res.pop("feats", None)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    if dist.is_initialized():
        dist.barrier()


def _packed_and_trl(out: Path, train: list) -> dict:
    """Runs 2 (packing) and 3 (TRL) of the module docstring; returns losses and final weights."""
    from transformers import DataCollatorWithFlattening

    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.loss import is_chunked
    from hf_ring.trainer import RingAttentionTrainer

    res: dict = {}
    feats = _packed_features(3 * STEPS)
    packed_model = tiny_llama()
    trainer = RingAttentionTrainer(
        model=packed_model,
        args=trainer_args(out, "packed", per_device_train_batch_size=3, gradient_accumulation_steps=1),
        train_dataset=feats,
        data_collator=DataCollatorWithFlattening(),
        # the chunked loss switched off (the model's own loss); the Ulysses x Ring hybrid (U = 2) passed through
        ring_plugin=RingAttentionPlugin(cp_size=2, chunked_loss=False, ulysses_size=2),
    )
    trainer.train()
    res["packed_chunked"] = is_chunked(packed_model)
    res["packed_ulysses"] = sorted(
        {m.hf_ring_config.ulysses.ulysses_size for m in packed_model.modules() if hasattr(m, "hf_ring_config")}
    )
    res["feats"] = feats
    res["packed_losses"] = logged_losses(trainer)
    res["packed_state"] = {k: v.detach().clone() for k, v in packed_model.state_dict().items()}
    res.update(_resume(out, feats))

    try:
        import datasets  # noqa: F401 - sft_trainer builds its dataset with it

        from hf_ring.trainer import RingSFTTrainer  # ImportError without TRL
    except ImportError:
        res["trl"] = None
        return res
    try:  # a MoE model: TRL turns its router's auxiliary loss on
        from tests.hf_models import make_model

        sft_trainer(RingSFTTrainer, out, train, model=make_model("mixtral"), name="sft_moe")
        res["trl_moe"] = "no error"
    except ValueError as e:
        res["trl_moe"] = str(e)
    trainer = sft_trainer(RingSFTTrainer, out, train)
    trainer.train()
    # TRL's own fused LM head (no full logits either) stays in charge; its metrics come from it
    res["trl_keeps_its_head"] = "forward" in vars(trainer.model) and not is_chunked(trainer.model)
    res["trl_metrics"] = [
        (h["entropy"], h["mean_token_accuracy"]) for h in trainer.state.log_history if "entropy" in h
    ][:1]
    res["trl"] = logged_losses(trainer)
    res["trl_state"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return res


def _cpu_resume_unsupported() -> str | None:
    """Why this Transformers release cannot resume a multi-process CPU run, or None."""
    import inspect

    from transformers import Trainer

    if "map_location = self.args.device" in inspect.getsource(Trainer._load_optimizer_and_scheduler):
        return (
            "this Transformers release loads the optimizer state with map_location=args.device, which torch.load "
            "refuses for a multi-process CPU run ('cpu:0'); later releases load it on 'cpu'"
        )
    return None


def _resume(out: Path, feats: list) -> dict:
    """Run 4: the uninterrupted run (a checkpoint after step 2), then a new Trainer resuming from it."""
    reason = _cpu_resume_unsupported()
    if reason is not None:
        return {"resume_skipped": reason}
    from transformers import DataCollatorWithFlattening

    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingAttentionTrainer

    def trainer(model):
        args = trainer_args(out, "resume", per_device_train_batch_size=3, gradient_accumulation_steps=1, optim="adamw_torch",
                     learning_rate=0.01, save_strategy="steps", save_steps=2)  # fmt: skip
        return RingAttentionTrainer(model=model, args=args, train_dataset=feats,
                                    data_collator=DataCollatorWithFlattening(),
                                    ring_plugin=RingAttentionPlugin(cp_size=2))  # fmt: skip

    first = tiny_llama()
    run = trainer(first)
    run.train()
    resumed = tiny_llama(seed=1)  # other initial weights: the checkpoint must bring them back
    again = trainer(resumed)
    again.train(resume_from_checkpoint=str(out / "resume" / "checkpoint-2"))
    weights = max_param_rel_err(resumed.state_dict(), first.state_dict())
    return {"resume_losses": logged_losses(run), "resumed_losses": logged_losses(again), "resume_weights_err": weights}


# ---- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "dp2xcp2"])
def launch(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"trainer_w{world}")
    torchrun(Path(__file__), world, out, world, timeout=420)
    return read_results(out, world)


def _close(got, ref):
    assert len(got) == len(ref)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= RTOL, (got, ref)


def test_trainer_losses_and_weights_match_single_process(launch):
    r = launch[0]
    assert all(x["chunked"] for x in launch)  # under the plugin's default chunked loss
    _close(r["losses"], r["ref_losses"])
    assert r["weights_err"] <= RTOL
    assert all(x["losses"] == r["losses"] for x in launch)
    assert r["total_batch"] == BATCH * GA * (len(launch) // 2)  # CP ranks share their samples


def test_trainer_eval_loss_matches_the_plain_data_parallel_run(launch):
    r = launch[0]
    assert abs(r["eval_loss"] - r["eval_ref"]) / r["eval_ref"] <= RTOL
    assert all(x["eval_loss"] == r["eval_loss"] for x in launch)


def test_trainer_packing_with_data_collator_with_flattening(launch):
    r = launch[0]
    if len(launch) != 2:
        pytest.skip("checked once, on the CP = 2 launch")
    _close(r["packed_losses"], r["packed_ref_losses"])
    assert r["packed_weights_err"] <= RTOL
    assert not r["packed_chunked"]  # chunked_loss=False: the model's own loss, exact as well
    assert r["packed_ulysses"] == [2]  # under the Ulysses x Ring hybrid


def test_trainer_resume_from_checkpoint_continues_exactly(launch):
    """Packed batches: after resuming from the step-2 checkpoint, step 3 (its batch, its loss) and the final
    weights are the uninterrupted run's."""
    if len(launch) != 2:
        pytest.skip("checked once, on the CP = 2 launch")
    if "resume_skipped" in launch[0]:
        pytest.skip(launch[0]["resume_skipped"])
    for r in launch:
        assert len(r["resume_losses"]) == STEPS and r["resumed_losses"], r
        _close(r["resumed_losses"][-1:], r["resume_losses"][-1:])
        assert r["resume_weights_err"] <= RTOL


def test_trl_sft_trainer(launch):
    r = launch[0]
    if len(launch) != 2:
        pytest.skip("checked once, on the CP = 2 launch")
    if r.get("trl") is None:
        pytest.skip("TRL is not installed")
    _close(r["trl"], r["ref_losses"])
    assert r["trl_weights_err"] <= RTOL
    assert all(x["trl_keeps_its_head"] for x in launch)
    assert all("router_aux_loss_coef=0.0" in x["trl_moe"] for x in launch), r["trl_moe"]
    # entropy and token accuracy, exact over the CP group (TRL gathers its per-rank sums over every process)
    ((entropy, accuracy),) = r["trl_metrics"]
    ((want_entropy, want_accuracy),) = r["trl_metrics_ref"]
    assert abs(entropy - want_entropy) <= 1e-4 * want_entropy and abs(accuracy - want_accuracy) <= 1e-6


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]), int(sys.argv[2]))


def test_label_smoothing_is_refused(tmp_path):
    """The Trainer's label smoother shifts the labels again (``shard_batch`` shifted them already): refused at
    construction rather than trained on the token after next."""
    from accelerate.state import AcceleratorState

    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingAttentionTrainer

    try:
        with pytest.raises(ValueError, match="label_smoothing_factor"):
            RingAttentionTrainer(model=tiny_llama(), args=trainer_args(tmp_path, "smooth", label_smoothing_factor=0.1),
                                 train_dataset=token_dataset(4, 21), data_collator=collate,
                                 ring_plugin=RingAttentionPlugin(cp_size=1))  # fmt: skip
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _metrics_gather(rank: int, world: int) -> list:
    """RingSFTTrainer's gather of TRL's per-rank metric sums on a last batch that Accelerate cuts to 1 sample
    (CP = 2, DP = 1): stand-ins for the trainer's ring setup and Accelerate's gradient state."""
    import types

    import torch.distributed as dist

    from hf_ring.trainer import _ring_sft_trainer

    cls = _ring_sft_trainer()
    groups = [dist.new_group([r]) for r in range(world)]  # (every rank creates every group)
    dp_group = groups[rank]
    state = types.SimpleNamespace(end_of_dataloader=True, remainder=1)
    ring = types.SimpleNamespace(world_size=world, cp_group=dist.group.WORLD, dp_group=dp_group, dp_size=1)
    fake = types.SimpleNamespace(ring_setup=ring, accelerator=types.SimpleNamespace(gradient_state=state))
    fake._ring_gather_for_metrics = types.MethodType(cls._ring_gather_for_metrics, fake)
    shard_sum = torch.tensor(float(10 + rank))  # this rank's tokens' sum
    return cls._cp_summed_gather(fake, shard_sum).tolist()


def test_sft_metrics_sum_every_cp_rank_on_a_cut_last_batch():
    """TRL sums its per-rank entropies and counts with gather_for_metrics, whose cut of the last batch keeps as many
    values as samples: over the CP group's processes it would keep rank 0's shard alone. Summed over the CP group
    first, gathered over DP (one group here): the whole sequence's sum on every rank."""
    pytest.importorskip("trl")
    assert run_distributed(_metrics_gather, 2) == [[21.0], [21.0]]
