"""DeepSeek-V4's compressors, deferred to hf_ring's attention function while the model is patched.

A DeepSeek-V4 compressed attention layer calls its compressor (``compressor``: HCA, or CSA with its indexer) on its
own tokens and concatenates the entries it returns to its keys. Under the ring the entries must cover every rank's
tokens, which only the attention function can gather (it knows the group and the layout). So, while the model is
patched, each compressor's ``forward`` (an instance attribute; ``remove`` deletes it) records its call on its attention
module (``hf_ring.compressed.CompressorCall``) and returns no entries, which the model concatenates as it would; the
attention function resolves the record (``hf_ring.compressed.resolve``).
"""

from __future__ import annotations

import inspect

import torch

from ..compressed import ATTR, CompressorCall
from ._hooks import remove_forward

__all__ = ["DeferCompressor", "install", "remove"]


class DeferCompressor:
    """A compressor's ``forward`` while patched: its call, recorded on ``owner`` (its attention module); no entries."""

    def __init__(self, module: torch.nn.Module, owner: torch.nn.Module):
        self.module = module
        self.owner = owner
        self.names = list(inspect.signature(type(module).forward).parameters)[1:]

    def __call__(self, *args, **kwargs):
        given = {**dict(zip(self.names, args)), **kwargs}
        hidden = given["hidden_states"]
        call = CompressorCall(self.module, hidden, given["q_residual"], given["position_ids"])
        self.owner.__dict__[ATTR] = call
        return hidden.new_zeros((hidden.shape[0], 1, 0, self.module.head_dim)), None


def install(modules: list) -> None:
    """Defer the compressors of the attention ``modules`` that have one. Idempotent."""
    for m in modules:
        compressor = getattr(m, "compressor", None)
        if isinstance(compressor, torch.nn.Module) and not isinstance(
            compressor.__dict__.get("forward"), DeferCompressor
        ):
            compressor.forward = DeferCompressor(compressor, m)


def remove(model: torch.nn.Module) -> None:
    """Give every compressor of ``model`` its own ``forward`` back, and drop any call left recorded."""
    for m in model.modules():
        remove_forward(m, DeferCompressor)
        m.__dict__.pop(ATTR, None)
