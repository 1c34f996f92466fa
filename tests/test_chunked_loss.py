"""``apply_chunked_loss``: the unmodified model's loss and gradients without the ``[tokens, vocab]`` logits.

Every registered family (their final logit transforms included) against the unmodified model on the
same batch, plain and padded, with many small chunks; tied embeddings, LoRA with gradient
checkpointing, ``num_items_in_batch`` / ``shift_labels`` (the context-parallel contract, on a real
2-rank gloo group with ring attention), no labels (the model's own forward), that no tensor of
``[tokens, vocab]`` is kept for the backward, and the errors.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import hf_ring
from hf_ring import loss
from hf_ring.loss import default_chunk_size, is_chunked, liger_unavailable

from .dist_utils import run_distributed
from .hf_models import (
    DECAY_PARAMS,
    RTOL_DECAY,
    grad_error,
    in_transformers,
    make_batch,
    make_model,
    prepare,
    transformers_at_least,
    with_token_types,
)

RTOL = 1e-5  # fp32: the chunked sum reorders the additions of the loss, nothing else
CHUNK = 7  # tokens per chunk: many chunks, a ragged last one


# Dory's own forward gives NaN at left padding (rows that see no key), so its padded case scores real tokens only
NAN_AT_PADDING = ("dory",)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _families() -> list:
    from hf_ring.patches import supported_model_types

    return [t for t in supported_model_types() if in_transformers(t)]


@pytest.mark.parametrize("family", _families())
def test_every_family_matches_the_unmodified_loss_and_gradients(family):
    model = make_model(family)
    if loss._inner_causal_lm(model) is None:  # the default chunk follows the head's vocabulary (two modules too)
        text = model.config.get_text_config()  # (Inkling's head drops the logits of its padded vocabulary)
        width = getattr(text, "unpadded_vocab_size", None) or text.vocab_size
        assert loss._vocab_width(loss._head(model)) == width, family
    for kind in ("plain", "padded"):
        batch, masked = make_batch(kind, 40)
        if family in NAN_AT_PADDING:
            batch = masked
        batch = with_token_types(family, batch)  # (Molmo2 requires its token types in training)
        ref, ref_grads = _loss_and_grads(model, batch)
        assert hf_ring.apply_chunked_loss(model, chunk_size=CHUNK) is model and is_chunked(model)
        out, grads = _loss_and_grads(model, batch)
        hf_ring.revert_chunked_loss(model)
        assert out.logits is None and not is_chunked(model)
        assert _rel(out.loss, ref.loss) <= RTOL, (family, kind)
        assert grads.keys() == ref_grads.keys()
        top = max(float(g.double().norm()) for g in ref_grads.values())
        for name in grads:  # a linear-attention decay's gradient: a sum that nearly cancels (its own bound)
            bound = RTOL_DECAY if name.endswith(DECAY_PARAMS) else RTOL
            assert grad_error(name, grads[name], ref_grads[name], top) <= bound, (family, kind, name)


@pytest.mark.parametrize("family, kind", [("qwen2_5_omni_thinker", "images-padded"),
                                          ("qwen3_omni_moe_thinker", "audio")])  # fmt: skip
def test_a_wrapper_merging_media_in_its_own_forward_keeps_them(family, kind):
    """Transformers 5.17's Qwen-Omni thinkers merge images and audio and number positions in their own forward, their
    base model the text model: the chunked loss runs that forward (its head set aside), not the text model alone,
    which would drop the media and the positions. The unmodified loss and gradients, the towers' too."""
    model = make_model(family, images=True)
    batch, _ = make_batch(kind, 40, family=family)
    ref, ref_grads = _loss_and_grads(model, batch)
    hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
    out, grads = _loss_and_grads(model, batch)
    hf_ring.revert_chunked_loss(model)
    assert out.logits is None and _rel(out.loss, ref.loss) <= RTOL
    assert grads.keys() == ref_grads.keys()
    for name in grads:  # (an attention's key bias: a gradient of zero in exact arithmetic, rounding noise of 1e-13)
        got, want = grads[name].double(), ref_grads[name].double()
        assert (got - want).norm() <= RTOL * want.norm() + 1e-10, name


