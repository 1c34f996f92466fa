"""``apply_chunked_loss``: the causal-LM loss without ever holding the ``[tokens, vocab]`` logits.

At long context the logits dominate a step's memory: fp32 logits are ``4 x vocab`` bytes per token
(512 KB for a 128K vocabulary), and their gradient as much again. With labels, a model switched by
``apply_chunked_loss`` computes the lm_head projection, the family's logit transform (final logit
softcapping, logit scales) and the cross-entropy chunk by chunk of tokens: a chunk's logits are freed
after the forward and recomputed, one chunk at a time, in the backward. A plain ``nn.Linear`` head
runs as one autograd function over the chunks (``_LinearChunks``: the weight's gradient summed in
fp32); any other head is called as a module, each chunk under activation checkpointing. Only tokens
with a target are projected at all (prompt and padding tokens of a supervised batch cost nothing).

The loss is the one the unmodified model computes (Transformers' ``ForCausalLMLoss``): fp32
cross-entropy over ``shift_labels`` (or ``labels`` shifted by one), summed and divided by
``num_items_in_batch`` when given, averaged over the targets otherwise; ``ignore_index`` -100. So the
context-parallel loss contract of ``shard_batch`` holds unchanged. The output has ``logits=None``;
without labels the model's own forward runs (logits as before).

Works with any lm_head module (tied embeddings, LoRA on the head; Llama 4's vision-language wrapper, whose head
belongs to the causal LM inside it: the wrapper's forward runs with that head set aside; a head of two modules, the
``lm_head`` then the output embeddings, as ModernBERT decoder's), gradient checkpointing,
``torch.compile`` and PEFT models. ``backend="liger"`` hands the projection and the loss to Liger-Kernel's
fused linear cross-entropy instead (optional, ``pip install 'hf-ring[liger]'``; CUDA; the lm_head must be a
plain ``nn.Linear``, not sharded on its own; the logit scale is folded into the hidden states and the final
softcap passed to the kernel). With ``output_router_logits`` the MoE router's load-balancing loss is added as the
family adds it (the whole sequence's under the ring: ``patches._router``). Refused with a clear error: a family
hf_ring does not know (its logit transform would be unknown), a custom ``loss_type``, ``logits_to_keep`` with
labels.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "CHUNK_BYTES", "LOSS_BACKENDS", "apply_chunked_loss", "check_chunk_size", "check_loss_backend",
    "chunked_causal_lm_loss", "default_chunk_size", "is_chunked", "liger_unavailable", "revert_chunked_loss",
]  # fmt: skip

CHUNK_BYTES = 256 * 2**20
"""The default chunk keeps one chunk's fp32 logits within this many bytes (256 MiB)."""

LOSS_BACKENDS = ("torch", "liger")

_ATTR = "hf_ring_chunked_loss"
"""Attribute of a switched model: ``(chunk size or None for the default, backend)``."""


