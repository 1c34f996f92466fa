"""Gemma 4's shortcut before its KV-shared layers, kept off the padding masks of one-rank calls.

From its first layer that reuses an earlier layer's keys and values, Gemma 4's text model (Transformers 5.24; Gemma 4
Unified's too) cuts the hidden states, positions and masks to the rows whose logits are kept
(``_maybe_slice_kv_shared_inputs``): those layers write no cache, so the other rows are not needed. It indexes each
mask as ``[batch, heads, query, key]``; hf_ring's mask function returns a 2-D padding mask (a model called with an
``attention_mask`` at one rank), which that indexing cannot take. While the model is patched, ``install`` gives each
such module a ``_maybe_slice_kv_shared_inputs`` of its own (an instance attribute; ``remove`` deletes it) that
leaves the inputs whole when a mask is 2-D and otherwise calls the model's: every row computed, the kept rows' logits
unchanged.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["install", "remove"]

ATTR = "_maybe_slice_kv_shared_inputs"


class _Unsliced:
    """The module's ``_maybe_slice_kv_shared_inputs`` while patched (see the module). Its inputs up to the masks
    (``hidden_states, [per_layer_inputs,] position_embeddings, causal_mask_mapping``, as the releases name them) are
    what it returns."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        names = list(inspect.signature(getattr(type(module), ATTR)).parameters)[1:]
        self.returned = names[: names.index("causal_mask_mapping") + 1]
        self.names = names

    def __call__(self, *args, **kwargs):
        given = {**dict(zip(self.names, args)), **kwargs}
        masks = given["causal_mask_mapping"]
        if any(isinstance(mask, torch.Tensor) and mask.dim() == 2 for mask in dict(masks or {}).values()):
            return tuple(given[name] for name in self.returned)
        return getattr(type(self.module), ATTR)(self.module, *args, **kwargs)


def install(model: torch.nn.Module) -> None:
    """Give each module of ``model`` whose class has the shortcut the version above (idempotent)."""
    for m in model.modules():
        if hasattr(type(m), ATTR) and not isinstance(m.__dict__.get(ATTR), _Unsliced):
            m.__dict__[ATTR] = _Unsliced(m)


def remove(model: torch.nn.Module) -> None:
    """Give every module of ``model`` that ``install`` changed the model's own shortcut back."""
    for m in model.modules():
        if isinstance(m.__dict__.get(ATTR), _Unsliced):
            del m.__dict__[ATTR]