def _router_families() -> list:
    """The families whose causal LM adds the MoE router's load-balancing loss (a function hf_ring sums over ranks)."""
    from hf_ring.patches import _router

    return [t for t in _families() if _router._module_of(make_model(t)) is not None]


@pytest.mark.parametrize("family", _router_families())
def test_the_router_loss_is_added_as_the_family_adds_it(family):
    """With ``output_router_logits=True`` (weighed 1.0, so that it counts) the chunked loss adds the MoE router's
    load-balancing loss of the real tokens as the family does: the unmodified loss, ``aux_loss`` and gradients."""
    dense = {"flint": {"mlp_only_layers": [0]}}.get(family, {})  # (the test model's Flint has no MoE layer)
    model = make_model(family, output_router_logits=True, router_aux_loss_coef=1.0, aux_loss_coef=1.0, **dense)
    _, batch = make_batch("padded", 40)
    try:
        ref, ref_grads = _loss_and_grads(model, batch)
    except AttributeError as e:  # (Transformers 5.17's DBRX, GraniteMoE, JetMoE: 'int' object has no attribute 'to')
        if "'int' object has no attribute 'to'" not in str(e):
            raise
        hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)  # hf_ring's loss says so clearly instead
        with pytest.raises(ValueError, match="output_router_logits=True, but hf_ring's chunked loss"):
            model(**batch)
        return
    if getattr(ref, "aux_loss", None) is None:  # (5.17's vision-language MoE wrappers add none)
        hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
        out, _ = _loss_and_grads(model, batch)
        assert getattr(out, "aux_loss", None) is None and _rel(out.loss, ref.loss) <= RTOL
        return
    assert float(ref.aux_loss.detach()) > 0.5
    hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
    out, grads = _loss_and_grads(model, batch)
    hf_ring.revert_chunked_loss(model)
    assert out.logits is None and _rel(out.loss, ref.loss) <= RTOL and _rel(out.aux_loss, ref.aux_loss) <= RTOL
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        bound = RTOL_DECAY if name.endswith(DECAY_PARAMS) else RTOL
        assert _rel(grads[name], ref_grads[name]) <= bound, name


def test_a_logit_scale_left_unset_is_none():
    """Cohere Compass's config may leave ``logit_scale`` None (its head then scales by nothing): the chunked loss
    reads it as 1.0, the same loss and gradients as the unmodified model."""
    if not in_transformers("cohere_compass_text"):
        pytest.skip("cohere_compass_text is not in this Transformers release")
    model = make_model("cohere_compass_text", logit_scale=None)
    batch, _ = make_batch("plain", 40)
    ref, ref_grads = _loss_and_grads(model, batch)
    hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
    out, grads = _loss_and_grads(model, batch)
    hf_ring.revert_chunked_loss(model)
    assert _rel(out.loss, ref.loss) <= RTOL
    assert all(_rel(grads[n], ref_grads[n]) <= RTOL for n in ref_grads)