def check_chunk_size(value, name: str = "chunk_size") -> None:
    """ValueError unless ``value`` is None or a positive int (tokens per chunk)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int (tokens per chunk) or None, got {value!r}")


def check_loss_backend(value, name: str = "backend") -> None:
    """ValueError unless ``value`` names a loss backend."""
    if value not in LOSS_BACKENDS:
        raise ValueError(
            f"unknown loss backend {value!r} ({name}); choose one of {', '.join(map(repr, LOSS_BACKENDS))}"
        )


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so that a chunk's fp32 logits stay within ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // (4 * int(vocab_size)))


def _chunk_loss(hidden, head, transform, targets, ignore_index):
    """Summed fp32 cross-entropy of one chunk (its logits exist only inside this call)."""
    return _summed_ce(head(hidden), transform, targets, ignore_index)


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    *,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch=None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    masked_tokens=None,
    chunk_size: int | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Transformers' causal-LM loss of ``head(hidden)``, computed chunk by chunk of tokens.

    Args:
        hidden: [batch, seq, hidden] final hidden states.
        head: the lm_head module (any module mapping hidden states to logits; ``"liger"``: an ``nn.Linear``).
        labels: [batch, seq] token ids, shifted here by one (the last position has no target), or
        shift_labels: [batch, seq] targets already aligned with the positions (``shard_batch``'s).
        num_items_in_batch: divide the summed loss by it (the Trainer's / shard_batch's global count);
            None: the mean over this call's targets.
        logit_scale, logit_softcap: what the family does to the logits before the loss: multiply by
            ``logit_scale``, then ``cap * tanh(logits / cap)`` with ``cap = logit_softcap`` when set.
        masked_tokens: token ids whose logits the family sets to the dtype's lowest value, last (Chameleon's head,
            for its image codes); ``"torch"`` only.
        chunk_size: tokens per chunk (default: ``default_chunk_size`` of the head's output width; ``"torch"`` only,
            Liger sizes its own chunks).
        backend: ``"torch"`` (checkpointed chunks, any device) or ``"liger"`` (Liger-Kernel's fused linear
            cross-entropy; CUDA, or Triton's interpreter).
    """
    check_loss_backend(backend)
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if targets.shape[0] != flat.shape[0]:
        raise ValueError(
            f"labels cover {targets.shape[0]} positions but the hidden states {flat.shape[0]}; pass labels of the "
            "input's [batch, seq] shape"
        )
    keep = (targets != ignore_index).nonzero().squeeze(1)  # only positions with a target are projected
    flat, targets = flat.index_select(0, keep), targets.index_select(0, keep)
    masked = None if masked_tokens is None or not len(masked_tokens) else torch.as_tensor(masked_tokens)
    if backend == "liger" and masked is not None:
        raise ValueError(
            "backend='liger' cannot mask the logits of some token ids as this model's head does; use backend='torch'"
        )
    if backend == "liger" and flat.shape[0]:  # (no target: the empty chunk below gives the head its zero gradient)
        total = _liger_sum(flat, head, targets, logit_scale, logit_softcap)
    else:
        plain = (logit_scale, logit_softcap, masked) == (1.0, None, None)
        transform = None if plain else _Transform(logit_scale, logit_softcap, masked)
        total = _chunked_sum(flat, head, targets, ignore_index, transform, chunk_size)
    if num_items_in_batch is None:
        return total / keep.numel()  # the mean over targets (NaN without any, as Transformers)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunked_sum(flat, head, targets, ignore_index, transform, chunk_size):
    """Summed fp32 cross-entropy of ``head(flat)``, one chunk of tokens at a time, each recomputed in the backward."""
    if chunk_size is None:
        chunk_size = default_chunk_size(_vocab_width(head))
    # (recomputed whenever a gradient flows: into the hidden states, or into the head alone, frozen base model and
    # a trained lm_head, whose chunks would otherwise each keep their fp32 log-softmax for the backward)
    recompute = torch.is_grad_enabled() and (flat.requires_grad or any(p.requires_grad for p in head.parameters()))
    if recompute and _plain_linear(head, flat):
        return _LinearChunks.apply(flat, head.weight, head.bias, targets, transform, ignore_index, chunk_size)
    if recompute and isinstance(head, _Unpadded) and _plain_linear(head.head, flat):  # the rows it keeps, as a view
        kept, bias = head.kept, head.head.bias
        weight, bias = head.head.weight[:kept], None if bias is None else bias[:kept]
        return _LinearChunks.apply(flat, weight, bias, targets, transform, ignore_index, chunk_size)
    # no target here (a shard of prompt or padding): one empty chunk, so the head still takes part and its
    # gradient is a zero tensor as with the full logits (DDP and FSDP2 expect one on every rank)
    starts = range(0, flat.shape[0], chunk_size) if flat.shape[0] else [0]
    total = 0
    for a in starts:
        args = (flat[a : a + chunk_size], head, transform, targets[a : a + chunk_size], ignore_index)
        total = total + (checkpoint(_chunk_loss, *args, use_reentrant=False) if recompute else _chunk_loss(*args))
    return total


def _plain_linear(head, flat) -> bool:
    """``head`` is an ``nn.Linear`` whose weight can be read outside its call: no hooks (FSDP2 around the head alone,
    DeepSpeed ZeRO-3), no forward replaced on the instance (Accelerate's device hooks), a plain tensor (not a DTensor,
    not a ZeRO-3 partition), no autocast (its backward would run without it). Other heads (LoRA on the head,
    ModernBERT decoder's two modules) are called as modules, chunk by chunk under checkpointing."""
    from torch.nn.modules import module as nn_module

    hooks = (head._forward_hooks, head._forward_pre_hooks, head._backward_hooks, head._backward_pre_hooks)
    global_hooks = (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
                    nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)  # fmt: skip
    return (
        type(head) is torch.nn.Linear and "forward" not in vars(head)
        and not any(hooks) and not any(global_hooks)
        and all(p is None or (type(p) in (torch.Tensor, torch.nn.Parameter) and not hasattr(p, "ds_id"))
                for p in (head.weight, head.bias))
        and not torch.is_autocast_enabled(flat.device.type)
    )  # fmt: skip


