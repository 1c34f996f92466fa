"""Llama 4's attention temperature tuning, made exact under context parallelism.

Llama 4's layers without RoPE multiply each query by a factor that grows with the token's index in its row
(``attn_temperature_tuning``), an index the attention module counts from the length of the hidden states it is
given: under the ring, a shard's, so every rank but the first would scale its queries as if its tokens came first.
``install`` turns the module's own scaling off (its instance attribute ``attn_temperature_tuning``) and gives the
module a ``hf_ring.hf_attention.QueryTemperature``: the ring's attention function scales the queries by the
tokens' indices in the whole row (the layout's positions; in ``ring_generate``, the prompt's and the new tokens'),
with Transformers' operations. ``remove`` gives the module its own scaling back.
"""

from __future__ import annotations

import torch

from ..hf_attention import TEMPERATURE_ATTR, QueryTemperature, scales_queries_itself

__all__ = ["install", "remove"]


def install(modules: list) -> None:
    """Move the temperature tuning of ``modules`` (patched attention modules) into the ring's attention function.
    Idempotent: a module that has it already keeps it."""
    for m in modules:
        if hasattr(m, TEMPERATURE_ATTR) or not scales_queries_itself(m):
            continue
        setattr(m, TEMPERATURE_ATTR, QueryTemperature(float(m.floor_scale), float(m.attn_scale)))
        m.attn_temperature_tuning = False


def remove(model: torch.nn.Module) -> None:
    """Give every module of ``model`` that ``install`` changed its own temperature tuning back."""
    for m in model.modules():
        if hasattr(m, TEMPERATURE_ATTR):
            delattr(m, TEMPERATURE_ATTR)
            m.attn_temperature_tuning = True
