"""A vision-language model (Gemma 3, as ``AutoModelForCausalLM`` loads its checkpoints) fine-tuned on text with
``RingAttentionPlugin`` under DDP: one ``torchrun`` launch of 2 CPU ranks (gloo, CP = 2, fp32).

- A vision tower that gets no gradient from text-only batches, which DDP refuses at the second step: ``prepare``
  raises on every rank first, naming both ways out (for a text-only wrapper: LFM2-VL's patch made text-only by
  ``tests.hf_models.text_only``, as every supported wrapper takes images; for a family that takes images under the
  ring, such as Gemma 3, it warns).
- The check in process: DDP only (not one process, not FSDP2), not with ``find_unused_parameters``, not for text
  models or a frozen vision tower; LoRA on every ``q_proj`` reaches into the vision tower too.
- Either way out then trains exactly: with the vision tower and projector frozen, and with
  ``find_unused_parameters=True``, the per-step losses and final weights equal single-process training on the
  full sequences (the chunked loss on, as the plugin's default).
- Qwen2-VL trained on batches with images (each sample an image; the collator concatenates their patches), its
  vision tower trainable under plain DDP: the plugin's DataLoader keeps the inputs whole, the model cuts its
  embeddings, and losses and final weights (vision tower included) equal single-process training; the same with
  ``RingAttentionTrainer`` (gradient accumulation 2, the Trainer's token-weighted loss), which counts the input
  tokens once per CP group.
- Gemma 3 trained on batches with images through the plugin, its vision tower trainable: each image's tokens see
  each other both ways across the two ranks' chunks; losses and final weights equal single-process training.
- TRL's ``SFTTrainer`` through ``RingSFTTrainer`` on Qwen2-VL image batches of 32 tokens (no padding, so no
  ``attention_mask``, which TRL's token count needs): losses equal single-process training, ``num_tokens`` counts
  each token once, not once per CP rank.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import (
    BATCH,
    GA,
    SEQ_LEN,
    collate,
    collate_images,
    gemma3_image_samples,
    image_samples,
    max_param_rel_err,
    read_results,
    rel_err,
    replica_reference,
    run_worker,
    token_dataset,
    torchrun,
    trainer_reference,
)

STEPS = 3
RTOL = 1e-5  # fp32: ring attention reorders sums, nothing else changes


def _model(frozen: bool):
    from tests.hf_models import make_model

    model = make_model("gemma3")
    if frozen:
        model.model.vision_tower.requires_grad_(False)
        model.model.multi_modal_projector.requires_grad_(False)
    return model


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(plugin, accelerator, model, data, collate_fn=collate) -> tuple[list, dict]:
    from tests.train_utils import plugin_train

    model, _, _, losses = plugin_train(plugin, accelerator, model, data, STEPS, collate_fn=collate_fn)
    return losses, _weights(accelerator.unwrap_model(model))


def _image_trainer(out: Path, images: list) -> tuple[list, dict, int]:
    """``RingAttentionTrainer`` on the image samples (gradient accumulation over 2 micro-batches, tokens counted)."""
    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.trainer import RingAttentionTrainer
    from tests.hf_models import make_model
    from tests.train_utils import logged_losses, trainer_args

    trainer = RingAttentionTrainer(
        model=make_model("qwen2_vl", images=True),
        args=trainer_args(out, "images_trainer", include_num_input_tokens_seen="all", ddp_find_unused_parameters=False),
        train_dataset=images,
        data_collator=collate_images,
        ring_plugin=RingAttentionPlugin(cp_size=2),
    )
    trainer.train()
    flops = trainer.state.total_flos / (6 * trainer.model.num_parameters(exclude_embeddings=True))  # tokens
    return logged_losses(trainer), _weights(trainer.model), [trainer.state.num_input_tokens_seen, flops]


def _image_sft(out: Path, images: list) -> tuple[list, list, list]:
    """``RingSFTTrainer`` on the image samples: its logged losses, ``num_tokens`` and token accuracies."""
    from hf_ring.trainer import RingSFTTrainer
    from tests.hf_models import make_model
    from tests.train_utils import logged_losses, sft_trainer

    trainer = sft_trainer(
        RingSFTTrainer, out, images, model=make_model("qwen2_vl", images=True), collate_fn=collate_images,
        name="images_sft",
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logged_losses(trainer), [h["num_tokens"] for h in logs], [h["mean_token_accuracy"] for h in logs]


def worker(out: Path) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from hf_ring.accelerate import RingAttentionPlugin
    from tests.hf_models import make_model, text_only

    data = token_dataset(BATCH * (STEPS + 1), SEQ_LEN)
    accelerator = Accelerator(cpu=True)
    res: dict = {}
    try:
        with text_only("lfm2_vl"):  # (every wrapper takes images: a text-only one made so)
            RingAttentionPlugin(cp_size=2).prepare(accelerator, make_model("lfm2_vl"))
    except ValueError as e:
        res["unused_error"] = str(e)
    res["frozen"], frozen_state = _train(RingAttentionPlugin(cp_size=2), accelerator, _model(frozen=True), data)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    res["unused"], unused_state = _train(RingAttentionPlugin(cp_size=2), accelerator, _model(frozen=False), data)
    images = image_samples(BATCH * (STEPS + 1))
    qwen = make_model("qwen2_vl", images=True)
    rows = res["images_vision_rows"] = []  # the patches each call of this rank's vision tower encodes
    qwen.model.visual.register_forward_pre_hook(lambda m, args: rows.append(int(args[0].shape[0])))
    res["images"], images_state = _train(
        RingAttentionPlugin(cp_size=2), Accelerator(cpu=True), qwen, images, collate_images
    )
    gemma_images = gemma3_image_samples(BATCH * (STEPS + 1))
    gemma = functools.partial(make_model, "gemma3", images=True)
    res["gemma3_images"], gemma_state = _train(
        RingAttentionPlugin(cp_size=2), Accelerator(cpu=True), gemma(), gemma_images, collate_images
    )
    trainer_images = image_samples(BATCH * GA * STEPS)
    res["images_trainer"], trainer_state, res["images_tokens_seen"] = _image_trainer(out, trainer_images)
    sft_images = image_samples(BATCH * GA * STEPS, seq_len=32)
    trl = importlib.util.find_spec("trl") is not None  # (its test skips without TRL)
    if trl:
        res["images_sft"], res["images_sft_tokens"], res["images_sft_accuracy"] = _image_sft(out, sft_images)
    if accelerator.process_index == 0:
        steps = [[[collate_images(trainer_images[(s * GA + m) * BATCH :][:BATCH])] for m in range(GA)]
                 for s in range(STEPS)]  # fmt: skip
        make = functools.partial(make_model, "qwen2_vl", images=True)
        res["images_trainer_ref"], ref_state = trainer_reference(steps, make=make)
        res["images_trainer_weights_err"] = max_param_rel_err(trainer_state, ref_state)
        if trl:
            steps = [[[collate_images(sft_images[(s * GA + m) * BATCH :][:BATCH])] for m in range(GA)]
                     for s in range(STEPS)]  # fmt: skip
            res["images_sft_ref"], _ = trainer_reference(steps, make=make)
        for name, state, frozen in (("frozen", frozen_state, True), ("unused", unused_state, False)):
            ref_losses, ref_state = replica_reference(data, 1, STEPS, make=functools.partial(_model, frozen))
            res[f"{name}_ref"] = ref_losses
            res[f"{name}_weights_err"] = max_param_rel_err(state, ref_state)
        res["images_ref"], ref_state = replica_reference(images, 1, STEPS, make=make, collate_fn=collate_images)
        res["images_weights_err"] = max_param_rel_err(images_state, ref_state)
        res["gemma3_images_ref"], ref_state = replica_reference(
            gemma_images, 1, STEPS, make=gemma, collate_fn=collate_images
        )
        # a key bias gets no gradient but rounding (the softmax ignores a shift shared by a row's scores): the
        # vision tower's stay at 0 within 1e-6, compared on that absolute scale rather than relative to their norm
        bias = [k for k in ref_state if k.endswith("k_proj.bias")]
        # The vision tower's biases start at 0 and their gradients sum many terms of both signs: fp32 rounding alone
        # moves them, the single-process fp32 run's by up to 3e-5 from the same run with an fp64 forward and backward
        # (its updates applied to the fp32 weights; torch 2.11, measured). So each parameter of the CP run is held to
        # that run, within twice the fp32 run's own distance from it (plus 1e-6): ``gemma3_images_weights_err`` <= 1.
        _, exact = replica_reference(gemma_images, 1, STEPS, dtype=torch.float64, make=gemma, collate_fn=collate_images)
        res["gemma3_images_weights_err"] = max(
            rel_err(gemma_state[k], exact[k]) / (2 * rel_err(ref_state[k], exact[k]) + 1e-6)
            for k in ref_state
            if k not in bias
        )
        res["gemma3_key_bias"] = max(float((gemma_state[k] - ref_state[k]).abs().max()) for k in bias)
        res["gemma3_vision_trained"] = sum(
            "vision_tower" in k and not torch.equal(gemma_state[k], v) for k, v in gemma().state_dict().items()
        )
        start = make_model("qwen2_vl", images=True).state_dict()
        res["images_vision_trained"] = sum(  # the CP run's vision tower moved (its image features had gradients)
            "visual" in k and not torch.equal(images_state[k], start[k]) for k in start
        )
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(res))
    accelerator.wait_for_everyone()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision_language")
    torchrun(Path(__file__), 2, out, timeout=300)
    return read_results(out, 2)


def test_prepare_refuses_parameters_text_batches_never_reach(results):
    for r in results:
        msg = r["unused_error"]
        assert "lie outside its text model" in msg and "model.vision_tower" in msg, msg
        assert "requires_grad_(False)" in msg and "find_unused_parameters=True" in msg, msg


@pytest.mark.parametrize("way", ["frozen", "unused", "images", "images_trainer", "gemma3_images"])
def test_training_matches_one_process(results, way):
    got, ref = results[0][way], results[0][f"{way}_ref"]
    assert results[1][way] == got  # every rank logs the same global loss
    assert len(got) == STEPS and max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= RTOL, (got, ref)
    assert results[0][f"{way}_weights_err"] <= (1.0 if way == "gemma3_images" else RTOL)  # (gemma3: see the worker)
    if way == "images":  # the vision tower trained (every rank's image features reached it)
        assert results[0]["images_vision_trained"] > 0
        # each rank encoded one of a batch's two images (16 patches of its 32): the tower's work divided
        assert all(len(r["images_vision_rows"]) >= STEPS and set(r["images_vision_rows"]) == {16} for r in results)
    if way == "gemma3_images":
        assert results[0]["gemma3_vision_trained"] > 0 and results[0]["gemma3_key_bias"] <= 1e-6
    if way == "images_trainer":  # tokens counted once per CP group: the layout pads each row of 30 to 32
        assert all(r["images_tokens_seen"][0] == STEPS * GA * BATCH * 32 for r in results), results
        # FLOPs (6 x parameters x tokens, summed over the ranks): each rank takes half of a whole batch
        assert all(r["images_tokens_seen"][1] == pytest.approx(STEPS * GA * BATCH * 32) for r in results), results


def test_trl_sft_trainer_with_images(results):
    pytest.importorskip("trl")
    got, ref = results[0]["images_sft"], results[0]["images_sft_ref"]
    assert len(got) == STEPS and max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= RTOL, (got, ref)
    # TRL's running token count: every token of a step's micro-batches once (32 per row, no padding)
    want = [(s + 1) * GA * BATCH * 32 for s in range(STEPS)]
    for r in results:
        assert r["images_sft"] == got and r["images_sft_tokens"] == want, r["images_sft_tokens"]
        assert r["images_sft_accuracy"] == results[0]["images_sft_accuracy"]  # gathered over every process


def test_the_check_names_what_text_batches_never_reach():
    """In process: which models, engines and DDP settings the check refuses (the Trainer's advice names its own
    argument) or warns about (families that take images); LoRA on every ``q_proj`` reaches into the vision tower
    too."""
    import warnings
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from hf_ring.engines import check_ddp_reaches_every_parameter, outside_text_model
    from tests.hf_models import make_model
    from tests.hf_models import text_only as text_only_patch

    def ddp(find_unused):
        return SimpleNamespace(
            distributed_type="MULTI_CPU", ddp_handler=SimpleNamespace(find_unused_parameters=find_unused)
        )

    model = make_model("lfm2_vl")
    with text_only_patch("lfm2_vl"):  # a text-only wrapper (every one takes images): its vision tower never reached
        with pytest.raises(ValueError, match=r"TrainingArguments\(ddp_find_unused_parameters=True\)"):
            check_ddp_reaches_every_parameter(
                ddp(False), model, "set TrainingArguments(ddp_find_unused_parameters=True)"
            )
        check_ddp_reaches_every_parameter(ddp(True), model)
        check_ddp_reaches_every_parameter(SimpleNamespace(distributed_type="NO"), model)  # one process: no DDP
        check_ddp_reaches_every_parameter(SimpleNamespace(distributed_type="FSDP", state=SimpleNamespace(
            fsdp_plugin=SimpleNamespace(fsdp_version=2))), model)  # fmt: skip
        frozen_lfm2 = make_model("lfm2_vl")
        frozen_lfm2.model.vision_tower.requires_grad_(False)
        frozen_lfm2.model.multi_modal_projector.requires_grad_(False)
        check_ddp_reaches_every_parameter(ddp(False), frozen_lfm2)
    check_ddp_reaches_every_parameter(ddp(False), _model(frozen=True))
    check_ddp_reaches_every_parameter(ddp(False), make_model("llama"))  # a text model: nothing outside
    for family in ("qwen2_vl", "gemma3", "gemma4", "lfm2_vl"):  # they take images: batches may reach every parameter
        with pytest.warns(UserWarning, match="every batch must reach them"):
            check_ddp_reaches_every_parameter(ddp(False), make_model(family))
    assert outside_text_model(make_model("llama")) == []
    lora = get_peft_model(_model(frozen=True), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    unused = outside_text_model(lora)
    assert unused and all("vision_tower" in n and "lora_" in n for n in unused), unused
    with pytest.warns(UserWarning, match="every batch must reach them"):  # Gemma 3 takes images
        check_ddp_reaches_every_parameter(ddp(False), lora)
    text_only = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        check_ddp_reaches_every_parameter(ddp(False), get_peft_model(_model(frozen=True), text_only))


def test_the_vision_split_is_installed_balanced_and_reverted():
    """The grid families' encoders are split while patched (innermost module only) and restored by revert; images go
    largest first to the least loaded rank, the same on every rank."""
    from hf_ring.patches import _split_vision

    import hf_ring
    from tests.hf_models import make_model

    model = hf_ring.apply_ring_attention(make_model("qwen3_vl", images=True))
    split = {(type(m).__name__, k) for m in model.modules() for k, v in vars(m).items()
             if isinstance(v, _split_vision.SplitEncoder)}  # fmt: skip
    assert split == {("Qwen3VLModel", "get_image_features"), ("Qwen3VLModel", "get_video_features")}, split
    hf_ring.revert_ring_attention(model)
    assert not any(k.startswith("get_") for m in model.modules() for k in vars(m))
    assert _split_vision._assign([16, 64, 16, 32, 16], 2) == [1, 0, 1, 1, 0]  # 64 + 16 | 32 + 16 + 16 (a tie: rank 0)
    assert _split_vision._assign([4, 4, 4], 2) == [0, 1, 0]


SPLIT_GRIDS = [[4, 4], [4, 8], [8, 4], [4, 4], [8, 8]]  # five images (or videos) of unequal sizes


def _split_worker(rank: int, world: int, family: str, method: str) -> dict:
    """The model's ``method`` on five images (videos of 2 temporal patches) with the split and without, a loss of
    their features (and deepstack features): the features on every rank, and the vision tower's gradient summed over
    the group (every rank takes the whole loss here: ``world`` times the reference's)."""
    import copy

    import torch.distributed as dist

    import hf_ring
    from tests.hf_models import make_model

    model = make_model(family, images=True)
    ref = copy.deepcopy(model)
    hf_ring.apply_ring_attention(model)
    frames = 2 if method == "get_video_features" else 1
    grids = torch.tensor([[frames, h, w] for h, w in SPLIT_GRIDS])
    # (HunYuan's patches: 16 x 16, Dots3 Note's, LLaVA-OneVision-1.5's and Ovis2.5's 14 x 14, without a temporal patch)
    width = {
        "hy_v4_vl": 3 * 16 * 16,
        "dots3_note": 3 * 14 * 14,
        "cosmos3_edge": 3 * 16 * 16,
        "llava_onevision1_5": 3 * 14 * 14,
        "ovis2_5": 3 * 14 * 14,
    }.get(family, 3 * 2 * 14 * 14)
    pixels = torch.randn(int(grids.prod(-1).sum()), width, generator=torch.Generator().manual_seed(3))
    rows = []

    def run(m):
        names = ("visual", "vision_model", "vision_tower")  # (HyperCLOVA X Vision V2's, HunYuan V4 VL's names for it)
        tower = next(getattr(m.model, n) for n in names if hasattr(m.model, n))

        def count(mod, args, kwargs):  # the rows of pixels the tower is given (Muse Spark passes them by name)
            rows.append(int((args[0] if args else kwargs["pixel_values"]).shape[0]))

        handle = tower.register_forward_pre_hook(count, with_kwargs=True)
        out = getattr(m.model, method)(pixels, grids)
        handle.remove()
        feats = torch.cat(out.pooler_output)
        deep = [
            torch.cat(d) if isinstance(d, (list, tuple)) else d for d in getattr(out, "deepstack_features", None) or []
        ]
        weights = torch.randn(feats.shape, generator=torch.Generator().manual_seed(5))
        loss = (feats * weights).sum() + sum((d * d).sum() for d in deep)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}
        return torch.cat([feats.detach(), *(d.detach() for d in deep)], dim=-1), grads

    feats, grads = run(model)
    encoded = list(rows)
    for g in grads.values():
        dist.all_reduce(g)  # (the CP gradient sum)
    ref_feats, ref_grads = run(ref)
    # each gradient relative to its own size, or to a thousandth of the whole gradient's where it is smaller: a key
    # bias's gradient is zero but for rounding (the softmax does not change when every key moves alike: HunYuan's)
    floor = 1e-3 * float(torch.stack([g.norm() for g in ref_grads.values()]).norm())
    grad_err = max(float((grads[n] / world - g).norm()) / max(float(g.norm()), floor) for n, g in ref_grads.items())
    return {"feat_err": float((feats - ref_feats).abs().max() / ref_feats.abs().max()), "grad_err": grad_err,
            "encoded": encoded, "total": int(pixels.shape[0]), "same_grads": sorted(grads) == sorted(ref_grads)}  # fmt: skip


