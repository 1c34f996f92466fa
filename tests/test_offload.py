"""``apply_activation_offload``: the checkpointed layers' inputs in host memory, the loss and gradients unchanged.

On CPU the tensors already live on the host, so the tests make the offload treat CPU tensors as device
tensors (``device_types``, ``min_bytes=0``): every pack and unpack runs as on a GPU, with plain copies
instead of pinned asynchronous ones. The CUDA path (side stream, prefetch, no host sync, the memory it
frees) runs in the GPU tests at the end, skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.loss import liger_unavailable
from hf_ring.offload import activation_offload_of

from .dist_utils import run_distributed
from .hf_models import make_batch, make_model


def _offload(model, min_bytes: int = 0):
    """``apply_activation_offload`` that moves CPU tensors too (what it does to device tensors on a GPU)."""
    hf_ring.apply_activation_offload(model, min_bytes=min_bytes)
    offload = activation_offload_of(model)
    offload.device_types = ("cpu",)
    return offload


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpointed(model, every_n_layers: int = 1, use_reentrant: bool = False):
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}, every_n_layers=every_n_layers
    )
    model.train()
    return model


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_the_layer_inputs_go_to_the_host_and_the_loss_and_gradients_stay_bit_equal(use_reentrant):
    batch, _ = make_batch("packed", 40)
    model = make_model("llama", num_hidden_layers=3)
    offload = _offload(model)  # before checkpointing is enabled, as the Trainer does it (train() enables it)
    _checkpointed(model, use_reentrant=use_reentrant)
    if use_reentrant:
        model.enable_input_require_grads()  # as Transformers asks of reentrant checkpointing with frozen embeddings
    hidden = model.config.hidden_size
    model(**batch)  # wraps the layers' checkpoint functions
    hf_ring.revert_activation_offload(model)
    assert all(layer._gradient_checkpointing_func.__module__ != "hf_ring.offload" for layer in model.model.layers)
    ref_loss, ref_grads = _loss_and_grads(model, batch)
    offload = _offload(model)
    loss, grads = _loss_and_grads(model, batch)
    # one tensor per layer: its input hidden states, [batch, seq, hidden]
    assert offload.offloaded == 3
    assert offload.offloaded_bytes == 3 * batch["input_ids"].numel() * hidden * 4
    assert torch.equal(loss, ref_loss)  # copies and a recompute of the same ops: bit for bit
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_only_checkpointed_layers_offload_and_small_tensors_stay():
    batch, _ = make_batch("plain", 40)
    model = _checkpointed(make_model("mistral", num_hidden_layers=4), every_n_layers=2)
    offload = _offload(model)
    model(**batch).loss.backward()
    assert offload.offloaded == 2  # layers 0 and 2 are checkpointed; 1 and 3 keep their activations
    layer_input = batch["input_ids"].numel() * model.config.hidden_size * 4
    offload = _offload(model, min_bytes=layer_input + 1)  # applying again replaces the setting
    model(**batch).loss.backward()
    assert offload.offloaded == 0


def test_lora_chunked_loss_and_offload_together():
    from peft import LoraConfig, get_peft_model

    _, batch = make_batch("padded", 40)  # the unsharded form: padding as attention_mask
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    peft = get_peft_model(make_model("qwen2"), lora)
    peft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft.enable_input_require_grads()
    peft.train()
    ref_loss, ref_grads = _loss_and_grads(peft, batch)
    hf_ring.apply_chunked_loss(peft, chunk_size=7)
    offload = _offload(peft)
    loss, grads = _loss_and_grads(peft, batch)
    assert offload.offloaded == len(peft.get_base_model().model.layers)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)  # fp32: the chunked loss reorders the sum
    assert all((grads[n] - ref_grads[n]).norm() <= 1e-5 * ref_grads[n].norm() for n in ref_grads)


def test_training_without_checkpointing_is_refused_and_revert_removes_every_hook():
    batch, _ = make_batch("plain", 40)
    model = make_model("llama").train()
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    before = hooks()
    _offload(model)
    assert hooks() == before + 1  # the model's pre-hook: the check, and the layers' checkpoint functions wrapped
    with pytest.raises(ValueError, match="activation offload .* but no activation checkpointing"):
        model(**batch)
    with torch.no_grad():
        model(**batch)  # no backward, nothing to keep: allowed
    model.eval()(**batch)  # evaluation: allowed
    hf_ring.revert_activation_offload(model)
    assert hooks() == before
    assert activation_offload_of(model) is None
    model.train()(**batch).loss.backward()  # no checkpointing, no offload: fine
    with pytest.raises(ValueError, match="no activation offload to revert"):
        hf_ring.revert_activation_offload(model)
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int"):
        hf_ring.apply_activation_offload(model, min_bytes=-1)


def _cp_worker(rank: int, world: int) -> dict:
    """Ring attention + chunked loss + offload on 2 gloo ranks: the shares sum to the unsharded loss and gradients."""
    import torch.distributed as dist

    batch, ref_batch = make_batch("packed", 40)
    model = _checkpointed(make_model("llama"))
    ref_loss, ref_grads = _loss_and_grads(model, ref_batch)
    hf_ring.apply_ring_attention(model)
    hf_ring.apply_chunked_loss(model, chunk_size=7)
    offload = _offload(model)
    loss, grads = _loss_and_grads(model, hf_ring.shard_batch(batch))
    for g in grads.values():
        dist.all_reduce(g)
    loss = hf_ring.reduce_loss(loss)
    return {
        "offloaded": offload.offloaded,
        "loss": float((loss - ref_loss).abs() / ref_loss.abs()),
        "grad": max(float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()) for n in ref_grads),
    }


def test_context_parallel_with_offload_matches_the_unsharded_model():
    for r in run_distributed(_cp_worker, 2, timeout=180):
        assert r["offloaded"] == 2  # one layer input per layer on each rank
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r  # fp32: ring merge and chunked sum reorder additions


def test_plugin_options_and_environment(monkeypatch):
    from hf_ring.accelerate import RingAttentionPlugin

    assert RingAttentionPlugin().offload_activations is False
    monkeypatch.setenv("HF_RING_OFFLOAD_ACTIVATIONS", "1")
    assert RingAttentionPlugin().offload_activations is True
    assert RingAttentionPlugin(offload_activations=False).offload_activations is False
    monkeypatch.setenv("HF_RING_OFFLOAD_ACTIVATIONS", "maybe")
    with pytest.raises(ValueError, match="HF_RING_OFFLOAD_ACTIVATIONS='maybe' is not a boolean"):
        RingAttentionPlugin()
    with pytest.raises(TypeError, match="offload_activations must be a bool"):
        RingAttentionPlugin(offload_activations="yes")
    # the chunked loss's backend rides along the same way
    monkeypatch.setenv("HF_RING_LOSS_BACKEND", "liger")
    assert RingAttentionPlugin(offload_activations=False).loss_backend == "liger"
    assert RingAttentionPlugin(offload_activations=False, loss_backend="torch").loss_backend == "torch"
    with pytest.raises(ValueError, match="unknown loss backend 'fused' .loss_backend."):
        RingAttentionPlugin(offload_activations=False, loss_backend="fused")
    monkeypatch.delenv("HF_RING_LOSS_BACKEND")
    monkeypatch.delenv("HF_RING_OFFLOAD_ACTIVATIONS")

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    batch, _ = make_batch("plain", 40)
    ref = make_model("llama")(**batch).loss
    model = _checkpointed(make_model("llama"))
    backend = "liger" if liger_unavailable(torch.device("cpu")) is None else "torch"  # Liger: in the interpreter
    plugin = RingAttentionPlugin(cp_size=1, offload_activations=True, loss_backend=backend)
    try:
        prepared = plugin.prepare(Accelerator(cpu=True), model)
        offload = activation_offload_of(prepared)
        assert offload is not None
        offload.device_types, offload.min_bytes = ("cpu",), 0  # as _offload does
        loss = prepared(**batch).loss
        loss.backward()
        assert offload.offloaded == 2
        assert float((loss - ref).abs()) <= 1e-5 * float(ref.abs())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# ---- CUDA: the asynchronous path ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offload_frees_the_layer_inputs_without_host_syncs():
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.device("cuda")
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
    torch.manual_seed(0)
    model = _checkpointed(LlamaForCausalLM(cfg).to(cuda))
    ids = torch.randint(1, 64, (1, 8192), device=cuda)
    batch = {"input_ids": ids, "labels": ids}
    ref_loss, ref_grads = _loss_and_grads(model, batch)  # also the warm-up
    loss = model(**batch).loss
    kept_without = torch.cuda.memory_allocated()  # what the forward keeps for the backward, without offload
    del loss
    hf_ring.apply_activation_offload(model)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = model(**batch).loss
        kept_with = torch.cuda.memory_allocated()
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    layer_input = ids.numel() * 256 * 4
    assert kept_without - kept_with >= 3 * layer_input  # at least 3 of the 4 layer inputs left the device
    assert activation_offload_of(model).offloaded == 4
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert torch.equal(loss.detach(), ref_loss) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
