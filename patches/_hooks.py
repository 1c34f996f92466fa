"""Removing the forward hooks and forwards hf_ring's patches add, found by their class (so a deep copy's are found
too), and a hook's view of the call's arguments by name."""

from __future__ import annotations

import inspect

import torch

__all__ = ["named_arguments", "remove_forward", "remove_hooks"]


def remove_hooks(module: torch.nn.Module, kinds: type | tuple) -> None:
    """Remove ``module``'s forward pre-hooks and forward hooks that are instances of ``kinds`` (or methods bound to
    one), with the flags Torch keeps beside them (keywords, always called)."""
    flags = (module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
             module._forward_hooks_always_called)  # fmt: skip
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hook_id, hook in list(hooks.items()):
            if isinstance(getattr(hook, "__self__", hook), kinds):
                del hooks[hook_id]
                for flag in flags:
                    flag.pop(hook_id, None)


def remove_forward(module: torch.nn.Module, kinds: type | tuple) -> None:
    """Give ``module`` its class's ``forward`` back when its own (an instance attribute) is one of ``kinds``."""
    if isinstance(module.__dict__.get("forward"), kinds):
        del module.__dict__["forward"]


def named_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """A forward pre-hook's call arguments by name, positional ones too (``model(input_ids, pixel_values)``)."""
    named = dict(kwargs)
    if args:
        names = list(inspect.signature(type(module).forward).parameters)[1:]
        named.update(zip(names, args))
    return named
