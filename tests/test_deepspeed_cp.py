"""DeepSpeed ZeRO 1-3 with context parallelism in real ``torchrun`` launches on CPU (gloo): CP = 2, DP = 2 x CP = 2.

DeepSpeed runs on CPU with its CPU accelerator (``DS_ACCELERATOR=cpu``) over the gloo group; Accelerate
enables DeepSpeed on accelerators only, so the worker switches a constructed ``Accelerator`` to
DeepSpeed (``distributed_type = DEEPSPEED`` and a ``DeepSpeedPlugin``), after which ``plugin.prepare``
runs Accelerate's own ``deepspeed.initialize`` path, the code a GPU user runs. One launch per world
size; the tests assert on the JSON it writes:

- ZeRO stages 1, 2 and 3 with ``RingAttentionPlugin``: SGD steps with DeepSpeed's gradient clipping
  give the per-step losses and final weights of single-process training on the full sequences (CP
  shares summed, DP replicas averaged, the clipping norm that of the full gradient);
- ZeRO-3 ``save_state`` / ``load_state`` resume to the same next loss and weights;
- at CP = 2 (the families' code meets ZeRO-3's partitioned parameters alike at any DP size): a vision-language model
  (Qwen2-VL) on batches with images under ZeRO-3: the losses and weights of one process; GLM-5.3-Flash (its
  indexer's pools, Kimi Delta Attention layers, experts), Inkling 2 (its bias tables, dynamic convolutions,
  attention residuals, padded vocabulary) and BLOOM (its attention in hf_ring's own forward, ALiBi) under ZeRO-3:
  the same;
- DeepSpeed's bf16 mode (ZeRO-2, fp32 master weights and reduction) stays within twice the error the same
  mode has without CP;
- ``RingAttentionTrainer`` with ``deepspeed=`` (ZeRO-2 and ZeRO-3, gradient accumulation 2), and TRL's
  ``SFTTrainer`` through ``RingSFTTrainer`` with ZeRO-3 (CP = 2): logged losses and final weights equal
  single-process training with the Trainer's token-weighted loss.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest

from tests.train_utils import (
    BATCH,
    GA,
    SEQ_LEN,
    STEPS,
    OnDeepSpeed,
    collate,
    collate_images,
    ds_config,
    image_samples,
    max_param_rel_err,
    plugin_train,
    read_results,
    replica_reference,
    reset_accelerate,
    run_worker,
    switch_to_deepspeed,
    tiny_llama,
    token_dataset,
    torchrun,
    zero3_full_state,
)

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed") if __name__ != "__main__" else None

CLIP = 1.0  # DeepSpeed's gradient clipping (the gradients of the first steps are larger): the norm must be exact
STAGES = (1, 2, 3)
TRAINER_STAGES = (2, 3)
RTOL = 1e-5  # fp32: ring attention and the sharded reduction reorder sums, nothing else changes
# bf16: at most 2x the error DeepSpeed's bf16 mode has without CP (measured in the same launch: its weights
# are 2.5x further from fp32 than a plain bf16 forward/backward with fp32 updates, CP or not)
BF16_FACTOR, BF16_EPS = 2.0, 1e-3


def _deepspeed_accelerator(stage: int, mixed_precision: str = "no"):
    """A fresh ``Accelerator`` on CPU switched to DeepSpeed ZeRO-``stage`` (one model per Accelerator)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    switch_to_deepspeed(accelerator, DeepSpeedPlugin(zero_stage=stage, gradient_clipping=CLIP), mixed_precision)
    return accelerator


