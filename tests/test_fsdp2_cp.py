"""FSDP2 with context parallelism in real ``torchrun`` launches on CPU (gloo): CP = 2, and DP = 2 x CP = 2.

Accelerate runs FSDP on GPUs only, so the worker switches a constructed ``Accelerator`` to FSDP2
(``distributed_type = FSDP``, ``FullyShardedDataParallelPlugin(fsdp_version=2)``); from there
``plugin.prepare`` runs Accelerate's own FSDP2 path over gloo, the code a GPU user runs. One launch
per world size; the tests assert on the JSON it writes:

- Accelerate FSDP2: SGD steps give the per-step losses and final weights of single-process training
  on the full sequences (CP shares summed, DP replicas averaged); ``save_state`` / ``load_state``
  resume to the same next loss and weights; ``unwrap_model`` is the model that was passed in;
- an FSDP2 mixed-precision policy (bf16 parameters, fp32 reduction) stays within twice the error of
  the same bf16 arithmetic on one process;
- Accelerate's own ``ParallelismConfig(dp_shard_size=dp, cp_size=2)``: hf_ring takes the CP size from it and
  runs ring attention in place of Accelerate's CP (no SDPA hooks; ``maybe_context_parallel`` a no-op), exactly;
- the torch-native recipe (device mesh, ``apply_ring_attention(group=...)``, ``fully_shard``,
  ``hf_ring.fsdp.set_cp_gradient_reduction``) matches single-process training too, also for a hybrid model
  (Qwen3.5's Gated DeltaNet layers, one of them a module FSDP2 shards on its own), and for a vision-language
  model on batches with images (Qwen2-VL, its vision blocks sharded too);
- ``RingAttentionTrainer`` (and TRL's ``SFTTrainer`` through ``RingSFTTrainer``, CP = 2) with
  ``fsdp="full_shard"``, ``fsdp_config={"fsdp_version": 2}``: logged losses and final weights equal
  single-process training with the Trainer's token-weighted loss.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import (
    BATCH,
    FSDP2_ARGS,
    GA,
    LR,
    SEQ_LEN,
    STEPS,
    OnFsdp2,
    collate,
    collate_images,
    full_state,
    image_samples,
    max_param_rel_err,
    plugin_train,
    raw_batch,
    read_results,
    replica_reference,
    run_worker,
    switch_to_fsdp2,
    tiny_llama,
    token_dataset,
    torchrun,
)

RTOL = 1e-5  # fp32: ring attention and sharded reduction reorder sums, nothing else changes
BF16_FACTOR, BF16_EPS = 2.0, 1e-3  # bf16 compute: at most 2x the error of the same bf16 arithmetic unsharded


def _fsdp2_accelerator(mixed_precision_policy=None):
    """An ``Accelerator`` on CPU switched to FSDP2, as it is on a GPU with ``fsdp_version: 2``."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)
    switch_to_fsdp2(
        accelerator, FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=mixed_precision_policy)
    )
    return accelerator


HYBRIDS = {
    "qwen3_5_text": "linear_attn",
    "bamba": "mamba",
    "jamba": "mamba",
    "qwen4_exp_text": "ple",  # (Transformers 5.24) its per-layer embedding, and its block-sparse attention layer
    "glm5_next": "self_attn",  # (Transformers 5.24) its KDA layer, its indexer's pools (a vision-language model)
    "inkling2_text": "self_attn",  # (Transformers 5.24) its relative bias, dynamic convolutions, attention residuals
    "falcon": "self_attention",  # its attention computed in its own forward (hf_ring.patches._own), keywords handed over
}  # family: its first layer's recurrent module


def _tiny_hybrid(family: str = "qwen3_5_text"):
    from tests.hf_models import make_model
    from tests.train_utils import VOCAB

    if family.startswith("inkling"):  # (its vocabulary padded beyond the data's)
        return make_model(family, vocab_size=VOCAB + 8, unpadded_vocab_size=VOCAB)
    return make_model(family, vocab_size=VOCAB)


