"""DeepSeek sparse attention's indexers, deferred to hf_ring's attention function while the model is patched.

A DSA attention module (DeepSeek-V3.2, GLM-MoE-DSA, A.X K2, HunYuan V4 and V4 VL, Mistral Large 4, Dots3 Note, GLM-5.3-Flash) calls its indexer on its own tokens, with
its 4-D mask cut to ``[:, 0, :, :]``, and passes the top-k positions to the attention function as ``indices``
(``ring_attention`` takes no dense mask: Transformers leaves the selection to attention implementations other
than eager and SDPA). Under the ring the top-k must range over the keys of every rank, which only the attention
function can gather (it knows the group, the layout and the batch's documents). So, while the model is patched:

- each indexer's ``forward`` (an instance attribute; ``remove`` deletes it) records its call and returns it
  (``hf_ring.sparse.IndexerCall``), which ``hf_ring.sparse.select`` resolves inside the attention function;
- each DSA attention module wraps its mask by a forward pre-hook (``WrapMask``) in a ``SparseMask``, which it can
  index as its 4-D mask (Qwen4-Exp combines it with its indexer's output, ``mask & selection``: the wrapper then
  carries the call); the attention function unwraps it;
- a module that turns its top-k into a dense mask itself (GLM-5.3-Flash's ``build_attention_mask_from_topk``, its
  mask the 2-D padding mask) is given, as an instance attribute, ``CarryCall`` in its place: the ``SparseMask`` it
  returns carries the call, which keeps the padding mask its indexer was given (the attention function reads it
  there).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from ..sparse import IndexerCall, MaskCall, SparseMask, selects_by_mask
from ._hooks import remove_forward, remove_hooks

__all__ = ["CarryCall", "DeferIndexer", "DeferMaskIndexer", "WrapMask", "install", "remove"]

MASK_BUILDER = "build_attention_mask_from_topk"
"""The method of a DSA attention module that makes a dense mask of its indexer's top-k (GLM-5.3-Flash)."""


class DeferIndexer:
    """An indexer's ``forward`` while patched: its call, for the attention function to resolve (``IndexerCall``)."""

    def __init__(self, module: torch.nn.Module):
        params = list(inspect.signature(type(module).forward).parameters)[1:]
        self.module = module
        self.names = params
        self.cache_name = "cache" if "cache" in params else "past_key_values"

    def __call__(self, *args, **kwargs) -> IndexerCall:
        given = {**dict(zip(self.names, args)), **kwargs}
        cache = given.get("cache", given.get("past_key_values"))
        return IndexerCall(
            module=self.module,
            hidden_states=given["hidden_states"],
            q_resid=given.get("q_resid"),  # (Mistral Large 4's indexer takes none)
            position_embeddings=given.get("position_embeddings"),  # (GLM-5.3-Flash's layers have no RoPE)
            position_ids=given.get("position_ids"),
            cache_name=self.cache_name,
            cache=cache,
            mask=given.get("attention_mask"),
        )


class DeferMaskIndexer(DeferIndexer):
    """The ``forward`` of an indexer that returns a mask (Kolibri 1.1's, ``hf_ring.sparse.selects_by_mask``) while
    patched: its mask is the ``SparseMask`` the module was given, carrying the deferred call (``MaskCall``), which the
    module hands to the attention function as its mask; its pool is the call of the indexer whose pool this layer picks
    from (this call for a pool source), which the model passes on to the layers after it."""

    def __call__(self, *args, **kwargs) -> tuple[SparseMask, MaskCall]:
        given = {**dict(zip(self.names, args)), **kwargs}
        mask, pool = given["attention_mask"], given.get("index_pool")
        if not isinstance(mask, SparseMask):
            raise TypeError(f"{type(self.module).__name__}: expected the mask hf_ring wraps, got {type(mask).__name__}")
        if pool is not None and not isinstance(pool, MaskCall):
            raise TypeError(
                f"{type(self.module).__name__}: expected hf_ring's deferred pool, got {type(pool).__name__}"
            )
        call = MaskCall(
            module=self.module,
            hidden_states=None,
            q_resid=None,
            position_embeddings=None,
            position_ids=None,
            queries=given["query_states"],
            keys=given["key_states"],
            pool=pool,
        )
        return dataclasses.replace(mask, call=call), call if self.module.is_pool_source else pool


class CarryCall:
    """``build_attention_mask_from_topk`` while patched: a ``SparseMask`` carrying the deferred call (which keeps the
    padding mask the module gave its indexer), in place of a dense mask."""

    def __call__(self, topk_indices, *args, **kwargs) -> SparseMask:
        if not isinstance(topk_indices, IndexerCall):
            raise TypeError(f"{MASK_BUILDER}: expected the deferred indexer call, got {type(topk_indices).__name__}")
        return SparseMask(None, call=topk_indices)


class WrapMask:
    """Forward pre-hook (with keywords) of a DSA attention module: its ``attention_mask`` as a ``SparseMask``."""

    def __init__(self, module: torch.nn.Module):
        names = list(inspect.signature(type(module).forward).parameters)[1:]
        self.position = names.index("attention_mask")

    def __call__(self, module, args, kwargs):
        if len(args) > self.position:
            if isinstance(args[self.position], SparseMask):
                return None
            args = (*args[: self.position], SparseMask(args[self.position]), *args[self.position + 1 :])
            return args, kwargs
        if isinstance(kwargs.get("attention_mask"), SparseMask):
            return None
        return args, {**kwargs, "attention_mask": SparseMask(kwargs.get("attention_mask"))}


def install(modules: list) -> None:
    """Defer the indexers of the attention ``modules`` that have one and wrap the masks of all of them (a layer
    without its own indexer reuses an earlier layer's call). Idempotent."""
    for m in modules:
        indexer = getattr(m, "indexer", None)
        if isinstance(indexer, torch.nn.Module) and not isinstance(indexer.__dict__.get("forward"), DeferIndexer):
            indexer.forward = (DeferMaskIndexer if selects_by_mask(indexer) else DeferIndexer)(indexer)
        if callable(getattr(type(m), MASK_BUILDER, None)) and not isinstance(m.__dict__.get(MASK_BUILDER), CarryCall):
            setattr(m, MASK_BUILDER, CarryCall())
        if not any(isinstance(h, WrapMask) for h in m._forward_pre_hooks.values()):
            m.register_forward_pre_hook(WrapMask(m), with_kwargs=True)


def remove(model: torch.nn.Module) -> None:
    """Undo ``install`` on every module of ``model`` (found by class, so a deep copy's are found too)."""
    for m in model.modules():
        remove_forward(m, DeferIndexer)
        if isinstance(m.__dict__.get(MASK_BUILDER), CarryCall):
            del m.__dict__[MASK_BUILDER]
        remove_hooks(m, WrapMask)
