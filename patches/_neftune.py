"""NEFTune's noise under the ring.

Transformers' NEFTune (``TrainingArguments.neftune_noise_alpha``, ``transformers.integrations.neftune``) adds to the
input embeddings, in training, uniform noise of magnitude ``neftune_noise_alpha / sqrt(length x hidden)``, the
length that of the embedded batch. Under the ring a text batch's embeddings are this rank's shard, so the noise
would be ``sqrt(CP size)`` times the unsharded model's. While a model is patched, each forward given a
``shard_batch`` output scales the embedding module's ``neftune_noise_alpha`` so that the magnitude is the one of
the batch the collator made (before ``shard_batch``'s padding), and restores it after the forward (``NoiseScale``).
The preference and online trainers shard inside the model's call (``hf_ring.trainer.ShardedFusedHead``), after the
hooks: they scale it around that call (``unsharded_noise``). The noise itself is drawn by each rank from its own
random state.
"""

from __future__ import annotations

import contextlib
import math

from ..ring_config import SHARD_INFO_KWARG, ShardInfo

ATTR = "neftune_noise_alpha"


class NoiseScale:
    """Forward pre-hook and hook of the outermost patched model: the NEFTune magnitude of the unsharded batch."""

    def __init__(self):
        self.saved = []

    def __getstate__(self):  # (a copy of a patched model: no forward of its open)
        return {"saved": []}

    def before(self, module, args, kwargs) -> None:
        self.saved.append(_scale(module, kwargs.get(SHARD_INFO_KWARG)))

    def after(self, module, args, output) -> None:  # (also when the forward raises)
        _restore(self.saved.pop() if self.saved else None)


@contextlib.contextmanager
def unsharded_noise(model, info):
    """Within: ``model``'s NEFTune magnitude that of the batch ``info`` (a ``ShardInfo``) was cut from."""
    saved = _scale(model, info)
    try:
        yield
    finally:
        _restore(saved)


def _scale(module, info) -> tuple | None:
    """Scale the NEFTune alpha of ``module``'s input embeddings for the shard ``info`` describes; what to restore
    (None: no NEFTune, or ``info`` is not ``shard_batch``'s, which the forward's own check reports)."""
    if not isinstance(info, ShardInfo):
        return None
    embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    alpha = getattr(embeddings, ATTR, None)
    collated = info.seq_len - info.pad
    if alpha is None or not collated:
        return None
    embedded = info.seq_len if info.whole_inputs else info.seq_len // info.world_size
    setattr(embeddings, ATTR, alpha * math.sqrt(embedded / collated))
    return embeddings, alpha


def _restore(saved: tuple | None) -> None:
    if saved is not None:
        setattr(saved[0], ATTR, saved[1])
