"""The batch's keywords lent to modules their callers leave them out of.

hf_ring's attention function and sharded mixers learn the batch's padding, packed documents, shard and KV cache
from the keywords the model passes down (``ring_document_ids``, ``ring_shard_info``, ``ring_cache``, packing
keywords). Some callers drop them: Nemotron's and StableLM's decoder layers call their attention with named
arguments only, Jamba's call their Mamba mixer with the mask alone, the pure Mamba and Falcon-Mamba backbones pass
their blocks the mask only, Mamba2's causal LM calls its backbone without them. A forward pre-hook of the caller
(``LendKeywords``) puts them beside the mask in its ``attention_mask`` argument (``Lent``); the callee unpacks them:
hf_ring's sharded mixers themselves, an attention module or Mamba2's backbone by a pre-hook (``UnpackLent``). The
keywords travel in the calls' arguments, nothing is kept between calls, so a checkpointed layer's recomputation
(with Transformers running module hooks inside the checkpoint or outside) sees them again.

``install`` / ``install_on_model`` set these hooks up (for the attention modules of a family whose decoder layers
drop the keywords, ``FamilyPatch.lend_attention_kwargs``; for the mixers, through ``hf_ring.patches.linear.install``).
Models whose layers are called with none of the batch's keywords (Falcon, GPT-Neo, BLOOM, MPT) hand them over
through their causal mask instead (``HandOver``, set up by ``hand_over``). ``remove`` takes every one of these hooks
down.
"""

from __future__ import annotations

import inspect

import torch

from ..hf_attention import DOCUMENT_IDS_KWARG, POSITIONS_KWARG, SHARD_INFO_KWARG
from ..ring_config import DECODE_KWARG, HANDED_OVER, Lent
from ._hooks import remove_hooks

__all__ = ["HANDED", "HandOver", "LENT", "LendKeywords", "Lent", "UnpackLent", "hand_over", "install", "install_on_model",
           "remove"]  # fmt: skip


LENT = (DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG, POSITIONS_KWARG, "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
        "seq_idx")  # fmt: skip
"""The keywords a mixer reads (documents, padding, packing, the shard, positions for a batch sharded by hand)."""


class LendKeywords:
    """Forward pre-hook (with keywords) of a module that calls the modules below it with the mask but without the
    batch's keywords: ``keys``, or with ``keys=None`` every keyword its forward does not name (those it drops).
    ``entry``: the mask argument is a mapping of masks (ZAYA's attention), and the callee gets its ``entry``."""

    def __init__(
        self, module: torch.nn.Module, keys: tuple | None = LENT, into: str = "attention_mask", entry: str | None = None
    ):
        names = [p.name for p in inspect.signature(type(module).forward).parameters.values()][1:]
        self.position = names.index(into) if into in names else -1
        self.keys, self.named, self.into, self.entry = keys, frozenset(names), into, entry

    def __call__(self, module, args, kwargs):
        mask = kwargs.get(self.into)
        if self.entry is not None:
            if not isinstance(mask, dict) or isinstance(mask.get(self.entry), Lent):
                return None
        elif isinstance(mask, Lent) or self.position < 0 or len(args) > self.position:
            return None  # (a mask given by position: nothing lent, and the callee refuses a batch it cannot see)
        if self.keys is None:
            lent = {k: v for k, v in kwargs.items() if k not in self.named}
        else:
            lent = {k: kwargs[k] for k in self.keys if k in kwargs}  # (shard_batch's document ids, None too)
        if self.entry is not None:
            return args, {**kwargs, self.into: {**mask, self.entry: Lent(mask.get(self.entry), lent)}}
        return args, {**kwargs, self.into: Lent(mask, lent)}


class UnpackLent:
    """Forward pre-hook (with keywords) of a module whose caller lends it the batch's keywords (``LendKeywords``) and
    which passes its own keywords on (an attention module to the attention function; Mamba2's backbone to its
    blocks): the mask and the keywords unpacked into its call, before it reads the mask."""

    def __call__(self, module, args, kwargs):
        lent = kwargs.get("attention_mask")
        if not isinstance(lent, Lent):
            return None
        return args, {**lent.kwargs, **kwargs, "attention_mask": lent.mask}


HANDED = (DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG, POSITIONS_KWARG, DECODE_KWARG, "cu_seq_lens_q", "cu_seq_lens_k",
          "seq_idx", "output_attentions")  # fmt: skip
"""The keywords a model whose layers are called without any hands over through its mask (``HandOver``): documents,
padding, packing, the shard, positions, ring_generate's cache; ``output_attentions``, which the attention function
refuses (MPT's blocks do not pass it on: its attention weights would be None without a word). (``position_ids`` reach
those layers by name.)"""