@pytest.mark.parametrize(
    "family, method, world",
    [
        ("qwen3_vl", "get_video_features", 2),
        ("qwen3_vl", "get_image_features", 4),
        ("qwen2_5_vl", "get_image_features", 4),
        ("cohere_compass", "get_image_features", 2),
        ("hyperclovax_vision_v2", "get_video_features", 2),
        ("hy_v4_vl", "get_image_features", 2),
        ("muse_spark", "get_image_features", 2),
        ("dots3_note", "get_image_features", 2),
        ("qwen4_exp", "get_video_features", 2),
        ("muse_glimmer", "get_image_features", 2),
        ("cosmos3_edge", "get_image_features", 2),
        ("glm5_next", "get_image_features", 2),
        ("llava_onevision1_5", "get_image_features", 2),
        ("ovis2_5", "get_image_features", 2),
    ],  # fmt: skip
    ids=[
        "qwen3_vl-videos-2",
        "qwen3_vl-images-4",
        "qwen2_5_vl-images-4",
        "cohere_compass-images-2",
        "hyperclovax_vision_v2-videos-2",
        "hy_v4_vl-images-2",
        "muse_spark-images-2",
        "dots3_note-images-2",
        "qwen4_exp-videos-2",
        "muse_glimmer-images-2",
        "cosmos3_edge-images-2",
        "glm5_next-images-2",
        "llava_onevision1_5-images-2",
        "ovis2_5-images-2",
    ],  # fmt: skip
)
def test_the_vision_split_gives_every_rank_every_feature_and_the_whole_gradient(family, method, world):
    """Each rank encodes only its share of five images (videos: Qwen3-VL encodes their frames with its image
    method, inside the split one; HyperCLOVA X Vision V2 too; HunYuan V4 VL's features carry a newline token per row);
    the features every rank gets and the vision tower's gradient summed over the
    group equal the unsplit model's (Qwen3-VL's and Cohere Compass's deepstack features included; Qwen2.5-VL's
    windowed tower)."""
    from tests.dist_utils import run_distributed
    from tests.hf_models import in_transformers

    if not in_transformers(family):
        pytest.skip(f"{family} is not in this Transformers release")
    results = run_distributed(_split_worker, world, family, method, timeout=600)
    for r in results:
        assert r["feat_err"] <= 1e-6 and r["grad_err"] <= 1e-5 and r["same_grads"], r
        assert len(r["encoded"]) == 1 and r["encoded"][0] < r["total"], r  # (one call: the nested one not split again)
    assert sum(r["encoded"][0] for r in results) == results[0]["total"], results


