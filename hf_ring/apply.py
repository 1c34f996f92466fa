"""``apply_ring_attention`` / ``revert_ring_attention``: the one-line switch of a Transformers model to ring attention.

Accepts a ``transformers.PreTrainedModel`` or a PEFT ``PeftModel`` (the wrapped Transformers model is
patched; the object passed in is returned). The family comes from ``config.model_type`` through the
registry in ``hf_ring.patches``. ``register_attention`` only registers ``"hf_ring"`` in Transformers, for
``from_pretrained(..., attn_implementation="hf_ring")``.
"""

from __future__ import annotations

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


def apply_ring_attention(model, *, group=None, layout: str = "zigzag", backend: str = "auto"):
    """Switch ``model``'s attention to exact ring attention over the ranks of ``group`` (in place).

    Args:
        model: a ``PreTrainedModel`` of a supported family (``hf_ring.patches.supported_model_types()``),
            or a ``PeftModel`` wrapping one.
        group: the context-parallel process group (None: the default group; none initialised: 1 rank).
        layout: how the sequence is split across ranks (``"zigzag"``, ``"striped"``, ``"contiguous"``);
            must match the layout given to ``shard_batch``.
        backend: local kernel backend (``"auto"``, ``"torch"``, ``"triton"``, ``"flash_attn"``).

    Returns:
        ``model`` itself. Feed it the output of ``hf_ring.shard_batch``. Calling it again replaces the
        settings; ``revert_ring_attention`` restores the original attention.
    """
    from .patches import get_patch

    cfg = RingConfig(group=group, layout=layout, backend=backend)
    target = _transformers_model(model)
    get_patch(getattr(target.config, "model_type", None)).apply(target, cfg)
    return model


def revert_ring_attention(model):
    """Restore the attention implementation ``model`` had before ``apply_ring_attention`` (in place); returns it."""
    from .patches import get_patch

    target = _transformers_model(model)
    get_patch(getattr(target.config, "model_type", None)).revert(target)
    return model