def test_without_labels_the_model_runs_as_before_and_revert_restores_it():
    model = make_model("gemma2").eval()
    ids = make_batch("plain", 40)[0]["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        hf_ring.apply_chunked_loss(model)
        during = model(input_ids=ids).logits
        hf_ring.revert_chunked_loss(model)
        after = model(input_ids=ids, labels=ids)
    assert torch.equal(during, before)
    assert after.logits is not None and torch.equal(after.logits, before)  # the model's own forward again
    assert "forward" not in vars(model)
    # while switched, the forward shows the model's own signature (the Trainer keeps the columns it names)
    hf_ring.apply_chunked_loss(model)
    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    hf_ring.revert_chunked_loss(model)


def test_a_shard_without_targets_gives_zero_loss_and_zero_head_gradient():
    """A CP shard of prompt or padding only: loss 0 (with num_items_in_batch), and every parameter, the head
    included, gets a gradient tensor of zeros, as with the full logits (DDP / FSDP2 expect one on every rank)."""
    model = hf_ring.apply_chunked_loss(make_model("llama"), chunk_size=CHUNK)
    ids = make_batch("plain", 40)[0]["input_ids"]
    out = model(input_ids=ids, labels=torch.full_like(ids, -100), num_items_in_batch=torch.tensor(17))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()


def test_a_switched_model_pickles_and_deep_copies():
    import copy
    import pickle

    model = hf_ring.apply_chunked_loss(make_model("llama"), chunk_size=CHUNK)
    batch, _ = make_batch("plain", 40)
    with torch.no_grad():
        want = model(**batch).loss
        for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert is_chunked(twin) and twin.forward.model is twin  # bound to the copy, not the original
            out = twin(**batch)
            assert out.logits is None and torch.equal(out.loss, want)


def test_tied_embeddings_lora_and_gradient_checkpointing():
    from peft import LoraConfig, get_peft_model

    batch, _ = make_batch("packed", 40)
    tied = make_model("llama", tie_word_embeddings=True)
    tied.tie_weights()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    ref, ref_grads = _loss_and_grads(tied, batch)
    hf_ring.apply_chunked_loss(tied, chunk_size=CHUNK)
    out, grads = _loss_and_grads(tied, batch)
    assert _rel(out.loss, ref.loss) <= RTOL
    assert max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= RTOL

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "v_proj", "lm_head"])  # fmt: skip
    peft = get_peft_model(make_model("qwen2"), lora)
    peft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft.train()
    ref, ref_grads = _loss_and_grads(peft, batch)
    assert hf_ring.apply_chunked_loss(peft, chunk_size=CHUNK) is peft
    out, grads = _loss_and_grads(peft, batch)
    assert any("lm_head" in n for n in grads)  # LoRA on the head: its adapters get gradients through the chunks
    assert _rel(out.loss, ref.loss) <= RTOL
    assert max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= RTOL


def test_a_trained_head_over_a_frozen_model_is_recomputed_too():
    """Only the lm_head trains (the hidden states need no gradient): the chunks are still checkpointed, none keeps its
    logits' log-softmax for the backward; the head's gradient is the unmodified model's."""
    vocab = 211
    model = make_model("llama", vocab_size=vocab)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))
    batch, _ = make_batch("plain", 40)
    ref, ref_grads = _loss_and_grads(model, batch)
    hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(_by_vocab(t, model, vocab) > 0) or t, lambda t: t
    ):
        out, grads = _loss_and_grads(model, batch)
    assert not any(saved) and list(grads) == ["lm_head.weight"]
    assert _rel(out.loss, ref.loss) <= RTOL and _rel(grads["lm_head.weight"], ref_grads["lm_head.weight"]) <= RTOL