class _LinearChunks(torch.autograd.Function):
    """Summed fp32 cross-entropy of ``flat @ weight.T + bias`` (then ``transform``), chunk by chunk of tokens.

    The forward keeps no logits; the backward recomputes each chunk's, takes the gradient of its loss, and writes
    the hidden states' gradient in place (no full-size gradient per chunk to sum) while the weight's and the bias's
    are summed over the chunks in fp32 (float64 for float64 weights) and rounded to their dtype at the end. A bf16
    weight's chunk products are each rounded to bf16 before the sum (one rounding per chunk's product, none of the
    running sum: autograd's own sum in bf16 rounds the running sum at every chunk, an error that grows with the
    chunk count). Not twice differentiable (``create_graph=True`` raises)."""

    @staticmethod
    def forward(ctx, flat, weight, bias, targets, transform, ignore_index, chunk_size):
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for a in range(0, flat.shape[0], chunk_size):
            logits = torch.nn.functional.linear(flat[a : a + chunk_size], weight, bias)
            total += _summed_ce(logits, transform, targets[a : a + chunk_size], ignore_index)
        ctx.save_for_backward(flat, weight, bias, targets)
        ctx.rule = (transform, ignore_index, chunk_size)
        return total

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # (a backward with create_graph=True)
            raise RuntimeError(
                "hf_ring's chunked loss is not twice differentiable (backward with create_graph=True); "
                "revert_chunked_loss(model) for a gradient of its gradient"
            )
        flat, weight, bias, targets = ctx.saved_tensors
        transform, ignore_index, chunk_size = ctx.rule
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)
        wide = {"dtype": acc, "device": flat.device}
        dx = torch.empty_like(flat) if need_x else None
        dw = torch.zeros(weight.shape, **wide) if need_w else None
        db = torch.zeros(bias.shape, **wide) if need_b else None
        for a in range(0, flat.shape[0], chunk_size):
            x = flat[a : a + chunk_size]
            logits = torch.nn.functional.linear(x, weight, bias).requires_grad_()
            # (a graph of this chunk only, its tensors kept as they are: hooks of the caller's, activation offload
            # say, are for the forward's tensors)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                loss = _summed_ce(logits, transform, targets[a : a + chunk_size], ignore_index)
            (dlogits,) = torch.autograd.grad(loss, logits, grad)
            if need_x:
                dx[a : a + chunk_size] = dlogits @ weight
            if need_w and weight.dtype == acc:
                dw.addmm_(dlogits.t(), x)
            elif need_w:  # (the chunk's product in the weight's dtype, then summed in fp32)
                dw += dlogits.t() @ x
            if need_b:
                db += dlogits.sum(0, dtype=acc)
        return (
            dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
            None, None, None, None,
        )  # fmt: skip


def _same(t):
    return t


def _summed_ce(logits, transform, targets, ignore_index):
    """Summed fp32 cross-entropy of ``transform(logits)``."""
    if transform is not None:
        logits = transform(logits)
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def _vocab_width(head) -> int:
    """The logits per token ``head`` gives: its last module's ``out_features`` or weight rows (1: neither, a head of
    another kind; its chunk is then as long as it can be)."""
    last = head[-1] if isinstance(head, torch.nn.Sequential) else head
    return getattr(last, "out_features", None) or getattr(getattr(last, "weight", None), "shape", [1])[0]


class _Transform:
    """The logit transform: ``logits * scale``, then ``cap * tanh(logits / cap)`` when ``cap`` is set, then the
    ``masked`` ids' logits at the dtype's lowest value."""

    def __init__(self, scale: float, cap: float | None, masked: torch.Tensor | None = None):
        self.scale, self.cap, self.masked = scale, cap, masked

    def __call__(self, logits):
        logits = logits * self.scale if self.scale != 1.0 else logits
        logits = logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap
        if self.masked is None:
            return logits
        if self.masked.device != logits.device:  # (once: every chunk, forward and backward, reuses it)
            self.masked = self.masked.to(logits.device)
        return logits.index_fill(-1, self.masked, torch.finfo(logits.dtype).min)


