"""Positions numbered from the attention mask (OPT), under the ring.

OPT's decoder numbers its tokens from the attention mask when given no ``position_ids``: each row's tokens counted
from its first one that is not padding, padding -1 (its learned position embeddings add an offset of 2). ``shard_batch`` numbers a batch without ``position_ids`` 0, 1, ... as the other families do (and as their
models number it), which differs on a row with padding in front. While the model is patched, a forward pre-hook of
the decoder (``MaskPositions``) gives it the mask's numbering in place of that one, cut to this rank's shard, from
the batch's document ids (every token's, -1 for padding, the same on every rank). A batch that gave its own
``position_ids`` (packed documents, ``ring_generate``'s prompt) keeps them, as the unmodified model does.
"""

from __future__ import annotations

import torch

from ..batch_checks import refuse_mask
from ..comm import group_rank_and_size
from ..layout import shard
from ..ring_config import DECODE_KWARG, DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG
from ._hooks import named_arguments, remove_hooks

__all__ = ["CallerMask", "MaskPositions", "install", "install_refusal", "remove"]


class MaskPositions:
    """Forward pre-hook (with keywords) of an OPT decoder: the positions its model numbers from the mask."""

    def __call__(self, module, args, kwargs):
        info, docs, given = kwargs.get(SHARD_INFO_KWARG), kwargs.get(DOCUMENT_IDS_KWARG), kwargs.get("position_ids")
        if info is None or not info.numbered or docs is None or not isinstance(given, torch.Tensor):
            return None  # (no padding: the mask's numbering is 0, 1, ... as the batch's)
        valid = (docs >= 0).long()
        numbered = valid.cumsum(dim=1) * valid - 1  # (padding: -1, as the model numbers it)
        local = shard(numbered, dim=1, rank=info.rank, world_size=info.world_size, layout=info.layout)
        return args, {**kwargs, "position_ids": local.to(device=given.device, dtype=given.dtype)}


def install(modules: list) -> None:
    """Give each decoder of ``modules`` the hook (idempotent)."""
    for m in modules:
        if not any(isinstance(h, MaskPositions) for h in m._forward_pre_hooks.values()):
            m.register_forward_pre_hook(MaskPositions(), with_kwargs=True)


class CallerMask:
    """Forward pre-hook (with keywords) of a model that makes an all-ones attention mask when given none (BioGPT:
    ``hf_attention.MAKES_A_MASK``), whose attention function then drops a mask without padding: a mask the caller
    gives is refused here, where it can still be told from the model's own, wherever the attention function refuses
    one (beside ``shard_batch``'s output, or with a ring of several ranks), so that a caller's mask whose shard has
    no padding is never dropped in silence."""

    def __init__(self, cfg):
        self.cfg = cfg  # (the model's RingConfig, not its group: a deep copy shares it, pickling drops the group)

    def __call__(self, module, args, kwargs) -> None:
        if named_arguments(module, args, kwargs).get("attention_mask") is None or DECODE_KWARG in kwargs:
            return  # (ring_generate's decode steps: the cache knows the padding)
        refuse_mask(group_rank_and_size(self.cfg.group)[1], DOCUMENT_IDS_KWARG in kwargs)


def install_refusal(modules: list, cfg) -> None:
    """Give each model of ``modules`` the ``CallerMask`` hook (replacing an earlier one)."""
    for m in modules:
        remove_hooks(m, CallerMask)
        m.register_forward_pre_hook(CallerMask(cfg), with_kwargs=True)


def remove(model: torch.nn.Module) -> None:
    """Undo ``install`` and ``install_refusal`` on every module of ``model``."""
    for m in model.modules():
        remove_hooks(m, (MaskPositions, CallerMask))
