"""RingAttentionPlugin in real ``torchrun`` launches on CPU (gloo): CP = 2, and DP = 2 x CP = 2.

One launch per world size runs every check (tiny random Llama, fp32) and writes its figures to JSON;
the tests below assert on them:

- SGD steps with ``plugin.prepare`` + ``accelerator.backward`` give the same per-step losses and final
  weights as single-process training on the full sequences (CP shares summed, DP averaged);
- gradient accumulation (``accelerator.accumulate``) likewise, with the Ulysses x Ring hybrid (U = 2);
- the data: every rank of a CP group holds a shard of the same batch; DP group d gets the batches a
  plain ``dp``-process run gives process d; shuffled epochs cover the data once; spawned workers;
- ``reduce_loss`` is the same on every rank; schedulers step like a ``dp``-process run;
- ``save_state`` / ``load_state`` + ``skip_first_batches`` resume to the identical next loss;
- ``unwrap_model`` is the original model and ``save_pretrained`` loads without hf_ring;
- a cp_size that does not divide the world raises on every rank, before any collective;
- ``plugin.check_exactness`` before ``prepare`` runs over each CP group, every DP group with its own batch;
- batches with images (Qwen2-VL, trainable vision tower) over DP = 2 x CP = 2: the losses and final weights of
  single-process training (DP replicas averaged).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import (
    REPO,
    collate,
    collate_images,
    full_loss_sum,
    image_samples,
    max_param_rel_err,
    plugin_train,
    read_results,
    rel_err,
    replica_reference,
    run_worker,
    tiny_llama,
    token_dataset,
    torchrun,
)

SEQ_LEN = 30  # not a multiple of 2 x cp: shard_batch pads it with ignored tokens
BATCH = 2
LR = 0.2
STEPS = 3
GA = 2
LORA_STEPS = 2
RTOL = 1e-5  # fp32, the bound: ring attention reorders sums, nothing else changes


# ---- the worker (run by torchrun) ----------------------------------------------------------------


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    return get_peft_model(model, cfg)  # random B (not zero), so the first step already tests the adapter


def _trainable(model) -> dict:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def _raw_batch(data, index):
    return collate(data[index * BATCH : (index + 1) * BATCH])


def _reference(data, dp: int, steps: int, ga: int) -> tuple[list, dict]:
    """Single-process training on full sequences: per micro-batch token-weighted losses, final weights."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        for micro in range(ga):
            sums, counts, means = [], [], []
            for d in range(dp):
                s, n = full_loss_sum(model, _raw_batch(data, (step * ga + micro) * dp + d))
                sums.append(s)
                counts.append(n)
                means.append(s / n)
            (torch.stack(means).mean() / ga).backward()  # DP replicas averaged, micro-batches averaged
            losses.append(float(sum(x.detach() for x in sums) / sum(counts)))
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full_ids(plugin, local_ids):
    import torch.distributed as dist

    from hf_ring import unshard

    parts = [torch.empty_like(local_ids) for _ in range(plugin.cp_size)]
    dist.all_gather(parts, local_ids.contiguous(), group=plugin.cp_group)
    return unshard(parts, dim=1, layout=plugin.layout)[:, :SEQ_LEN]