def _has_trl() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("trl", "datasets"))


def _trainers(out: Path, world: int) -> dict:
    """The Trainer (and at CP = 2 TRL's SFTTrainer) under FSDP2: logged losses and unsharded final weights."""
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingAttentionTrainer
    from tests.train_utils import logged_losses, sft_trainer, trainer_args

    res: dict = {}
    train = token_dataset(BATCH * GA * STEPS * (world // 2), SEQ_LEN)
    trainer = type("FsdpTrainer", (OnFsdp2, RingAttentionTrainer), {})(
        model=tiny_llama(),
        args=trainer_args(out, "trainer", gradient_accumulation_steps=GA, **FSDP2_ARGS),
        train_dataset=train,
        data_collator=collate,
        ring_plugin=RingAttentionPlugin(cp_size=2),
    )
    trainer.train()
    res["trainer_fsdp2"] = type(trainer.model_wrapped).__name__.startswith("FSDP")
    res["trainer_losses"] = logged_losses(trainer)
    res["trainer_state"] = full_state(trainer.model)
    if world == 2 and _has_trl():
        from hf_ring.trainer import RingSFTTrainer

        cls = type("FsdpSFTTrainer", (OnFsdp2, RingSFTTrainer), {})
        trainer = sft_trainer(cls, out, train, gradient_accumulation_steps=GA, **FSDP2_ARGS)
        trainer.train()
        res["trl_losses"] = logged_losses(trainer)
        res["trl_state"] = full_state(trainer.model)
    return res, train


def _with_parallelism_config(accelerator, data, dp: int, cp: int) -> dict:
    """Train under a ``ParallelismConfig`` with cp_size, as a script written for Accelerate's own CP does.

    The loop wraps each forward in ``accelerator.maybe_context_parallel(buffers=...)``, as Accelerate's CP
    recipe asks; with hf_ring it must leave the (already sharded) batch alone. Accelerate builds the
    mesh and validates the config at construction, which on CPU it refuses (no FSDP there), so the
    switched Accelerator gets them the way its constructor sets them on a GPU.
    """
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.parallelism_config import ParallelismConfig
    from torch.utils.data import DataLoader

    from hf_ring.accelerate import RingAttentionPlugin

    pc = ParallelismConfig(dp_shard_size=dp, cp_size=cp)
    switch_to_fsdp2(accelerator, FullyShardedDataParallelPlugin(fsdp_version=2))
    accelerator.state.parallelism_config = pc
    accelerator.state.device_mesh = pc.get_device_mesh("cpu")
    pc._validate_accelerator(accelerator)
    try:
        plugin = RingAttentionPlugin()  # the CP size comes from the ParallelismConfig
        original = tiny_llama()
        model, opt, dl = plugin.prepare(
            accelerator, original, torch.optim.SGD(original.parameters(), lr=LR),
            DataLoader(data, batch_size=BATCH, collate_fn=collate),
        )  # fmt: skip
        hooks = sum(len(layer.self_attn._forward_pre_hooks) for layer in original.model.layers)
        losses, it = [], iter(dl)
        for _ in range(STEPS):
            batch = next(it)
            ids = batch["input_ids"]
            with accelerator.maybe_context_parallel(
                buffers=[batch["input_ids"], batch["labels"]], buffer_seq_dims=[1, 1]
            ):
                assert batch["input_ids"] is ids and ids.shape[1] == (SEQ_LEN + 2) // cp  # padded to 2 x cp = 32
                loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(plugin.reduce_loss(loss).item())
        return {"pc_cp": plugin.ring.cp_size, "pc_attention_hooks": hooks, "pc_losses": losses,
                "pc_state": full_state(model)}  # fmt: skip
    finally:
        accelerator.state.parallelism_config = accelerator.state.device_mesh = None


def worker(out: Path) -> None:
    import torch.distributed as dist
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    import hf_ring
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.fsdp import set_cp_gradient_reduction

    accelerator = _fsdp2_accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    cp, dp = 2, world // 2
    res: dict = {"world": world}
    data = token_dataset(BATCH * dp * (STEPS + 1), SEQ_LEN)
    plugin = RingAttentionPlugin(cp_size=cp)

    # -- A: Accelerate's FSDP2, save_state after step 2, resume step 3 ---------------------------------
    original = tiny_llama()
    model, opt, dl, losses = plugin_train(plugin, accelerator, original, data, STEPS, out)
    res["fsdp2_wrapped"] = isinstance(model, FSDPModule)
    res["unwrap_is_original"] = accelerator.unwrap_model(model) is original
    res["losses"] = losses
    final = full_state(model)
    accelerator.load_state(str(out / "state"))
    loss = model(**next(iter(accelerator.skip_first_batches(dl, STEPS - 1)))).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    res["resumed_loss"] = plugin.reduce_loss(loss).item()
    res["resumed_weights_err"] = max_param_rel_err(full_state(model), final)

    # -- B: an FSDP2 mixed-precision policy: bf16 parameters, fp32 gradient reduction ------------------
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    switch_to_fsdp2(accelerator, FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy))
    model_b, _, _, res["bf16_losses"] = plugin_train(plugin, accelerator, tiny_llama(), data, 2)
    bf16_state = full_state(model_b)

    # -- E: Accelerate's ParallelismConfig(dp_shard_size=dp, cp_size=2): hf_ring runs its CP ------------
    res.update(_with_parallelism_config(accelerator, data, dp, cp))

    # -- C: the torch-native recipe, no Accelerate -----------------------------------------------------
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group = mesh.get_group("cp")
    native = hf_ring.apply_ring_attention(tiny_llama(), group=cp_group)
    for layer in native.model.layers:
        fully_shard(layer)
    fully_shard(native)
    set_cp_gradient_reduction(native, dp_size=dp)
    opt_c = torch.optim.SGD(native.parameters(), lr=LR)
    native_losses = []
    for step in range(STEPS):
        batch = hf_ring.shard_batch(raw_batch(data, step * dp + mesh.get_local_rank("dp")), group=cp_group)
        loss = native(**batch).loss
        loss.backward()
        opt_c.step()
        opt_c.zero_grad()
        n = float(batch["num_items_in_batch"])  # valid targets of this DP group's full batch
        total = torch.stack([loss.detach() * n, torch.tensor(n)])
        dist.all_reduce(total)  # CP shares summed, DP groups weighted by their targets (each counted cp times)
        native_losses.append(float(cp * total[0] / total[1]))
    native_state = full_state(native)

    # -- F: hybrids (Qwen3.5's Gated DeltaNet, Bamba's Mamba2; the first layer's sharded by FSDP2 as a module of its
    # own too) with that recipe
    hybrid_states = {}
    from tests.hf_models import in_transformers

    for family, mixer in HYBRIDS.items():
        if not in_transformers(family):
            continue
        hybrid = hf_ring.apply_ring_attention(_tiny_hybrid(family), group=cp_group)
        base = getattr(hybrid, "transformer", None) or getattr(hybrid.model, "language_model", hybrid.model)
        layers = base.h if family == "falcon" else base.layers
        fully_shard(getattr(layers[0], mixer))  # FSDP2 gives it a class of its own
        for layer in layers:
            fully_shard(layer)
        fully_shard(hybrid)
        set_cp_gradient_reduction(hybrid, dp_size=dp)
        opt_f = torch.optim.SGD(hybrid.parameters(), lr=LR)
        for step in range(2):
            batch = hf_ring.shard_batch(raw_batch(data, step * dp + mesh.get_local_rank("dp")), group=cp_group)
            hybrid(**batch).loss.backward()
            opt_f.step()
            opt_f.zero_grad()
        hybrid_states[family] = full_state(hybrid)

    # -- G: a vision-language model on batches with images (Qwen2-VL; its vision blocks and text layers sharded)
    from tests.hf_models import make_model

    images = image_samples(BATCH * dp * 2)
    vlm = hf_ring.apply_ring_attention(make_model("qwen2_vl", images=True), group=cp_group)
    for block in [*vlm.model.visual.blocks, *vlm.model.language_model.layers]:
        fully_shard(block)
    fully_shard(vlm)
    set_cp_gradient_reduction(vlm, dp_size=dp)
    opt_g = torch.optim.SGD(vlm.parameters(), lr=LR)
    for step in range(2):
        raw = raw_batch(images, step * dp + mesh.get_local_rank("dp"), collate_images)
        vlm(**hf_ring.shard_batch(raw, group=cp_group)).loss.backward()
        opt_g.step()
        opt_g.zero_grad()
    images_state = full_state(vlm)

    # -- D: the Trainer (and TRL) with fsdp_version 2 ----------------------------------------------------
    trained, train = _trainers(out, world)
    res.update({k: v for k, v in trained.items() if not k.endswith("_state")})

    if rank == 0:
        from tests.train_utils import trainer_reference

        # step s, micro-batch m: DP group d gets batch (s * GA + m) * dp + d of the sequential order
        steps = [[[collate(train[((s * GA + m) * dp + d) * BATCH :][:BATCH]) for d in range(dp)]
                  for m in range(GA)] for s in range(STEPS)]  # fmt: skip
        res["trainer_ref_losses"], trainer_ref_state = trainer_reference(steps)
        res["trainer_weights_err"] = max_param_rel_err(trained["trainer_state"], trainer_ref_state)
        if "trl_state" in trained:
            res["trl_weights_err"] = max_param_rel_err(trained["trl_state"], trainer_ref_state)
        res["ref_losses"], ref_state = replica_reference(data, dp, STEPS)
        res["weights_err"] = max_param_rel_err(final, ref_state)
        res["pc_weights_err"] = max_param_rel_err(res["pc_state"], ref_state)
        res["native_weights_err"] = max_param_rel_err(native_state, ref_state)
        res["native_losses"] = native_losses
        for family, state in hybrid_states.items():
            _, hybrid_ref = replica_reference(data, dp, 2, make=functools.partial(_tiny_hybrid, family))
            res[f"hybrid_weights_err_{family}"] = max_param_rel_err(state, hybrid_ref)
        make = functools.partial(make_model, "qwen2_vl", images=True)
        _, images_ref = replica_reference(images, dp, 2, make=make, collate_fn=collate_images)
        res["images_weights_err"] = max_param_rel_err(images_state, images_ref)
        ref_bf16_losses, ref_bf16_state = replica_reference(data, dp, 2, torch.bfloat16)
        ref32_losses, ref32_state = replica_reference(data, dp, 2)
        res["bf16"] = {
            "mine_loss": max(abs(a - b) / abs(b) for a, b in zip(res["bf16_losses"], ref32_losses)),
            "single_loss": max(abs(a - b) / abs(b) for a, b in zip(ref_bf16_losses, ref32_losses)),
            "mine_weights": max_param_rel_err(bf16_state, ref32_state),
            "single_weights": max_param_rel_err(ref_bf16_state, ref32_state),
        }
    res.pop("pc_state")
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    accelerator.wait_for_everyone()


# ---- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "dp2xcp2"])
def launch(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp2_w{world}")
    torchrun(Path(__file__), world, out, timeout=480)
    return world, out, read_results(out, world)


def test_accelerate_fsdp2_matches_single_process_training(launch):
    world, _, results = launch
    ref = results[0]
    for r in results:
        assert r["fsdp2_wrapped"] and r["unwrap_is_original"]
        assert r["losses"] == pytest.approx(ref["ref_losses"], rel=RTOL)
    assert ref["weights_err"] <= RTOL, f"world {world}: final weights differ by {ref['weights_err']:.2e}"


def test_accelerate_fsdp2_resumes_from_save_state(launch):
    _, _, results = launch
    for r in results:
        assert r["resumed_loss"] == pytest.approx(r["losses"][-1], rel=RTOL)
        assert r["resumed_weights_err"] <= RTOL


def test_fsdp2_bf16_policy_within_twice_the_unsharded_bf16_error(launch):
    bf16 = launch[2][0]["bf16"]
    assert bf16["mine_loss"] <= BF16_FACTOR * bf16["single_loss"] + BF16_EPS, bf16
    assert bf16["mine_weights"] <= BF16_FACTOR * bf16["single_weights"] + BF16_EPS, bf16


def test_torch_native_fsdp2_recipe_matches_single_process_training(launch):
    ref = launch[2][0]
    assert ref["native_weights_err"] <= RTOL, f"{ref['native_weights_err']:.2e}"
    assert ref["native_losses"] == pytest.approx(ref["ref_losses"], rel=RTOL)


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_hybrid_model_with_fsdp2_matches_single_process_training(launch, family):
    """Qwen3.5 (Gated DeltaNet layers), Bamba (Mamba2 layers), Jamba (Mamba layers, lent the batch's keywords by
    their decoder layers), Qwen4-Exp (its per-layer embedding, run by its own forward per run of tokens; its
    indexer's blocks), GLM-5.3-Flash (Kimi Delta Attention layers; its indexer's pools), Inkling 2 (its attention
    with a relative bias and dynamic short convolutions, its attention residuals) and Falcon (its attention computed
    in its own forward, the batch's keywords handed over through the mask), the first one sharded by
    FSDP2 as a module of its own: two SGD steps of the native recipe give the weights of single-process training on
    the full sequences."""
    from tests.hf_models import in_transformers

    if not in_transformers(family):
        pytest.skip(f"{family} is not in this Transformers release")
    world, _, results = launch
    err = results[0][f"hybrid_weights_err_{family}"]
    assert err <= RTOL, f"world {world}, {family}: {err:.2e}"


def test_images_with_fsdp2_match_single_process_training(launch):
    """Qwen2-VL on batches with images, its vision blocks and text layers sharded by FSDP2 (the native recipe): two
    SGD steps give the weights of single-process training, the vision tower's included."""
    world, _, results = launch
    err = results[0]["images_weights_err"]
    assert err <= RTOL, f"world {world}: {err:.2e}"


def test_trainer_and_trl_with_fsdp2_match_single_process(launch):
    world, _, results = launch
    ref = results[0]
    for r in results:
        assert r["trainer_fsdp2"], "the Trainer did not shard the model with FSDP2"
        assert r["trainer_losses"] == pytest.approx(ref["trainer_ref_losses"], rel=RTOL)
    assert ref["trainer_weights_err"] <= RTOL, f"{ref['trainer_weights_err']:.2e}"
    if world == 2:
        if "trl_losses" not in ref:
            pytest.skip("TRL or datasets is not installed: the Trainer was checked, TRL's SFTTrainer was not")
        assert ref["trl_losses"] == pytest.approx(ref["trainer_ref_losses"], rel=RTOL)
        assert ref["trl_weights_err"] <= RTOL, f"{ref['trl_weights_err']:.2e}"


def test_accelerate_parallelism_config_cp_runs_ring_attention_exactly(launch):
    world, _, results = launch
    ref = results[0]
    for r in results:
        assert r["pc_cp"] == 2
        assert r["pc_attention_hooks"] == 0, "Accelerate's own context-parallel hooks were attached"
        assert r["pc_losses"] == pytest.approx(ref["ref_losses"], rel=RTOL)
    assert ref["pc_weights_err"] <= RTOL, f"world {world}: final weights differ by {ref['pc_weights_err']:.2e}"


def test_set_cp_gradient_reduction_refuses_a_model_without_fsdp2():
    from hf_ring.fsdp import set_cp_gradient_reduction

    with pytest.raises(ValueError, match="holds no FSDP2 module"):
        set_cp_gradient_reduction(tiny_llama(), dp_size=1)
    with pytest.raises(ValueError, match="dp_size must be a positive int"):
        set_cp_gradient_reduction(tiny_llama(), dp_size=0)


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]))
