"""NEFTune's noise under the ring.

Transformers' NEFTune (``TrainingArguments.neftune_noise_alpha``, ``transformers.integrations.neftune``) adds to the
input embeddings, in training, uniform noise of magnitude ``neftune_noise_alpha / sqrt(length x hidden)``, the
length that of the embedded batch. Under the ring a text batch's embeddings are this rank's shard, so the noise
would be ``sqrt(CP size)`` times the unsharded model's. While a model is patched, each forward given a
``shard_batch`` output scales the embedding module's ``neftune_noise_alpha`` so that the magnitude is the one of
the batch the collator made (before ``shard_batch``'s padding), and restores it after the forward (``NoiseScale``).
The noise itself is drawn by each rank from its own random state.
"""

from __future__ import annotations

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
        info = kwargs.get(SHARD_INFO_KWARG)
        if not isinstance(info, ShardInfo):  # (none, or not shard_batch's: the forward's own check says so)
            info = None
        embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
        alpha = getattr(embeddings, ATTR, None)
        collated = None if info is None else info.seq_len - info.pad
        if alpha is None or not collated:
            self.saved.append(None)
            return
        embedded = info.seq_len if info.whole_inputs else info.seq_len // info.world_size
        setattr(embeddings, ATTR, alpha * math.sqrt(embedded / collated))
        self.saved.append((embeddings, alpha))

    def after(self, module, args, output) -> None:  # (also when the forward raises)
        saved = self.saved.pop() if self.saved else None
        if saved is not None:
            setattr(saved[0], ATTR, saved[1])