def worker(out: Path) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from hf_ring.accelerate import RingAttentionPlugin

    accelerator = Accelerator(cpu=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    res: dict = {"world": world}

    # a cp_size that does not divide the world: every rank raises, and no collective started (no hang)
    try:
        RingAttentionPlugin(cp_size=world + 1).prepare(accelerator, tiny_llama())
    except ValueError as e:
        res["bad_cp_error"] = str(e)

    plugin = RingAttentionPlugin(cp_size=2)
    dp = world // 2
    data = token_dataset(BATCH * dp * (STEPS * GA + 1), SEQ_LEN)

    # the exactness check before prepare: over each CP group, every DP group its own batch
    d = plugin.setup(accelerator).dp_rank
    check = plugin.check_exactness(accelerator, tiny_llama(), collate(data[d * BATCH : (d + 1) * BATCH]))
    res["check"] = {"ok": check.ok, "ranks": check.ranks, "reference_loss": check.reference_loss}

    # -- A: plain SGD steps, a scheduler, save_state after step 2, resume ------------------------
    model = tiny_llama()
    original = model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    dl = DataLoader(data, batch_size=BATCH, collate_fn=collate)
    model, opt, dl, sched = plugin.prepare(accelerator, model, opt, dl, sched)
    res["groups"] = {
        "cp": dist.get_process_group_ranks(plugin.cp_group),
        "dp": dist.get_process_group_ranks(plugin.dp_group),
        "mesh": plugin.device_mesh.mesh.tolist(),
        "dims": list(plugin.device_mesh.mesh_dim_names),
        "cp_rank": plugin.cp_rank,
        "dp_rank": plugin.dp_rank,
    }
    res["unwrap_is_original"] = accelerator.unwrap_model(model) is original
    losses, data_ok, shapes = [], [], []
    it = iter(dl)
    for step in range(STEPS):
        batch = next(it)
        shapes.append(list(batch["input_ids"].shape))
        data_ok.append(
            bool(
                torch.equal(
                    _full_ids(plugin, batch["input_ids"]), _raw_batch(data, step * dp + plugin.dp_rank)["input_ids"]
                )
            )
        )
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(plugin.reduce_loss(loss).item())
        if step == STEPS - 2:
            accelerator.save_state(str(out / "state"))
    res["losses"], res["data_ok"], res["shapes"] = losses, data_ok, shapes
    res["scheduler_steps"] = sched.scheduler.last_epoch
    final = {k: v.detach().clone() for k, v in original.state_dict().items()}

    accelerator.load_state(str(out / "state"))
    batch = next(iter(accelerator.skip_first_batches(dl, STEPS - 1)))
    loss = model(**batch).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    res["resumed_loss"] = plugin.reduce_loss(loss).item()
    res["resumed_weights_err"] = max_param_rel_err(original.state_dict(), final)

    if accelerator.is_main_process:
        original.save_pretrained(out / "ckpt")
        torch.save(final, out / "final.pt")

    # -- B: gradient accumulation, under the Ulysses x Ring hybrid (U = 2: heads exchanged, a ring of one) --
    accelerator.gradient_accumulation_steps = GA
    model_b = tiny_llama()
    original_b = model_b
    opt_b = torch.optim.SGD(model_b.parameters(), lr=LR)
    dl_b = DataLoader(data, batch_size=BATCH, collate_fn=collate)
    plugin_b = RingAttentionPlugin(cp_size=2, ulysses_size=2)
    model_b, opt_b, dl_b = plugin_b.prepare(accelerator, model_b, opt_b, dl_b)
    res["ga_ulysses"] = sorted(
        {m.hf_ring_config.ulysses.ulysses_size for m in original_b.modules() if hasattr(m, "hf_ring_config")}
    )
    ga_losses = []
    for i, batch in enumerate(dl_b):
        if i == STEPS * GA:
            break
        with accelerator.accumulate(model_b):
            loss = model_b(**batch).loss
            accelerator.backward(loss)
            opt_b.step()
            opt_b.zero_grad()
        ga_losses.append(plugin_b.reduce_loss(loss).item())
    res["ga_losses"] = ga_losses
    accelerator.gradient_accumulation_steps = 1

    # -- C: a shuffled epoch with a spawned worker: CP ranks agree, DP groups split the data ---------
    # (spawn: the sharding collate function is pickled; a forked worker of these multi-threaded processes may
    # deadlock in its start, as fork after threads may anywhere)
    dl_c = DataLoader(
        data, batch_size=BATCH, shuffle=True, collate_fn=collate, num_workers=1, multiprocessing_context="spawn"
    )
    dl_c = plugin.prepare(accelerator, dl_c)
    seen = []
    for batch in dl_c:
        ids = _full_ids(plugin, batch["input_ids"])
        seen.append(ids[:, 0].tolist())
    res["shuffled_ids"] = seen

    # -- D: LoRA (PEFT): the adapter trains like the single-process one and saves as a plain adapter ----
    if world == 2:
        lora = _lora(tiny_llama())
        original_lora = lora
        opt_d = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=LR)
        dl_d = DataLoader(data, batch_size=BATCH, collate_fn=collate)
        lora, opt_d, dl_d = plugin.prepare(accelerator, lora, opt_d, dl_d)
        lora_losses = []
        for _, batch in zip(range(LORA_STEPS), dl_d):
            loss = lora(**batch).loss
            accelerator.backward(loss)
            opt_d.step()
            opt_d.zero_grad()
            lora_losses.append(plugin.reduce_loss(loss).item())
        res["lora_losses"] = lora_losses
        res["lora_unwrap_is_original"] = accelerator.unwrap_model(lora) is original_lora
        lora_state = _trainable(original_lora)
        if accelerator.is_main_process:
            original_lora.save_pretrained(out / "adapter")
            torch.save(lora_state, out / "adapter.pt")

    # -- E: batches with images (Qwen2-VL, trainable vision tower) over DP x CP -------------------------
    if world == 4:
        from tests.hf_models import make_model

        images = image_samples(BATCH * dp * (STEPS + 1))
        vlm, _, _, res["image_losses"] = plugin_train(
            plugin, accelerator, make_model("qwen2_vl", images=True), images, STEPS, collate_fn=collate_images
        )
        image_state = {k: v.detach().clone() for k, v in accelerator.unwrap_model(vlm).state_dict().items()}
        if rank == 0:
            make = functools.partial(make_model, "qwen2_vl", images=True)
            res["ref_image_losses"], ref_image_state = replica_reference(
                images, dp, STEPS, make=make, collate_fn=collate_images
            )
            res["image_weights_err"] = max_param_rel_err(image_state, ref_image_state)
        if importlib.util.find_spec("trl") is not None:  # (its test skips without TRL)
            res.update(_mixed_sft(out, dp))

    # -- the reference, on rank 0 -------------------------------------------------------------------
    if rank == 0:
        ref_losses, ref_state = _reference(data, dp, STEPS, 1)
        res["ref_losses"] = ref_losses
        res["weights_err"] = max_param_rel_err(final, ref_state)
        ga_ref_losses, ga_ref_state = _reference(data, dp, STEPS, GA)
        res["ga_ref_losses"] = ga_ref_losses
        res["ga_weights_err"] = max_param_rel_err(original_b.state_dict(), ga_ref_state)
        if world == 2:
            ref_lora = _lora(tiny_llama())
            opt_ref = torch.optim.SGD([p for p in ref_lora.parameters() if p.requires_grad], lr=LR)
            ref_lora_losses = []
            for step in range(LORA_STEPS):
                s, n = full_loss_sum(ref_lora, _raw_batch(data, step))
                (s / n).backward()
                opt_ref.step()
                opt_ref.zero_grad()
                ref_lora_losses.append(float(s / n))
            res["ref_lora_losses"] = ref_lora_losses
            res["lora_weights_err"] = max_param_rel_err(lora_state, _trainable(ref_lora))
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    accelerator.wait_for_everyone()