def liger_unavailable(device: torch.device) -> str | None:
    """Why Liger-Kernel's fused linear cross-entropy cannot run on ``device`` here, or None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "Liger-Kernel is not installed (pip install 'hf-ring[liger]')"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Liger-Kernel's kernels run on CUDA (got {device.type} tensors)"
    return None


def check_liger_head(head, device: torch.device) -> None:
    """ValueError unless Liger's fused linear cross-entropy can project with ``head`` on ``device``: the same on every
    rank (the model's head, the device's kind), so the chunked forward asks before the model runs (before any
    collective of the ring), and every rank raises."""
    from torch.distributed.tensor import DTensor

    reason = liger_unavailable(device)
    weight = getattr(head, "weight", None)
    if reason is None and (hasattr(weight, "ds_id") or isinstance(weight, DTensor)):
        reason = "the lm_head weight is sharded (DeepSpeed ZeRO-3 or FSDP2 around the lm_head alone)"
    if reason is None and type(head) is not torch.nn.Linear:  # (a subclass may scale its output: Dory's head)
        reason = (
            f"the lm_head is a {type(head).__name__}, not a plain nn.Linear (LoRA on the lm_head, or a head with a "
            "forward of its own?): Liger's kernel takes its weight directly"
        )
    if reason is not None:
        raise ValueError(f"loss backend 'liger' cannot run: {reason}; use the default backend ('torch')")


def _liger_sum(flat, head, targets, scale: float, cap: float | None):
    """Summed cross-entropy of ``head(flat) * scale`` (softcapped by ``cap``) by Liger's fused linear cross-entropy."""
    check_liger_head(head, flat.device)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    weight = head.weight
    if scale != 1.0:
        flat = flat * scale  # (h * s) W^T = s (h W^T): the logit scale folded into the input
    # the weight's gradient summed over Liger's chunks in fp32 (its releases that take accum_dtype)
    wide = {"accum_dtype": torch.float32} if "accum_dtype" in _parameters(liger_fused_linear_cross_entropy) else {}
    return liger_fused_linear_cross_entropy(flat, weight, targets, bias=head.bias, reduction="sum", softcap=cap, **wide)


@functools.cache
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _patch_of(target):
    from .patches import get_patch

    return get_patch(getattr(target.config, "model_type", None))


def _extra_loss_labels(target) -> str | None:
    """The keyword of the labels of a loss the model's head adds to the language-model loss (Granite Docling's
    ``router_labels``: ``patches.multimodal.EXTRA_LOSS``), or None."""
    from .patches.multimodal import EXTRA_LOSS

    return EXTRA_LOSS.get(getattr(target.config, "model_type", None))