def _with_head_bias(model):
    """``model`` with an lm_head that has a bias (random), the rest of its head as it was."""
    old = model.lm_head
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
    return model


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]),
    ],
)
def test_bf16_head_gradients_are_summed_over_the_chunks_in_fp32(device):
    """bf16 weights trained in bf16, 512 chunks: the head's weight and bias gradients within the bf16 rule (twice the
    unmodified bf16 model's error against float64, plus 5e-3), as every other gradient. Autograd's own sum of the
    chunks' gradients, one bf16 rounding per chunk, measured 2.5e-2 for the weight at 256 chunks against the model's
    4.7e-3, 0.29 at 4096."""
    vocab, chunk = 256, 4
    ids = torch.randint(0, vocab, (2, 1024), generator=torch.Generator().manual_seed(5)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    wide = _with_head_bias(make_model("llama", vocab_size=vocab)).double().to(device)
    ref, ref_grads = _loss_and_grads(wide, batch)
    model = _with_head_bias(make_model("llama", vocab_size=vocab)).bfloat16().to(device)
    model.load_state_dict(wide.state_dict())
    own, own_grads = _loss_and_grads(model, batch)
    hf_ring.apply_chunked_loss(model, chunk_size=chunk)
    out, grads = _loss_and_grads(model, batch)
    assert grads.keys() == ref_grads.keys() and grads["lm_head.weight"].dtype == torch.bfloat16
    assert _rel(out.loss, ref.loss) <= 2 * _rel(own.loss, ref.loss) + 1e-4
    for name in ref_grads:
        assert _rel(grads[name], ref_grads[name]) <= 2 * _rel(own_grads[name], ref_grads[name]) + 5e-3, name


def test_a_float64_head_is_summed_in_float64_and_a_second_derivative_is_refused():
    """float64 weights (check_exactness's yardstick runs): gradients as the unmodified model's to float64 rounding
    (an fp32 sum would leave 3e-8); a backward with create_graph=True raises rather than giving no graph."""
    model = make_model("llama").double()
    batch, _ = make_batch("plain", 40)
    ref, ref_grads = _loss_and_grads(model, batch)
    hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
    out, grads = _loss_and_grads(model, batch)
    assert _rel(out.loss, ref.loss) <= 1e-12 and max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= 1e-12
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(model(**batch).loss, model.lm_head.weight, create_graph=True)


def test_a_head_with_hooks_runs_as_a_module_per_chunk():
    """A head whose weight may exist only inside its call (hooks: FSDP2 around the head alone, DeepSpeed ZeRO-3) runs
    as a module, chunk by chunk, its hooks called each time; with a bias too, the unmodified loss and gradients."""
    model = _with_head_bias(make_model("llama"))
    batch, _ = make_batch("plain", 40)
    ref, ref_grads = _loss_and_grads(model, batch)
    hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
    out, grads = _loss_and_grads(model, batch)  # (no hooks: one function over the chunks)
    assert _rel(out.loss, ref.loss) <= RTOL and max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= RTOL
    head, calls = model.lm_head, []
    targets = int((batch["labels"][:, 1:] != -100).sum())
    for way in ("hook", "instance forward"):  # (Accelerate's device hooks replace the forward on the instance)
        calls.clear()
        if way == "hook":
            handle = head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
        else:
            head.forward = lambda x: calls.append(x.shape[0]) or torch.nn.Linear.forward(head, x)
        out, grads = _loss_and_grads(model, batch)
        if way == "hook":
            handle.remove()
        else:
            del head.forward
        assert sum(calls) == 2 * targets and max(calls) <= CHUNK, way  # each chunk in the forward, again in backward
        assert _rel(out.loss, ref.loss) <= RTOL and max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= RTOL


def test_a_forward_another_library_replaced_is_refused_not_dropped():
    """An instance forward set before (Accelerate's autocast wrapper, a Liger or TRL head) would be lost: refused;
    applying again (a new chunk size) is not."""
    model = make_model("llama")
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    with pytest.raises(ValueError, match="forward was replaced on the instance"):
        hf_ring.apply_chunked_loss(model)
    model = hf_ring.apply_chunked_loss(make_model("llama"), chunk_size=8)
    assert hf_ring.apply_chunked_loss(model, chunk_size=16) is model and is_chunked(model)


def _by_vocab(t, model, vocab) -> int:
    """``t``'s size when one of its dimensions is the vocabulary and it is not a parameter (the head's weight and bias,
    saved for the backward as by any linear layer), else 0."""
    params = {p.data_ptr() for p in model.parameters()}
    return t.numel() if vocab in t.shape and t.data_ptr() not in params else 0


def test_no_tensor_of_tokens_by_vocab_is_kept_for_backward():
    vocab = 211  # a width no other tensor of the model has
    model = make_model("llama", vocab_size=vocab)
    batch, _ = make_batch("plain", 40)
    saved = []

    def pack(t):
        saved.append(_by_vocab(t, model, vocab))
        return t

    hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    assert max(saved) <= CHUNK * vocab  # at most one chunk's logits (here none: each chunk is recomputed)
    hf_ring.revert_chunked_loss(model)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    assert max(saved) >= batch["input_ids"].numel() * vocab  # the yardstick: the unmodified model keeps them


def test_default_chunk_size_keeps_a_chunk_of_fp32_logits_within_256_mib():
    assert default_chunk_size(128256) == 523  # Llama-3: 523 x 128256 x 4 bytes = 255.9 MiB
    assert default_chunk_size(49152) * 49152 * 4 <= 256 * 2**20 < (default_chunk_size(49152) + 1) * 49152 * 4


def test_errors_name_what_is_unsupported():
    from transformers import XGLMConfig, XGLMForCausalLM

    with pytest.raises(ValueError, match="no ring-attention patch for model type 'xglm'"):
        hf_ring.apply_chunked_loss(
            XGLMForCausalLM(XGLMConfig(num_layers=1, attention_heads=2, d_model=16, ffn_dim=32, vocab_size=32))
        )
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        hf_ring.apply_chunked_loss(make_model("llama"), chunk_size=0)
    with pytest.raises(ValueError, match="no chunked loss to revert"):
        hf_ring.revert_chunked_loss(make_model("llama"))
    batch, _ = make_batch("plain", 40)
    with pytest.raises(ValueError, match="logits_to_keep cannot be combined with labels"):
        hf_ring.apply_chunked_loss(make_model("llama"))(**batch, logits_to_keep=1)
    custom = make_model("llama")
    custom.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match="loss_type='ForMaskedLM'"):
        hf_ring.apply_chunked_loss(custom)


