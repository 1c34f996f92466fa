"""Gemma 4's shortcut before its KV-shared layers, turned off while the model is patched.

From its first layer that reuses an earlier layer's keys and values, Gemma 4's text model (Transformers 5.24; Gemma 4
Unified's too) cuts the hidden states, positions and masks to the rows whose logits are kept when
``logits_to_keep`` is a count (``_maybe_slice_kv_shared_inputs``): those layers write no cache, so the other rows
are not needed. Under hf_ring that cut cannot run: it indexes each mask as ``[batch, heads, query, key]`` where
hf_ring's mask function hands a one-rank call a 2-D padding mask (an ``IndexError``), and the ring's attention takes
as many queries as keys (a count of 1, as Transformers' ``generate()`` asks, was refused). While the model is
patched, ``install`` gives each such module a ``_maybe_slice_kv_shared_inputs`` of its own (an instance attribute;
``remove`` deletes it) that leaves the inputs whole: every row is computed, and the head keeps the same rows, so
the logits are the unmodified model's. ``ring_generate`` asks for its rows by index, which the model never cut.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["install", "remove"]

ATTR = "_maybe_slice_kv_shared_inputs"


class _Unsliced:
    """The module's ``_maybe_slice_kv_shared_inputs`` while patched: its inputs up to the masks
    (``hidden_states, [per_layer_inputs,] position_embeddings, causal_mask_mapping``, as the releases name them),
    returned whole."""

    def __init__(self, module: torch.nn.Module):
        names = list(inspect.signature(getattr(type(module), ATTR)).parameters)[1:]
        self.names = names
        self.returned = names[: names.index("causal_mask_mapping") + 1]

    def __call__(self, *args, **kwargs):
        given = {**dict(zip(self.names, args)), **kwargs}
        return tuple(given[name] for name in self.returned)


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