class HandOver:
    """Hooks of each ``PreTrainedModel`` of a model whose decoder layers are called with hidden states, mask, cache and
    positions only (Falcon, GPT-Neo, BLOOM, MPT; Falcon's causal LM does not even pass its keywords to its base
    model). The forward pre-hook pushes an entry on ``HANDED_OVER.stack``: the model, its config, and the ``HANDED``
    keywords of its call beside those of the model around it (``parent``, whose forward calls this one; None for the
    outermost); the forward hook (run even when the forward raises) pops it. While the model builds its causal mask,
    ``hf_attention.ring_mask_function`` finds the entry of that config and returns the mask with its keywords
    (``Lent``): the mask is passed to every layer, and from there to the attention (``patches._own`` unpacks it).

    A model called with its parent's entry not on top (the outermost one, or a base model called on its own: a value
    head) starts the stack anew, so what a forward interrupted by a ``BaseException`` left there (Torch runs the
    closing hooks on ``Exception`` only) is dropped, never inherited; another model called inside builds its mask
    without them (another config). The keywords travel in the mask argument, so a checkpointed layer's recomputation
    sees them again."""

    def __init__(self, parent: torch.nn.Module | None):
        self.parent = parent

    def before(self, module, args, kwargs) -> None:
        stack = HANDED_OVER.__dict__.setdefault("stack", [])
        if self.parent is None or not stack or stack[-1][0] is not self.parent:
            stack.clear()
        around = stack[-1][2] if stack else {}
        given = {k: kwargs[k] for k in HANDED if k in kwargs and (k != "output_attentions" or kwargs[k])}
        stack.append((module, getattr(module, "config", None), {**around, **given}))

    def after(self, module, args, output) -> None:
        stack = getattr(HANDED_OVER, "stack", None) or []
        for i in range(len(stack) - 1, -1, -1):  # (its entry and any an interrupted inner call left above it)
            if stack[i][0] is module:
                del stack[i:]
                break


def hand_over(model: torch.nn.Module) -> None:
    """Install ``HandOver`` on ``model`` and every ``PreTrainedModel`` inside it (``remove`` takes them down)."""
    from transformers import PreTrainedModel

    def walk(module, parent):
        if isinstance(module, PreTrainedModel):
            hook = HandOver(parent)
            module.register_forward_pre_hook(hook.before, with_kwargs=True)
            module.register_forward_hook(hook.after, always_call=True)
            parent = module
        for child in module.children():
            walk(child, parent)

    walk(model, None)


def install(
    model: torch.nn.Module,
    modules: list,
    keys: tuple | None = None,
    unpack: bool = True,
    into: str = "attention_mask",
    entry: str | None = None,
) -> None:
    """Make the module holding each of ``modules`` (its decoder layer) lend it ``keys`` of its own call (None: every
    keyword its forward does not name) in its argument ``into`` (``entry``: in that entry of the mapping it is);
    with ``unpack``, each of ``modules`` unpacks them by a pre-hook (an attention module; hf_ring's sharded mixers
    unpack them themselves)."""
    parents = {id(c): p for p in model.modules() for c in p.children()}
    lending = set()  # (one hook per module, however many of ``modules`` it holds: Inkling's layers hold two)
    for m in modules:
        layer = parents[id(m)]
        if id(layer) not in lending:
            lending.add(id(layer))
            layer.register_forward_pre_hook(LendKeywords(layer, keys, into, entry), with_kwargs=True)
        if unpack:
            m.register_forward_pre_hook(UnpackLent(), with_kwargs=True)


def install_on_model(model: torch.nn.Module, keys: tuple, unpack_in_base: bool) -> None:
    """Make ``model`` lend ``keys`` of its own call to the modules below it (the pure Mamba models' mixers, through a
    backbone that passes them the mask alone); with ``unpack_in_base``, its base model unpacks them into its own
    call and passes them on (Mamba2's backbone, called without them by its causal LM)."""
    model.register_forward_pre_hook(LendKeywords(model, keys), with_kwargs=True)
    if unpack_in_base:
        model.base_model.register_forward_pre_hook(UnpackLent(), with_kwargs=True)


def remove(model: torch.nn.Module) -> None:
    """Remove every hook ``install``, ``install_on_model`` and ``hand_over`` added (found by their class, so a deep
    copy's are found too)."""
    for m in model.modules():
        remove_hooks(m, (LendKeywords, UnpackLent, HandOver))