def _is_causal_lm_loss(loss_type: str) -> bool:
    """Transformers computes ``loss_type`` with its causal-LM loss (``ForConditionalGeneration``: vision-language
    models)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    fn = LOSS_MAPPING.get(loss_type)
    return fn is not None and fn is LOSS_MAPPING.get("ForCausalLM")


def _check(target) -> None:
    """ValueError (before anything is changed) for what the chunked loss cannot reproduce exactly."""
    _patch_of(target)  # ValueError naming the supported model types
    loss_type = getattr(target, "loss_type", None) or getattr(target.config, "loss_type", None)
    if loss_type not in (None, "ForCausalLM") and not _is_causal_lm_loss(loss_type):
        raise ValueError(
            f"{type(target).__name__} uses loss_type={loss_type!r}; hf_ring's chunked loss computes the causal-LM "
            "cross-entropy (ForCausalLM) only"
        )
    if _inner_causal_lm(target) is not None:
        return
    for name, module in (("lm_head", _lm_head(target)), ("base model", _base(target))):
        if not isinstance(module, torch.nn.Module):
            raise ValueError(
                f"{type(target).__name__} has no {name} module: hf_ring's chunked loss applies to causal-LM "
                "models (XForCausalLM) with a base model and an lm_head"
            )


def _head(target) -> torch.nn.Module:
    """The module mapping the base model's last hidden states to the logits: the ``lm_head``, or, where the family's
    head is two modules, both in turn (ModernBERT decoder: its prediction head ``lm_head``, then its output embeddings
    ``decoder``, the projection to the vocabulary)."""
    head, out = _lm_head(target), target.get_output_embeddings()
    if isinstance(out, torch.nn.Module) and all(out is not m for m in head.modules()):
        head = torch.nn.Sequential(head, out)
    kept = getattr(target.config.get_text_config(), "unpadded_vocab_size", None)
    if kept is not None and kept < getattr(target.config.get_text_config(), "vocab_size", kept):
        return _Unpadded(head, kept)
    return head


def _lm_head(target):
    """The causal LM's ``lm_head``, else its output embeddings (BioGPT's ``output_projection``), else None."""
    head = getattr(target, "lm_head", None)
    return head if isinstance(head, torch.nn.Module) else target.get_output_embeddings()


class _Unpadded(torch.nn.Module):
    """A head whose logits beyond ``kept`` are dropped, as the family's own head does (Inkling's padded vocabulary:
    ``config.unpadded_vocab_size``)."""

    def __init__(self, head: torch.nn.Module, kept: int):
        super().__init__()
        self.head, self.kept = head, kept
        self.out_features = kept  # (the logits per token: ``_vocab_width``)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)[..., : self.kept]


def _inner_causal_lm(target):
    """The module whose ``lm_head`` the chunked loss sets aside to run the wrapper's own forward, else None: the
    causal LM inside a vision-language wrapper that has no ``lm_head`` of its own (Llama 4: the wrapper takes the
    logits of its ``language_model``, a ``Llama4ForCausalLM``), or the wrapper itself where its base model is its text
    model (Transformers 5.17's Qwen2.5-Omni and Qwen3-Omni thinkers merge images and audio and number positions in
    their own forward: their text model alone would run without them)."""
    inner = getattr(target, "language_model", None)
    if getattr(target, "lm_head", None) is None and isinstance(getattr(inner, "lm_head", None), torch.nn.Module):
        return inner
    text = target.config.get_text_config()
    own = text is not target.config and getattr(_base(target), "config", None) is text
    return target if own and isinstance(getattr(target, "lm_head", None), torch.nn.Module) else None


class _HeadAside:
    """While inside, the causal LM's ``lm_head`` is an identity: the wrapper's forward then returns the last hidden
    states where its logits would be, and the chunked loss projects them with the real head."""

    def __init__(self, causal_lm):
        self.causal_lm = causal_lm
        self.head = causal_lm.lm_head

    def __enter__(self):
        if isinstance(self.head, torch.nn.Identity):
            raise RuntimeError(
                f"{type(self.causal_lm).__name__}.lm_head is already set aside by hf_ring's chunked loss (a call "
                "nested in another, or from another thread): one forward at a time"
            )
        self.causal_lm.lm_head = torch.nn.Identity()
        return self.head

    def __exit__(self, *exc):
        self.causal_lm.lm_head = self.head


def _base(target):
    """The causal-LM's base model: its ``base_model_prefix`` module, else ``model`` (Llama 4's causal LM keeps its
    text model there under the prefix ``language_model``)."""
    module = getattr(target, target.base_model_prefix, None)
    return module if isinstance(module, torch.nn.Module) else getattr(target, "model", None)


def _cache(past_key_values) -> dict:
    """``past_key_values`` as a keyword only when given: Transformers 5.24 names it ``cache`` and warns at the old
    name even for None (a cache given by its new name arrives in the keywords and passes on as it came)."""
    return {} if past_key_values is None else {"past_key_values": past_key_values}


def _chunked_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """The causal-LM forward with the chunked loss when labels are given (installed per instance)."""
    if labels is None:
        return type(self).forward(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, **_cache(past_key_values),
            logits_to_keep=logits_to_keep, **kwargs,
        )  # fmt: skip
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("logits_to_keep cannot be combined with labels under hf_ring's chunked loss")
    extra = _extra_loss_labels(self)
    if extra is not None and kwargs.get(extra) is not None:
        raise ValueError(
            f"{extra} add {self.config.model_type}'s own loss beside the language-model loss, which hf_ring's chunked "
            f"loss does not compute; revert_chunked_loss(model) (chunked_loss=False for the plugin and the Trainer) "
            f"to train it, or leave {extra} out"
        )
    return_dict = kwargs.pop("return_dict", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    inner = _inner_causal_lm(self)
    chunk_size, backend = getattr(self, _ATTR)
    if backend == "liger":  # (before the model runs: a refusal then reaches every rank before the ring's collectives)
        given = input_ids if input_ids is not None else inputs_embeds
        device = given.device if isinstance(given, torch.Tensor) else next(self.parameters()).device
        check_liger_head(_head(self) if inner is None else inner.lm_head, device)
    if inner is None:
        outputs = _base(self)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=use_cache, **_cache(past_key_values), **kwargs,
        )  # fmt: skip
        hidden, head = outputs.last_hidden_state, _head(self)
    else:  # the wrapper's own forward without labels, its causal LM's head set aside: hidden states for logits
        with _HeadAside(inner) as head:
            outputs = type(self).forward(
                self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True, **_cache(past_key_values),
                **kwargs,
            )  # fmt: skip
        hidden = outputs.logits
    patch = _patch_of(self)
    transform = patch.logit_transform
    if patch.loss_skips_padding and shift_labels is None and isinstance(attention_mask, torch.Tensor):
        # as the family's own loss: targets that are padding are not scored
        labels = labels.masked_fill(attention_mask[:, -labels.shape[1] :].to(labels.device) == 0, ignore_index)
    loss = chunked_causal_lm_loss(
        hidden,
        head,
        labels=labels,
        shift_labels=shift_labels,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        ignore_index=ignore_index,
        logit_scale=1.0 if transform is None else transform.scale(self.config.get_text_config()),
        logit_softcap=None if transform is None else transform.cap(self.config.get_text_config()),
        masked_tokens=None if transform is None else transform.masked_ids(self),
        chunk_size=chunk_size,
        backend=backend,
    )
    aux = None
    requested = kwargs.get("output_router_logits")
    if requested is None and _router_rule(type(self))[1]:
        requested = getattr(self.config.get_text_config(), "output_router_logits", False)
    if requested:
        coef, aux = _router_loss(self, outputs, attention_mask)
        if aux is not None:
            loss = loss + coef * aux.to(loss.device)
    out = _output(loss, outputs, aux)
    return out.to_tuple() if return_dict is False else out


def _router_loss(target, outputs, attention_mask) -> tuple:
    """``(weight, the MoE router's load-balancing loss)`` as the family's causal LM adds it to its loss (None: the
    family adds none): the wrapper's own forward computed it (``aux_loss``), or the family's function of the router
    logits (hf_ring's loss of the whole sequence while the model is patched: ``patches._router``)."""
    from .patches import _router

    text = target.config.get_text_config()
    weights = [
        getattr(where, name, None) for where in (target, text) for name in ("router_aux_loss_coef", "aux_loss_coef")
    ]
    coef = next((w for w in weights if w is not None), 0.0)  # (JetMoE names it aux_loss_coef)
    aux = getattr(outputs, "aux_loss", None)
    module = _router._module_of(target)
    if aux is not None or module is None or not _router_rule(type(target))[0]:
        return coef, aux
    experts = getattr(target, "num_experts", None) or getattr(text, "num_experts", None)
    experts = experts or getattr(text, "num_local_experts", None)
    top_k = getattr(target, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
    logits = getattr(outputs, "router_logits", None)
    if logits is None or experts is None or top_k is None:
        raise ValueError(
            f"{target.config.model_type}: output_router_logits=True, but hf_ring's chunked loss found no router "
            "logits or expert counts to compute its load-balancing loss from; revert_chunked_loss(model) "
            "(chunked_loss=False for the plugin and the Trainer)"
        )
    aux = getattr(module, _router.NAME)(logits, experts, top_k, attention_mask)
    if not isinstance(aux, torch.Tensor):  # (the function's 0 for logits that are not a tuple of layers)
        raise ValueError(
            f"{target.config.model_type}: output_router_logits=True, but its router logits are not one tensor per "
            "layer (this Transformers release's own forward fails on them too); set output_router_logits=False"
        )
    return coef, aux


@functools.cache
def _router_rule(cls) -> tuple:
    """``(adds, reads the config)``: ``cls``'s forward adds the router's load-balancing loss, and takes
    ``output_router_logits`` from the config when the call does not give it (Transformers 5.17's JetMoE and
    vision-language MoE wrappers take the call's keyword only; its Qwen3-VL-MoE adds none then)."""
    from .patches import _router

    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # (no source: as the family's module defines the function)
        return True, True
    return _router.NAME in source, re.search(r"config(\.\w+)*\.output_router_logits", source) is not None


class _ChunkedForward:
    """The instance ``forward`` of a switched model: ``_chunked_forward`` bound to it, picklable and
    deep-copyable with the model (a bound method of a module-level function would not unpickle).

    It shows the signature of the model's own forward: the Trainer keeps the dataset columns the forward
    names, and ``generate`` validates its keywords against it."""

    def __init__(self, model):
        self.model = model

    @property
    def __signature__(self) -> inspect.Signature:
        sig = inspect.signature(type(self.model).forward)
        return sig.replace(parameters=list(sig.parameters.values())[1:])  # bound: without self

    def __call__(self, *args, **kwargs):
        return _chunked_forward(self.model, *args, **kwargs)


def _output(loss, outputs, aux=None):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    common = dict(  # (a model without attention, Mamba2, has neither attentions nor past_key_values)
        loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=outputs.hidden_states, attentions=getattr(outputs, "attentions", None),
    )  # fmt: skip
    if hasattr(outputs, "router_logits"):
        return MoeCausalLMOutputWithPast(aux_loss=aux, router_logits=outputs.router_logits, **common)
    return CausalLMOutputWithPast(**common)


def apply_chunked_loss(model, *, chunk_size: int | None = None, backend: str = "torch"):
    """Compute ``model``'s loss chunk by chunk, never holding the ``[tokens, vocab]`` logits (in place).

    Args:
        model: a causal-LM ``PreTrainedModel`` of a family hf_ring supports, or a ``PeftModel`` wrapping one.
        chunk_size: tokens per chunk; None keeps one chunk's fp32 logits within ``CHUNK_BYTES`` (256 MiB).
        backend: ``"torch"`` (default: checkpointed chunks, any device) or ``"liger"`` (Liger-Kernel's fused
            linear cross-entropy, ``pip install 'hf-ring[liger]'``; CUDA, a plain ``nn.Linear`` lm_head, not
            under DeepSpeed ZeRO-3; it sizes its own chunks).

    Returns ``model``. With labels, ``model(**batch).loss`` equals the unmodified model's loss (and its
    gradients), and ``logits`` is None; without labels nothing changes. Calling it again replaces the
    chunk size; ``revert_chunked_loss`` restores the model's own forward.
    """
    from .apply import _transformers_model

    check_chunk_size(chunk_size)
    check_loss_backend(backend)
    target = _transformers_model(model)
    _check(target)
    transform = _patch_of(target).logit_transform
    if backend == "liger" and transform is not None and transform.masked:
        raise ValueError(
            f"{target.config.model_type}: its head masks the logits of some token ids ({transform.masked}), which "
            "backend='liger' cannot do; use backend='torch'"
        )
    own = vars(target).get("forward")
    if own is not None and not isinstance(own, _ChunkedForward):
        raise ValueError(
            f"{type(target).__name__}'s forward was replaced on the instance ({getattr(own, '__qualname__', own)!r}: "
            "Accelerate's autocast wrapper after prepare, a Liger-Kernel or TRL head?), which the chunked loss would "
            "drop: apply_chunked_loss before that (before accelerator.prepare), or leave the loss to it"
        )
    setattr(target, _ATTR, (chunk_size, backend))
    target.forward = _ChunkedForward(target)
    return model


def revert_chunked_loss(model):
    """Restore the forward ``model`` had before ``apply_chunked_loss`` (in place); returns it."""
    from .apply import _transformers_model

    target = _transformers_model(model)
    if not hasattr(target, _ATTR):
        raise ValueError(f"{type(target).__name__} has no chunked loss to revert (apply_chunked_loss was not called)")
    del target.forward
    delattr(target, _ATTR)
    return model


def is_chunked(model) -> bool:
    """True when ``apply_chunked_loss`` switched ``model`` (or the Transformers model inside it)."""
    from .apply import unwrap_transformers_model

    target = unwrap_transformers_model(model)
    return target is not None and hasattr(target, _ATTR)
