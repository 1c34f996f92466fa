"""``apply_ring_attention`` / ``revert_ring_attention``: the one-line switch of a Transformers model to ring attention.

Accepts a ``transformers.PreTrainedModel`` or a PEFT ``PeftModel`` (the wrapped Transformers model is
patched; the object passed in is returned). The family comes from ``config.model_type`` through the
registry in ``hf_ring.patches``. ``register_attention`` only registers ``"hf_ring"`` in Transformers, for
``from_pretrained(..., attn_implementation="hf_ring")``.
"""

from __future__ import annotations

import dataclasses
import math

from .comm import auto_ulysses_size, group_rank_and_size, ulysses_groups
from .hf_attention import RingConfig, register

__all__ = ["apply_ring_attention", "register_attention", "revert_ring_attention"]


def register_attention() -> None:
    """Register hf_ring under ``"hf_ring"`` in ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent).

    Then ``AutoModelForCausalLM.from_pretrained(..., attn_implementation="hf_ring")`` works: its attention
    modules get the defaults (default process group, ``"zigzag"``, ``"auto"`` backend). For another group,
    layout or backend call ``apply_ring_attention(model, ...)`` on the loaded model (which also makes
    ``revert_ring_attention`` fall back to ``"sdpa"``, since the model had no other implementation).
    """
    register()


def unwrap_transformers_model(model):
    """The ``PreTrainedModel`` inside ``model`` (itself, or a PEFT model's base model), or None."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    get_base = getattr(model, "get_base_model", None)  # PeftModel and its kin
    inner = get_base() if callable(get_base) else None
    return inner if isinstance(inner, PreTrainedModel) else None


def _transformers_model(model):
    """The ``PreTrainedModel`` inside ``model``; TypeError saying what to pass otherwise."""
    inner = unwrap_transformers_model(model)
    if inner is not None:
        return inner
    hint = ""
    if hasattr(model, "module") or hasattr(model, "_orig_mod"):
        hint = (
            " (a DDP/FSDP/torch.compile/accelerator.prepare wrapper?): apply before wrapping, or pass "
            "model.module (model._orig_mod for torch.compile)"
        )
    raise TypeError(
        f"apply_ring_attention expects a transformers PreTrainedModel or a peft PeftModel wrapping one, "
        f"got {type(model).__name__}{hint}"
    )


def apply_ring_attention(
    model, *, group=None, layout: str = "zigzag", backend: str = "auto", ulysses_size=None, timeout: float | None = None
):
    """Switch ``model``'s attention to exact ring attention over the ranks of ``group`` (in place).

    Args:
        model: a ``PreTrainedModel`` of a supported family (``hf_ring.patches.supported_model_types()``),
            or a ``PeftModel`` wrapping one.
        group: the context-parallel process group (None: the default group; none initialised: 1 rank).
        layout: how the sequence is split across ranks (``"zigzag"``, ``"striped"``, ``"contiguous"``);
            must match the layout given to ``shard_batch``.
        backend: local kernel backend (``"auto"``, ``"torch"``, ``"triton"``, ``"sdpa"``, ``"cudnn"``, ``"flash_attn"``).
        ulysses_size: the Ulysses x Ring hybrid: U consecutive ranks of the group exchange heads for sequence
            (all-to-all) and the ring runs across the N / U groups; ``"auto"``: the largest U that divides
            the group's size and the query heads and stays inside one node (``hf_ring.comm.auto_ulysses_size``);
            None or 1: the pure ring. With U > 1 every process must call this at the same point (it creates
            the subgroups, a collective over the default group).
        timeout: seconds a rank waits inside the ring for a peer (CPU / gloo) before it raises a
            ``TimeoutError`` naming the ring step and the peer; None: the process group's own timeout.

    Returns:
        ``model`` itself. Feed it the output of ``hf_ring.shard_batch``. Calling it again replaces the
        settings; ``revert_ring_attention`` restores the original attention.
    """
    from .patches import get_patch

    cfg = RingConfig(group=group, layout=layout, backend=backend, timeout=timeout)  # validated before any collective
    target = _transformers_model(model)
    patch = get_patch(getattr(target.config, "model_type", None))
    u = _ulysses_size(ulysses_size, group, target.config)
    if u > 1:  # ulysses_groups refuses a U that does not divide the group, before it communicates
        cfg = dataclasses.replace(cfg, ulysses=ulysses_groups(group, u, timeout=timeout))
    patch.apply(target, cfg)
    return model


def _query_heads(text) -> int | None:
    """The query heads of every attention layer of the text config ``text``; for a config whose layers differ in
    them (Step 3.7's ``per_layer_config``: Transformers then refuses to read one global count) their gcd, which
    every layer's count is a multiple of."""
    layers = getattr(text, "per_layer_config", None)
    if layers is None or not len(layers):
        return getattr(text, "num_attention_heads", None)
    counts = [getattr(layers[i], "num_attention_heads", None) for i in range(len(layers))]
    return math.gcd(*counts) if all(isinstance(c, int) for c in counts) else None


def _ulysses_size(value, group, config) -> int:
    """U for ``ulysses_size`` (None, ``"auto"`` or an int) on this group and model; ValueError naming the fix."""
    from .patches.generic import NO_ULYSSES

    if value is None:
        return 1
    text = config.get_text_config()
    heads = _query_heads(text)
    refused = NO_ULYSSES.get(getattr(text, "model_type", None))
    if value == "auto":
        return auto_ulysses_size(group_rank_and_size(group)[1], heads) if heads and not refused else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ulysses_size must be None, 'auto' or a positive int, got {value!r}")
    if refused and value > 1:
        raise ValueError(f"{text.model_type}: ulysses_size={value} is not supported: {refused}; use ulysses_size=1")
    if heads and heads % value:
        raise ValueError(
            f"ulysses_size={value} does not divide the model's {heads} query heads: each rank of a Ulysses group "
            f"takes heads / ulysses_size of them; choose a divisor of {heads} (or ulysses_size='auto')"
        )
    return value


def revert_ring_attention(model):
    """Restore the attention implementation ``model`` had before ``apply_ring_attention`` (in place); returns it."""
    from .patches import get_patch

    target = _transformers_model(model)
    get_patch(getattr(target.config, "model_type", None)).revert(target)
    return model