# ---- backend="liger": Liger-Kernel's fused linear cross-entropy (on CPU in Triton's interpreter) ---------------

liger = pytest.mark.skipif(
    liger_unavailable(torch.device("cpu")) is not None and not torch.cuda.is_available(),
    reason="needs Liger-Kernel and CUDA or Triton's interpreter",
)
LIGER_RTOL = 1e-5  # fp32: Liger's kernel reorders the softmax sums; measured 1e-7 - 1e-6


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# the interpreter cannot run Liger's softcapping (it calls .to() on a Python float); Gemma2 runs on a GPU
_LIGER_FAMILIES = ["llama", "granite", "cohere2"] + (["gemma2"] if torch.cuda.is_available() else [])


@liger
@pytest.mark.parametrize("family", _LIGER_FAMILIES)
def test_liger_backend_matches_the_unmodified_loss_and_gradients(family):
    model = make_model(family).to(_device())
    for kind in ("plain", "packed"):
        batch = {k: v.to(_device()) for k, v in make_batch(kind, 40)[1].items()}
        ref, ref_grads = _loss_and_grads(model, batch)
        hf_ring.apply_chunked_loss(model, backend="liger")
        out, grads = _loss_and_grads(model, batch)
        hf_ring.revert_chunked_loss(model)
        assert out.logits is None
        assert _rel(out.loss, ref.loss) <= LIGER_RTOL, (family, kind)
        assert max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= LIGER_RTOL, (family, kind)


@liger
def test_liger_backend_tied_embeddings_and_the_cp_contract():
    tied = make_model("llama", tie_word_embeddings=True).to(_device())
    tied.tie_weights()
    batch = {k: v.to(_device()) for k, v in make_batch("plain", 40)[1].items()}
    ref, ref_grads = _loss_and_grads(tied, batch)
    hf_ring.apply_chunked_loss(tied, backend="liger")
    out, grads = _loss_and_grads(tied, batch)
    assert _rel(out.loss, ref.loss) <= LIGER_RTOL
    assert max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= LIGER_RTOL  # the tied head: the embedding
    # shard_batch's contract: shift_labels and a global num_items_in_batch; a shard without targets
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    n = int((shifted != -100).sum())
    cp = tied(input_ids=batch["input_ids"], shift_labels=shifted, labels=batch["labels"], num_items_in_batch=2 * n)
    assert _rel(cp.loss, ref.loss / 2) <= LIGER_RTOL
    empty = tied(input_ids=batch["input_ids"], shift_labels=torch.full_like(shifted, -100), num_items_in_batch=n,
                 labels=batch["labels"])  # fmt: skip
    tied.zero_grad(set_to_none=True)
    empty.loss.backward()
    assert empty.loss.item() == 0.0 and torch.count_nonzero(tied.lm_head.weight.grad) == 0