def _mixed_sft(out: Path, dp: int) -> dict:
    """``RingSFTTrainer`` over DP x CP where one DP group's batch has images (whole on its CP ranks) and the other's
    is text (sharded): losses equal one process, and TRL's running ``num_tokens`` is the same on every rank, each
    image batch counted once."""
    from hf_ring.trainer import RingSFTTrainer
    from tests.hf_models import make_model
    from tests.train_utils import GA as TRAINER_GA
    from tests.train_utils import STEPS as TRAINER_STEPS
    from tests.train_utils import logged_losses, sft_trainer, trainer_reference

    images = image_samples(BATCH * TRAINER_GA * TRAINER_STEPS * dp, seq_len=32)  # no padding: no attention_mask
    text = [{k: v for k, v in s.items() if k in ("input_ids", "labels", "mm_token_type_ids")} for s in images]
    for s in text:
        s["mm_token_type_ids"] = torch.zeros_like(s["mm_token_type_ids"])
        s["input_ids"] = s["input_ids"].clamp(max=50)
    # batch j of the sequential order goes to DP group j % dp: group 0 always images, group 1 always text
    data = [x for j in range(len(images) // BATCH) for x in (images if j % dp == 0 else text)[j * BATCH :][:BATCH]]
    make = functools.partial(make_model, "qwen2_vl", images=True)
    trainer = sft_trainer(  # text batches leave the vision tower without gradients: DDP must be told
        RingSFTTrainer, out, data, model=make(), collate_fn=collate_images, name="mixed_sft",
        ddp_find_unused_parameters=True,
    )  # fmt: skip
    trainer.train()
    res = {
        "mixed_sft": logged_losses(trainer),
        "mixed_sft_tokens": [h["num_tokens"] for h in trainer.state.log_history if "loss" in h],
    }
    if trainer.accelerator.is_main_process:
        steps = [[[collate_images(data[((s * TRAINER_GA + m) * dp + d) * BATCH :][:BATCH]) for d in range(dp)]
                  for m in range(TRAINER_GA)] for s in range(TRAINER_STEPS)]  # fmt: skip
        res["mixed_sft_ref"], _ = trainer_reference(steps, make=make)
    return res


# ---- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "dp2xcp2"])
def launch(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"accelerate_w{world}")
    torchrun(Path(__file__), world, out, timeout=420)
    return world, out, read_results(out, world)


def test_images_over_dp_and_cp_match_single_process_training(launch):
    world, _, res = launch
    if world != 4:
        pytest.skip("the DP x CP launch runs it")
    for r in res:
        assert r["image_losses"] == pytest.approx(res[0]["ref_image_losses"], rel=RTOL)
    assert res[0]["image_weights_err"] <= RTOL, res[0]["image_weights_err"]


def test_trl_sft_over_dp_and_cp_with_image_and_text_batches(launch):
    world, _, res = launch
    if world != 4:
        pytest.skip("the DP x CP launch runs it")
    pytest.importorskip("trl")
    assert res[0]["mixed_sft"] == pytest.approx(res[0]["mixed_sft_ref"], rel=RTOL)
    # per step, GA micro-batches: the image group's 2 rows x 32 tokens once; the text group as TRL counts a sharded
    # batch (its position ids' length, 16 per rank)
    want = [(s + 1) * GA * (2 * 32 + 2 * 16) for s in range(STEPS)]
    for r in res:
        assert r["mixed_sft"] == res[0]["mixed_sft"] and r["mixed_sft_tokens"] == want, r["mixed_sft_tokens"]


def test_losses_and_weights_match_single_process_training(launch):
    world, _, res = launch
    ref = res[0]["ref_losses"]
    for r in res:
        assert r["losses"] == pytest.approx(res[0]["losses"], rel=0, abs=0), "reduce_loss differs between ranks"
    assert len(ref) == STEPS
    assert max(rel_err(torch.tensor(a), torch.tensor(b)) for a, b in zip(res[0]["losses"], ref)) <= RTOL
    assert res[0]["weights_err"] <= RTOL


def test_gradient_accumulation_matches(launch):
    world, _, res = launch
    got, ref = res[0]["ga_losses"], res[0]["ga_ref_losses"]
    assert len(got) == len(ref) == STEPS * GA
    assert all(r["ga_ulysses"] == [2] for r in res)  # the hybrid ran, within each of the dp CP groups
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= RTOL
    assert res[0]["ga_weights_err"] <= RTOL


def test_groups_and_data_layout(launch):
    world, _, res = launch
    dp = world // 2
    for rank, r in enumerate(res):
        g = r["groups"]
        assert g["cp"] == [rank - rank % 2, rank - rank % 2 + 1]  # consecutive ranks form a CP group
        assert g["dp"] == list(range(rank % 2, world, 2))
        assert g["mesh"] == [[2 * d, 2 * d + 1] for d in range(dp)] and g["dims"] == ["dp", "cp"]
        assert (g["cp_rank"], g["dp_rank"]) == (rank % 2, rank // 2)
        assert all(r["data_ok"]), "a DP group did not get the batches of the plain dp-process run"
        assert r["shapes"] == [[2, 16]] * STEPS  # 30 tokens padded to 32, half per rank
        assert r["scheduler_steps"] == STEPS * dp  # Accelerate steps a scheduler once per DP replica
    for d in range(dp):
        assert res[2 * d]["shuffled_ids"] == res[2 * d + 1]["shuffled_ids"]  # a CP group shares its batches
    seen = sorted(i for d in range(dp) for batch in res[2 * d]["shuffled_ids"] for i in batch)
    assert seen == list(range(len(seen))) and len(seen) == BATCH * dp * (STEPS * GA + 1)


def test_the_plugins_exactness_check_runs_over_each_cp_group(launch):
    world, _, res = launch
    for rank, r in enumerate(res):
        assert r["check"]["ok"] and r["check"]["ranks"] == 2, r["check"]
        assert r["check"] == res[rank - rank % 2]["check"]  # one report per CP group
    if world == 4:  # each DP group checked its own batch
        assert res[0]["check"]["reference_loss"] != res[2]["check"]["reference_loss"]


def test_save_state_load_state_resume_to_the_identical_next_loss(launch):
    _, _, res = launch
    for r in res:
        assert r["resumed_loss"] == r["losses"][-1]
        assert r["resumed_weights_err"] == 0.0


def test_bad_cp_size_raises_on_every_rank(launch):
    world, _, res = launch
    for r in res:
        assert f"cp_size={world + 1} does not divide the number of processes {world}" in r["bad_cp_error"]


def test_unwrap_model_and_save_pretrained_load_without_hf_ring(launch):
    world, out, res = launch
    if world != 2:
        pytest.skip("checked once, on the CP = 2 launch")
    assert all(r["unwrap_is_original"] for r in res)
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out / 'ckpt')!r})\n"
        "assert not any(k.startswith('hf_ring') for k in sys.modules), 'hf_ring was imported'\n"
        f"ref = torch.load({str(out / 'final.pt')!r})\n"
        "sd = m.state_dict()\n"
        "assert all(torch.equal(sd[k], ref[k]) for k in ref), 'weights differ'\n"
        "assert m.config._attn_implementation != 'hf_ring'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