def _batched_worker(rank: int, world: int, family: str) -> dict:
    """A training step of ``family``'s model on a batch with images, the model patched: the images each rank's
    vision tower encodes, and the tower's gradient summed over the group against the unpatched model's (each rank
    takes its share of the loss)."""
    import copy

    import torch.distributed as dist

    import hf_ring
    from tests.hf_models import make_batch, make_model

    model = make_model(family, images=True)
    with torch.no_grad():  # (Gemma 3's projection starts at zero: no gradient would reach its tower)
        for p in model.model.multi_modal_projector.parameters():
            if p.dim() > 1 and not p.any():
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(model)
    batch, _ = make_batch("images", 40, family=family)
    hf_ring.apply_ring_attention(model)
    tower = model.model.vision_tower
    rows = []
    tower.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(int((args[0] if args else kwargs["pixel_values"]).shape[0])),
        with_kwargs=True,
    )
    model(**hf_ring.shard_batch(batch)).loss.backward()
    ref(**batch).loss.backward()
    grads = {n: p.grad for n, p in tower.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)  # (the CP gradient sum)
    want = {n: p.grad for n, p in ref.model.vision_tower.named_parameters() if p.grad is not None}
    floor = 1e-3 * float(torch.stack([g.norm() for g in want.values()]).norm())
    err = max(float((grads[n] - g).norm()) / max(float(g.norm()), floor) for n, g in want.items())
    with torch.no_grad():  # a caller asking for a tuple gets one, the split stays on; the rank's hidden state dropped
        as_tuple = model.model.get_image_features(batch["pixel_values"], return_dict=False)
        as_dict = model.model.get_image_features(batch["pixel_values"], return_dict=True)
    return {
        "rows": rows,
        "total": int(batch["pixel_values"].shape[0]),
        "grad_err": err,
        "same": grads.keys() == want.keys(),
        "tuple": isinstance(as_tuple, tuple),
        "hidden_dropped": "last_hidden_state" not in as_dict.keys(),
    }