@liger
def test_liger_backend_refuses_what_it_cannot_compute(monkeypatch):
    from peft import LoraConfig, get_peft_model

    batch, _ = make_batch("plain", 40)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"])
    peft = hf_ring.apply_chunked_loss(get_peft_model(make_model("llama"), lora), backend="liger")
    ran = []  # (refused before the model runs: under the ring, before any rank enters a collective)
    peft.base_model.model.model.register_forward_pre_hook(lambda *a: ran.append(1))
    with pytest.raises(ValueError, match="lm_head is a Linear, not a plain nn.Linear .LoRA on the lm_head"):
        peft(**batch)
    assert not ran
    if in_transformers("dory"):  # its head is an nn.Linear that scales its output: Liger would drop the scale
        dory = hf_ring.apply_chunked_loss(make_model("dory"), backend="liger")
        with pytest.raises(ValueError, match="lm_head is a DoryLMHead, not a plain nn.Linear"):
            dory(**batch)
    if in_transformers("chameleon"):  # its head masks its image codes' logits, which Liger's kernel cannot
        with pytest.raises(ValueError, match=r"chameleon: its head masks the logits of some token ids"):
            hf_ring.apply_chunked_loss(make_model("chameleon"), backend="liger")
    with pytest.raises(ValueError, match="unknown loss backend 'fused'"):
        hf_ring.apply_chunked_loss(make_model("llama"), backend="fused")
    model = hf_ring.apply_chunked_loss(make_model("llama"), backend="liger")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="Liger-Kernel's kernels run on CUDA .got cpu tensors"):
            model(**batch)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match=r"Liger-Kernel is not installed \(pip install 'hf-ring\[liger\]'\)"):
        model(**{k: v.to(_device()) for k, v in batch.items()})


# ---- the context-parallel contract: shard_batch's shift_labels and num_items_in_batch, 2 ranks ----------


def _cp_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    res = {}
    # (the pure Mamba models' mixers see the padding through the model's lent keywords, with the chunked loss calling
    # their backbone itself; random biases, so that padding a mixer missed would show)
    # (and the MoE router's load-balancing loss of the whole sequence, weighed 1.0: a causal LM, and a vision-language
    # wrapper with images)
    router = {"config": {"output_router_logits": True, "router_aux_loss_coef": 1.0}}
    cases = [("llama", "packed", {}), ("gemma2", "plain", {}), ("mamba", "padded", {"random_biases": True})]
    cases += [("mamba2", "padded", {"random_biases": True}), ("mixtral", "padded", router)]
    if in_transformers("qwen3_vl_moe") and transformers_at_least("5.24"):  # (5.17's adds no router loss by config)
        cases.append(("qwen3_vl_moe", "images-padded", router))
    if in_transformers("chameleon"):  # images merged by its text model, its head's masked logits (image codes)
        cases.append(("chameleon", "images-padded", {}))
    for family, kind, opts in cases:
        images = kind.startswith("images")
        batch, ref_batch = make_batch(kind, 40, family=family if images else None)
        model = prepare(family, opts, images=images)
        ref, ref_grads = _loss_and_grads(model, ref_batch)
        hf_ring.apply_ring_attention(model)
        hf_ring.apply_chunked_loss(model, chunk_size=CHUNK)
        local = hf_ring.shard_batch(batch)
        out, grads = _loss_and_grads(model, local)
        for g in grads.values():
            dist.all_reduce(g)
        res[family] = {
            "logits_none": out.logits is None,
            "loss": _rel(hf_ring.reduce_loss(out.loss), ref.loss),
            "grad": max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
        }
    return res


def test_context_parallel_shares_sum_to_the_unsharded_loss_and_gradients():
    for res in run_distributed(_cp_worker, 2, timeout=180):
        for family, r in res.items():
            assert r["logits_none"], family
            assert r["loss"] <= RTOL and r["grad"] <= RTOL, (family, r)


@pytest.mark.slow  # compiling the model on CPU takes about a minute
def test_torch_compile_gives_the_same_loss_and_gradients():
    model = make_model("llama")
    batch, _ = make_batch("plain", 40)
    ref, ref_grads = _loss_and_grads(model, batch)
    hf_ring.apply_chunked_loss(model, chunk_size=16)
    model.zero_grad(set_to_none=True)
    out = torch.compile(model)(**batch)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert out.logits is None and _rel(out.loss, ref.loss) <= RTOL
    assert max(_rel(grads[n], ref_grads[n]) for n in ref_grads) <= RTOL
