"""RoPE types whose frequencies follow the input's largest position id, made exact under context parallelism.

Transformers' ``dynamic`` (dynamic NTK scaling) and ``longrope`` (Phi-3 / Phi-3.5 / Phi-4-mini long context)
rotary embeddings pick their inverse frequencies at every forward from ``max(position_ids) + 1``: longrope
switches from its short to its long factors once that exceeds ``original_max_position_embeddings``; dynamic
rescales its base for that length. Under context parallelism each rank sees only its shard's positions (with
zig-zag, rank 0 holds the last ones, rank 1 does not), so the ranks would rotate with different frequencies,
and none of them like the unsharded model.

``UnshardedPositions`` replaces the ``forward`` of each such rotary module of a patched model (an instance
attribute; ``revert`` removes it) and calls Transformers' own code twice:

1. the decorated ``forward`` (``dynamic_rope_update``) on one position, the largest position id of the whole CP
   group: it updates the frequencies exactly as the unsharded model would for this batch;
2. the function under that decorator (its ``__wrapped__``), under ``torch.no_grad()`` as in Transformers' rotary
   classes, on the rank's own positions, with those frequencies.

The largest position is one all-reduce (MAX) of one integer over the CP group per forward, computed once per
batch (``PlanCache.derived``, so Gemma 3's per-layer-type calls share it) and kept on the device (no host sync
of its own on NCCL). Only models with such a RoPE type pay it. A rotary module that selects frequencies some
other way (no Transformers decorator in its ``forward``'s ``__wrapped__`` chain) is refused by ``check``.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch

from ..comm import RingComm
from ..hf_attention import LOST_GROUP, lost_group
from ._hooks import remove_forward

__all__ = ["UnshardedPositions", "check", "declared", "install", "remove", "rotary_modules", "undecorated"]


def _depends(kind) -> bool:
    """Whether RoPE type ``kind`` follows the largest position id, as Transformers' decorator decides: ``"dynamic"``
    in the type's name (``"dynamic"``, and Transformers' dynamic variants) or ``"longrope"``."""
    return isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")


def _kinds(rope_type) -> list:
    if isinstance(rope_type, dict):  # per layer type (Gemma 3)
        return list(rope_type.values())
    return [rope_type]


def declared(config) -> list:
    """The position-dependent RoPE types that ``config`` names (per layer type too)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    sets = (
        [params] if "rope_type" in params or "type" in params else [p for p in params.values() if isinstance(p, dict)]
    )
    return [k for p in sets if _depends(k := p.get("rope_type", p.get("type")))]


def rotary_modules(model: torch.nn.Module) -> list:
    """The modules of ``model`` whose ``rope_type`` is position-dependent."""
    return [m for m in model.modules() if any(_depends(k) for k in _kinds(getattr(m, "rope_type", None)))]


@functools.cache
def _reference_code():
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def undecorated(forward):
    """The rotary computation under ``forward`` without Transformers' ``dynamic_rope_update`` (which sits under
    ``torch.no_grad()`` in every Transformers rotary class), or None when that decorator is not in its chain."""
    code = _reference_code()
    f = forward
    while f is not None:
        if getattr(f, "__code__", None) is code:
            return getattr(f, "__wrapped__", None)
        f = getattr(f, "__wrapped__", None)
    return None


def check(model: torch.nn.Module, what: str) -> list:
    """The rotary modules to wrap; ValueError when the config names a position-dependent RoPE type that cannot be
    made exact (no rotary module found, or one whose ``forward`` is not Transformers' decorated one)."""
    kinds = declared(model.config.get_text_config())
    modules = rotary_modules(model)
    odd = [m for m in modules if undecorated(type(m).forward) is None]
    if (kinds and not modules) or odd:
        kind = kinds[0] if kinds else getattr(odd[0], "rope_type", None)
        raise ValueError(
            f"{what}: rope_type={kind!r} picks its frequencies from the largest position id of the input, and hf_ring "
            "found no rotary embedding it can give the whole sequence's largest position (Transformers' "
            "dynamic_rope_update forward), so context parallelism would not be exact; this model is not supported"
        )
    return modules


class UnshardedPositions:
    """``forward`` of a rotary module: frequencies chosen for the CP group's largest position id (module docstring)."""

    def __init__(self, module: torch.nn.Module, cfg):
        self.module = module
        self.cfg = cfg
        self._compute = undecorated(type(module).forward)

    def __getstate__(self):  # the function is found again on loading (it cannot be pickled by name)
        return {"module": self.module, "cfg": self.cfg}

    def __setstate__(self, state):
        self.__init__(state["module"], state["cfg"])

    def __call__(self, x, position_ids=None, layer_type=None, **kwargs):
        decorated = type(self.module).forward
        extra = {} if layer_type is None else {"layer_type": layer_type}
        if position_ids is None:
            return decorated(self.module, x, position_ids, **extra, **kwargs)
        plans = self.cfg.plans  # (not ``if plans``: an empty PlanCache has length 0)
        if plans is None:
            largest = self._largest(position_ids)
        else:
            largest = plans.derived((position_ids,), lambda: self._largest(position_ids))
        decorated(self.module, x, largest.to(position_ids.device), **extra)  # updates the frequencies
        with torch.no_grad(), _mscale_of(self.module, largest):
            return self._compute(self.module, x, position_ids, **extra, **kwargs)

    @torch.compiler.disable
    def _largest(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[1, 1]: the largest position id on any rank of the CP group (one all-reduce, counted by the hang guard
        like a ring call: a rank failing after it stops the group, so its peers never wait out of step)."""
        cfg = self.cfg
        if lost_group(cfg):
            raise ValueError(LOST_GROUP)
        comm = RingComm(cfg.group, timeout=cfg.timeout)
        if comm.world_size > 1 and cfg.plans is not None:
            cfg.plans.progress.label = "the rotary embedding's largest position"
            cfg.plans.progress.call([cfg.group], needs_grad=False)
        return comm.all_reduce_max(position_ids.detach().max().reshape(1, 1))


@contextlib.contextmanager
def _mscale_of(module, largest: torch.Tensor):
    """Phi-3.5-MoE's longrope also multiplies cos / sin by ``long_mscale`` or ``short_mscale``, chosen inside the
    rotary computation by the largest of the positions it is given: for the call on the rank's own positions the
    module sees a copy of its config whose two values are both the one the whole sequence's largest position
    chooses (one host read per forward; the model's own choice reads one too). The shared config is not touched."""
    config = getattr(module, "config", None)
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not {"long_mscale", "short_mscale"} <= params.keys():
        yield
        return
    long = int(largest.max()) + 1 > params["original_max_position_embeddings"]
    chosen = params["long_mscale"] if long else params["short_mscale"]
    pinned = copy.copy(config)
    pinned.rope_parameters = {**params, "long_mscale": chosen, "short_mscale": chosen}
    module.config = pinned
    try:
        yield
    finally:
        module.config = config


def install(modules: list, cfg) -> None:
    for m in modules:
        m.forward = UnshardedPositions(m, cfg)


def remove(model: torch.nn.Module) -> None:
    for m in model.modules():
        remove_forward(m, UnshardedPositions)
