"""Inkling's and Inkling 2's relative position bias, made exact under context parallelism.

Inkling's attention adds to each score a bias that depends on the query and on its backward distance to the key: the
query's hidden state mixes a learned bank of bias-by-distance profiles into one bias per distance 0 .. E - 1
(``InklingRelativeLogits``), which the module spreads over a dense ``[query, key]`` matrix of the keys it holds, its
shard's under the ring, numbered from the shard's first token. Its full-attention layers also scale the queries and
the bias logarithmically by the token's index, counted the same way.

``install`` gives each such attention module's relative-logits module a ``forward`` that returns the per-query table
itself (the attention module holding a ``hf_ring.hf_attention.DistanceBias`` that says so), which the ring applies at every step by the tokens' global positions
(``ring_attention(distance_bias=...)``), and moves the logarithmic scaling into the attention function, by the
index in the whole row (the module's own is turned off through its instance attribute ``is_sliding``, which its
forward reads for that alone). Inkling 2's module projects and scales its table itself, by ``position_ids``
(global under the ring): its patched ``forward`` returns the table (``Table2``), and nothing else changes.
``remove`` gives both back.
"""

from __future__ import annotations

import torch

from ..hf_attention import DISTANCE_BIAS_ATTR, DistanceBias

__all__ = ["install", "remove"]

_SLIDING = "_hf_ring_is_sliding"  # the attention module's own ``is_sliding``, while ``install`` overrides it


class Table2:
    """The ``forward`` of Inkling 2's relative-position-bias module while patched: ``(hidden_states,
    relative_distance, position_ids) -> table``, each query's bias by distance [batch, heads, q_len, E] (its states'
    projection and norm, the logarithmic scaling by ``position_ids`` included, as the module computes them; the
    distances, a shard's, are not read)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, hidden_states, relative_distance=None, position_ids=None):
        m = self.module
        states = m.linear(hidden_states).view(*hidden_states.shape[:-1], m.num_heads, -1)
        return (m.norm(states, position_ids) @ m.proj).transpose(1, 2)


class Table:
    """The ``forward`` of a relative-logits module while patched: ``(relative_states, query_positions,
    key_positions) -> table``, each query's bias by distance ``[batch, heads, q_len, E]`` (the positions, a shard's,
    are not read). A tensor, as the module's own output: DeepSpeed ZeRO-3 hooks the gathering of its ``proj`` for the
    backward on its outputs. The attention module holds a ``DistanceBias`` (its log scaling) saying what the
    ``position_bias`` it passes on is."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, relative_states, query_positions=None, key_positions=None):
        return (relative_states @ self.module.proj).transpose(1, 2)


def biased(module: torch.nn.Module) -> bool:
    """``module`` is an attention module with Inkling's or Inkling 2's relative position bias."""
    bias = getattr(module, "rel_logits_proj", getattr(module, "relative_position_bias", None))
    return isinstance(bias, torch.nn.Module) and hasattr(module, "is_sliding")


def install(modules: list) -> None:
    """Hand the relative position bias of ``modules`` (patched attention modules) to the ring. Idempotent."""
    for m in modules:
        if not biased(m) or hasattr(m, _SLIDING):
            continue
        setattr(m, _SLIDING, m.is_sliding)
        if not hasattr(m, "rel_logits_proj"):  # Inkling 2: its scaling by position_ids, which are global already
            m.relative_position_bias.forward = Table2(m.relative_position_bias)
            setattr(m, DISTANCE_BIAS_ATTR, DistanceBias())
            continue
        config = m.config
        floor = getattr(config, "log_scaling_n_floor", None)
        log_scaling = None if m.is_sliding or floor is None else (floor, float(config.log_scaling_alpha))
        m.rel_logits_proj.forward = Table(m.rel_logits_proj)
        setattr(m, DISTANCE_BIAS_ATTR, DistanceBias(log_scaling=log_scaling))
        m.is_sliding = True  # (its forward reads it only to scale logarithmically: the attention function does)


def remove(model: torch.nn.Module) -> None:
    """Give every module of ``model`` that ``install`` changed its own bias and scaling back."""
    for m in model.modules():
        if _SLIDING in m.__dict__:
            m.is_sliding = m.__dict__.pop(_SLIDING)
            m.__dict__.pop(DISTANCE_BIAS_ATTR, None)
            bias = getattr(m, "rel_logits_proj", None) or m.relative_position_bias
            bias.__dict__.pop("forward", None)