@pytest.mark.parametrize("family", ["gemma3", "paligemma", "llava", "internvl", "aya_vision"])
def test_the_vision_split_of_a_batch_of_images_of_one_size(family):
    """Gemma 3, PaliGemma, LLaVA, InternVL and Aya Vision encode a batch of images of one size: each rank encodes
    its share of the batch's three images (one or two) in a training step, and the vision tower's gradient summed
    over the group is the unpatched model's (the logits and loss: the parity tests of these families); a call asking
    for a tuple gets one and leaves the split on, and the output keeps no rank's share of the last hidden state."""
    from tests.dist_utils import run_distributed
    from tests.hf_models import in_transformers

    if not in_transformers(family):
        pytest.skip(f"{family} is not in this Transformers release")
    results = run_distributed(_batched_worker, 2, family, timeout=600)
    for r in results:  # (the training step, then the two calls below: split every time)
        assert len(r["rows"]) == 3 and r["rows"][0] < r["total"] and len(set(r["rows"])) == 1, r
        assert r["same"] and r["grad_err"] <= 1e-5, r
        assert r["tuple"] and r["hidden_dropped"], r
    assert sum(r["rows"][0] for r in results) == results[0]["total"], results


def _differing_worker(rank: int, world: int) -> str:
    import hf_ring
    from tests.hf_models import make_model

    model = hf_ring.apply_ring_attention(make_model("qwen2_vl", images=True))
    grids = torch.tensor([[1, 4, 4]] * 3)
    pixels = torch.randn(48, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(3)) + rank  # (rank 1's differ)
    try:
        model.model.get_image_features(pixels, grids)
    except ValueError as e:
        return str(e)
    return "no error"