def _trainer(out: Path, world: int, stage: int) -> tuple[list, dict, list]:
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingAttentionTrainer
    from tests.train_utils import logged_losses, trainer_args

    reset_accelerate()
    train = token_dataset(BATCH * GA * STEPS * (world // 2), SEQ_LEN)
    trainer = type("DeepSpeedTrainer", (OnDeepSpeed, RingAttentionTrainer), {})(
        model=tiny_llama(),
        args=trainer_args(out, f"trainer_z{stage}", gradient_accumulation_steps=GA, deepspeed=ds_config(stage)),
        train_dataset=train,
        data_collator=collate,
        ring_plugin=RingAttentionPlugin(cp_size=2),
    )
    trainer.train()
    return logged_losses(trainer), zero3_full_state(trainer.model_wrapped.module), train


def worker(out: Path) -> None:
    import deepspeed

    from hf_ring.accelerate import RingAttentionPlugin
    from tests.hf_models import in_transformers, make_model
    from tests.train_utils import VOCAB

    res: dict = {}
    states = {}
    families = int(os.environ["WORLD_SIZE"]) == 2  # (the families under ZeRO-3 at CP = 2 only)
    # built before any ZeRO-3 Accelerator: under zero.Init Transformers' weight init cannot zero a partitioned
    # embedding's padding row
    vlm = make_model("qwen2_vl", images=True) if families else None
    vlm_reference = copy.deepcopy(vlm)  # for rank 0's reference, built later under no ZeRO-3 context either
    # GLM-5.3-Flash (Transformers 5.24): its indexer's own pool parameters gathered where hf_ring runs its code
    glm5 = make_model("glm5_next", vocab_size=VOCAB) if families and in_transformers("glm5_next") else None
    glm5_reference = copy.deepcopy(glm5)
    # Inkling 2 (Transformers 5.24): its bias table, dynamic convolutions' taps and residual queries read in modules that
    # hf_ring runs; its padded vocabulary's head in the chunked loss (called as a module: partitioned)
    inkling2 = None
    if families and in_transformers("inkling2_text"):
        inkling2 = make_model("inkling2_text", vocab_size=VOCAB + 8, unpadded_vocab_size=VOCAB)
    inkling2_reference = copy.deepcopy(inkling2)
    # BLOOM: its attention computed in hf_ring's own forward (ALiBi's slopes, the batch's keywords handed over)
    bloom = make_model("bloom", vocab_size=VOCAB) if families else None
    bloom_reference = copy.deepcopy(bloom)
    for stage in STAGES:
        accelerator = _deepspeed_accelerator(stage)
        world, rank = accelerator.num_processes, accelerator.process_index
        dp = world // 2
        data = token_dataset(BATCH * dp * (STEPS + 1), SEQ_LEN)
        plugin = RingAttentionPlugin(cp_size=2)
        original = tiny_llama()
        model, opt, dl, losses = plugin_train(plugin, accelerator, original, data, STEPS, out if stage == 3 else None)
        res[f"z{stage}_engine"] = type(model).__name__
        res[f"z{stage}_unwrap_is_original"] = accelerator.unwrap_model(model) is original
        res[f"z{stage}_losses"] = losses
        states[stage] = zero3_full_state(model.module)
        if stage == 3:
            accelerator.load_state(str(out / "state"))
            loss = model(**next(iter(accelerator.skip_first_batches(dl, STEPS - 1)))).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            res["resumed_loss"] = plugin.reduce_loss(loss).item()
            res["resumed_weights_err"] = max_param_rel_err(zero3_full_state(model.module), states[3])

    if vlm is not None:  # a vision-language model on batches with images under ZeRO-3 (its vision tower partitioned)
        accelerator = _deepspeed_accelerator(3)
        images = image_samples(BATCH * dp * (STEPS + 1))
        vlm, _, _, res["images_losses"] = plugin_train(
            RingAttentionPlugin(cp_size=2), accelerator, vlm, images, STEPS, collate_fn=collate_images
        )
        states["images"] = zero3_full_state(vlm.module)
    if glm5 is not None:  # (its sparse layers' selection, KDA layers, experts; partitioned by ZeRO-3)
        accelerator = _deepspeed_accelerator(3)
        # every parameter partitioned (the tiny model's would all stay whole below DeepSpeed's default threshold)
        zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        zero["stage3_param_persistence_threshold"] = 0
        glm5, _, _, res["glm5_losses"] = plugin_train(RingAttentionPlugin(cp_size=2), accelerator, glm5, data, STEPS)
        indexer = glm5.module.model.language_model.layers[1].self_attn.indexer
        res["glm5_partitioned"] = all(p.numel() == 0 for p in indexer.parameters())
        states["glm5"] = zero3_full_state(glm5.module)
    if inkling2 is not None:  # (every parameter partitioned, as GLM-5.3-Flash's)
        accelerator = _deepspeed_accelerator(3)
        zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        zero["stage3_param_persistence_threshold"] = 0
        inkling2, _, _, res["inkling2_losses"] = plugin_train(
            RingAttentionPlugin(cp_size=2), accelerator, inkling2, data, STEPS
        )
        conv = inkling2.module.model.layers[1].self_attn.k_proj.sconv  # (a dynamic one: its taps partitioned)
        res["inkling2_partitioned"] = all(p.numel() == 0 for p in conv.parameters())
        states["inkling2"] = zero3_full_state(inkling2.module)
    if bloom is not None:  # (every parameter partitioned, as GLM-5.3-Flash's)
        accelerator = _deepspeed_accelerator(3)
        zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        zero["stage3_param_persistence_threshold"] = 0
        bloom, _, _, res["bloom_losses"] = plugin_train(RingAttentionPlugin(cp_size=2), accelerator, bloom, data, STEPS)
        qkv = bloom.module.transformer.h[0].self_attention.query_key_value
        res["bloom_partitioned"] = all(p.numel() == 0 for p in qkv.parameters())
        states["bloom"] = zero3_full_state(bloom.module)

    # DeepSpeed's bf16 mode (bf16 model, fp32 master weights, fp32 reduction) under ZeRO-2, two steps, with
    # CP and, as the baseline of DeepSpeed's own bf16 error, as plain data parallelism (cp_size=1)
    for key, cp in (("bf16", 2), ("bf16_base", 1)):
        accelerator = _deepspeed_accelerator(2, "bf16")
        accelerator.state.deepspeed_plugin.deepspeed_config["communication_data_type"] = "fp32"
        model, _, _, res[f"{key}_losses"] = plugin_train(
            RingAttentionPlugin(cp_size=cp), accelerator, tiny_llama(), data, 2
        )
        res[f"{key}_dtype"] = str(next(model.module.parameters()).dtype)
        states[key] = {  # the fp32 master weights
            k: deepspeed.utils.safe_get_full_fp32_param(p).clone() for k, p in model.module.named_parameters()
        }

    trainer_states = {}
    for stage in TRAINER_STAGES:
        res[f"trainer_z{stage}_losses"], trainer_states[stage], train = _trainer(out, world, stage)
    if world == 2:  # TRL's SFTTrainer under ZeRO-3
        from hf_ring.trainer import RingSFTTrainer
        from tests.train_utils import logged_losses, sft_trainer

        reset_accelerate()
        cls = type("DeepSpeedSFTTrainer", (OnDeepSpeed, RingSFTTrainer), {})
        trainer = sft_trainer(cls, out, train, gradient_accumulation_steps=GA, deepspeed=ds_config(3))
        trainer.train()
        res["trl_losses"] = logged_losses(trainer)
        trainer_states["trl"] = zero3_full_state(trainer.model_wrapped.module)

    if rank == 0:
        from tests.train_utils import trainer_reference

        res["ref_losses"], ref_state = replica_reference(data, dp, STEPS, clip=CLIP)
        if vlm is not None:
            res["images_ref_losses"], images_ref = replica_reference(
                images, dp, STEPS, clip=CLIP, make=lambda: vlm_reference, collate_fn=collate_images
            )
            res["images_weights_err"] = max_param_rel_err(states["images"], images_ref)
        if glm5 is not None:
            res["glm5_ref_losses"], glm5_ref = replica_reference(
                data, dp, STEPS, clip=CLIP, make=lambda: glm5_reference
            )
            res["glm5_weights_err"] = max_param_rel_err(states["glm5"], glm5_ref)
        if inkling2 is not None:
            res["inkling2_ref_losses"], inkling2_ref = replica_reference(
                data, dp, STEPS, clip=CLIP, make=lambda: inkling2_reference
            )
            res["inkling2_weights_err"] = max_param_rel_err(states["inkling2"], inkling2_ref)
        if bloom is not None:
            res["bloom_ref_losses"], bloom_ref = replica_reference(
                data, dp, STEPS, clip=CLIP, make=lambda: bloom_reference
            )
            res["bloom_weights_err"] = max_param_rel_err(states["bloom"], bloom_ref)
        for stage in STAGES:
            res[f"z{stage}_weights_err"] = max_param_rel_err(states[stage], ref_state)
        ref32_losses, ref32_state = replica_reference(data, dp, 2, clip=CLIP)
        # the plain DP run: every rank a replica
        base32_losses, base32_state = replica_reference(data, world, 2, clip=CLIP)
        res["bf16"] = {
            "mine_loss": max(abs(a - b) / abs(b) for a, b in zip(res["bf16_losses"], ref32_losses)),
            "mine_weights": max_param_rel_err(states["bf16"], ref32_state),
            "base_loss": max(abs(a - b) / abs(b) for a, b in zip(res["bf16_base_losses"], base32_losses)),
            "base_weights": max_param_rel_err(states["bf16_base"], base32_state),
        }
        steps = [[[collate(train[((s * GA + m) * dp + d) * BATCH :][:BATCH]) for d in range(dp)]
                  for m in range(GA)] for s in range(STEPS)]  # fmt: skip
        res["trainer_ref_losses"], trainer_ref_state = trainer_reference(steps)
        for key, state in trainer_states.items():
            res[f"trainer_{key}_weights_err"] = max_param_rel_err(state, trainer_ref_state)
    (out / f"rank{rank}.json").write_text(json.dumps(res))


# ---- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "dp2xcp2"])
def launch(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"deepspeed_w{world}")
    torchrun(Path(__file__), world, out, timeout=600, env={"DS_ACCELERATOR": "cpu"})
    return world, read_results(out, world)


@pytest.mark.parametrize("stage", STAGES)
def test_accelerate_deepspeed_zero_matches_single_process_training(launch, stage):
    world, results = launch
    ref = results[0]
    for r in results:
        assert r[f"z{stage}_engine"] == "DeepSpeedEngine" and r[f"z{stage}_unwrap_is_original"]
        assert r[f"z{stage}_losses"] == pytest.approx(ref["ref_losses"], rel=RTOL)
    err = ref[f"z{stage}_weights_err"]
    assert err <= RTOL, f"world {world}, ZeRO-{stage}: final weights differ by {err:.2e}"


def test_accelerate_deepspeed_resumes_from_save_state(launch):
    for r in launch[1]:
        assert r["resumed_loss"] == pytest.approx(r["z3_losses"][-1], rel=RTOL)
        assert r["resumed_weights_err"] <= RTOL


def test_deepspeed_bf16_within_twice_its_own_bf16_error(launch):
    ref = launch[1][0]
    bf16 = ref["bf16"]
    assert ref["bf16_dtype"] == ref["bf16_base_dtype"] == "torch.bfloat16"
    assert bf16["mine_loss"] <= BF16_FACTOR * bf16["base_loss"] + BF16_EPS, bf16
    assert bf16["mine_weights"] <= BF16_FACTOR * bf16["base_weights"] + BF16_EPS, bf16


# the families' tests: the CP = 2 launch only
AT_CP2 = pytest.mark.parametrize("launch", [2], ids=["cp2"], indirect=True)


@AT_CP2
def test_images_with_deepspeed_zero3_match_single_process_training(launch):
    """Qwen2-VL on batches with images, its vision tower partitioned by ZeRO-3: losses and final weights (vision tower
    included) equal single-process training."""
    world, results = launch
    for r in results:
        assert r["images_losses"] == pytest.approx(results[0]["images_ref_losses"], rel=RTOL)
    err = results[0]["images_weights_err"]
    assert err <= RTOL, f"world {world}, images under ZeRO-3: final weights differ by {err:.2e}"


@AT_CP2
def test_glm5_next_with_deepspeed_zero3_matches_single_process_training(launch):
    """GLM-5.3-Flash under ZeRO-3, every parameter partitioned: ZeRO-3 gathers the indexer's projections at each call,
    and the ranks of a CP group have different numbers of chunks of queries (zig-zag: one run or two; the shorter
    runs one again, else its peers would wait in a gather). Losses and final weights equal single-process training."""
    world, results = launch
    if "glm5_losses" not in results[0]:
        pytest.skip("GLM-5.3-Flash is not in this Transformers release")
    for r in results:
        assert r["glm5_partitioned"]  # (its indexer's parameters too: gathered where hf_ring reads them)
        assert r["glm5_losses"] == pytest.approx(results[0]["glm5_ref_losses"], rel=RTOL)
    err = results[0]["glm5_weights_err"]
    assert err <= RTOL, f"world {world}, GLM-5.3-Flash under ZeRO-3: final weights differ by {err:.2e}"


@AT_CP2
def test_inkling2_with_deepspeed_zero3_matches_single_process_training(launch):
    """Inkling 2 under ZeRO-3, every parameter partitioned (its dynamic convolutions' taps, its bias tables, its
    attention residuals, its padded vocabulary's head): losses and final weights equal single-process training."""
    world, results = launch
    if "inkling2_losses" not in results[0]:
        pytest.skip("Inkling 2 is not in this Transformers release")
    for r in results:
        assert r["inkling2_partitioned"]
        assert r["inkling2_losses"] == pytest.approx(results[0]["inkling2_ref_losses"], rel=RTOL)
    err = results[0]["inkling2_weights_err"]
    assert err <= RTOL, f"world {world}, Inkling 2 under ZeRO-3: final weights differ by {err:.2e}"


@pytest.mark.parametrize("stage", TRAINER_STAGES)
def test_trainer_with_deepspeed_matches_single_process(launch, stage):
    world, results = launch
    ref = results[0]
    for r in results:
        assert r[f"trainer_z{stage}_losses"] == pytest.approx(ref["trainer_ref_losses"], rel=RTOL)
    err = ref[f"trainer_{stage}_weights_err"]
    assert err <= RTOL, f"world {world}, ZeRO-{stage} Trainer: final weights differ by {err:.2e}"


@AT_CP2
def test_trl_sft_trainer_with_deepspeed_zero3_matches_single_process(launch):
    world, results = launch
    ref = results[0]
    for r in results:
        assert r["trl_losses"] == pytest.approx(ref["trainer_ref_losses"], rel=RTOL)
    assert ref["trainer_trl_weights_err"] <= RTOL, f"{ref['trainer_trl_weights_err']:.2e}"


@AT_CP2
def test_bloom_with_deepspeed_zero3_matches_single_process_training(launch):
    """BLOOM under ZeRO-3, every parameter partitioned: its attention modules run hf_ring's forward (ALiBi through the
    ring, the batch's keywords handed over through the mask), gathering their projections as modules; losses and final
    weights equal single-process training."""
    world, results = launch
    for r in results:
        assert r["bloom_partitioned"]
        assert r["bloom_losses"] == pytest.approx(results[0]["bloom_ref_losses"], rel=RTOL)
    err = results[0]["bloom_weights_err"]
    assert err <= RTOL, f"world {world}, BLOOM under ZeRO-3: final weights differ by {err:.2e}"


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]))