def test_lora_matches_and_saves_a_plain_adapter(launch):
    world, out, res = launch
    if world != 2:
        pytest.skip("checked once, on the CP = 2 launch")
    r = res[0]
    assert all(x["lora_unwrap_is_original"] for x in res)
    assert max(abs(a - b) / abs(b) for a, b in zip(r["lora_losses"], r["ref_lora_losses"])) <= RTOL
    assert r["lora_weights_err"] <= RTOL
    code = (
        "import sys, torch\n"
        "from peft import PeftModel\n"
        "from tests.train_utils import tiny_llama\n"
        f"m = PeftModel.from_pretrained(tiny_llama(), {str(out / 'adapter')!r})\n"
        "assert not any(k.startswith('hf_ring') for k in sys.modules), 'hf_ring was imported'\n"
        f"ref = torch.load({str(out / 'adapter.pt')!r})\n"
        "sd = {k.replace('.default', ''): p for k, p in m.named_parameters() if 'lora_' in k}\n"
        "ref = {k.replace('.default', ''): v for k, v in ref.items()}\n"
        "assert sd.keys() == ref.keys(), (sorted(sd)[:3], sorted(ref)[:3])\n"
        "assert all(torch.equal(sd[k], ref[k]) for k in ref), 'adapter weights differ'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]))