def test_the_vision_split_refuses_ranks_given_different_images():
    """Every rank raises the same error before the split's collectives (ring_generate's own check of the prompt's
    images sees the gathered features, alike on every rank)."""
    from tests.dist_utils import run_distributed

    for error in run_distributed(_differing_worker, 2, timeout=300):
        assert "vision split: ranks disagree on pixel values" in error, error


NO_MASK = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "qwen2_vl", "gemma3", "paligemma")


def _no_mask_worker(rank: int, world: int) -> dict:
    """A batch with images and no ``attention_mask``, 41 tokens (``shard_batch`` pads 3): its parity with the
    unmodified model on the 41 tokens."""
    from tests.hf_models import errors, in_transformers, make_batch, prepare, reference_step, ring_step

    out = {}
    for family in NO_MASK:
        if not in_transformers(family):
            continue
        batch, _ = make_batch("images", 41, family=family)
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        model = prepare(family, {}, images=True)
        ref_loss, ref_grads = reference_step(model, batch)
        loss, grads = ring_step(model, batch, "zigzag", None)
        out[family] = errors(loss, grads, ref_loss, ref_grads)
    return out


def test_a_batch_with_images_and_no_mask_padded_by_the_ring_matches_the_unmodified_model():
    """The padding ``shard_batch`` adds comes last and is masked by the document ids, not by an attention mask the
    batch did not have: the Qwen-Omni thinkers number images by their grids only when given a mask (without one, as
    text), which a mask added here had changed (loss 7.5e-4 and gradients 0.7 off)."""
    from tests.dist_utils import run_distributed

    for family, err in run_distributed(_no_mask_worker, 2, timeout=600)[0].items():
        assert err["loss"] <= 1e-5 and err["grad"] <= 1e-5, (family, err)


if __name__ == "__main__":
    run_worker(worker, Path(sys.argv[1]))
