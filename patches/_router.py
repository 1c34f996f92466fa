"""The MoE router's load-balancing loss of the whole sequence under context parallelism.

Transformers' MoE families add to their loss, with ``output_router_logits=True``, a load-balancing loss of the router
logits of the tokens the forward sees (``load_balancing_loss_func`` in the family's modeling module: the number of
experts times the sum over experts of the share of routed slots the expert gets and its mean router probability,
over every layer's real tokens). Under the ring each rank sees its shard only. While a model is patched, the
module's function is replaced (``_Balanced``): during the model's forward it sums per expert the slots routed there
and the router's probabilities over the rank's real tokens, adds them over the CP group (one all-gather forward,
one all-reduce backward: ``StateGather``), and returns the rank's share of the loss of the whole sequence (the loss
over the group's size): ``reduce_loss`` adds the shares as it adds the language-model loss's, and the gradients
summed over the group are the whole sequence's. Padding (the batch's, and what ``shard_batch`` adds) is left out,
as the model leaves out what its attention mask marks. Outside a patched model's forward it is the model's own.

A family's function is taken only if it gives the formula's value on a small random input, with and without a mask
(``_agrees``); otherwise ``output_router_logits=True`` is refused, as before.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import sys

import torch

from ..comm import StateGather, group_rank_and_size
from ..layout import shard
from ..ring_config import DECODE_KWARG, DOCUMENT_IDS_KWARG, SHARD_INFO_KWARG, RingConfig
from ._hooks import remove_hooks

NAME = "load_balancing_loss_func"

_SCOPE: contextvars.ContextVar = contextvars.ContextVar("hf_ring_router_scope", default=None)


@dataclasses.dataclass(frozen=True)
class _Scope:
    """The forward of a patched model: its CP group, and what names this rank's real tokens (``shard_batch``'s
    ``ShardInfo`` and document ids; ``info`` None when the forward was not given a ``shard_batch`` output)."""

    cfg: RingConfig
    info: object = None
    docs: torch.Tensor | None = None
    generate: bool = False  # (a call of ring_generate's, its prefill or a decode step)

    def keep(self) -> torch.Tensor | None:
        """[batch or 1, local_seq] bool: this rank's real tokens (None: no ``shard_batch`` output). Built when the
        loss is asked for, not on every forward (the ids' copy to the host would be a sync on a GPU)."""
        info = self.info
        if info is None:
            return None
        full = info.seq_len
        valid = torch.arange(full, device="cpu")[None] < full - info.pad if self.docs is None else self.docs.cpu() >= 0
        return shard(valid, dim=1, rank=info.rank, world_size=info.world_size, layout=info.layout)


def _module_of(model):
    """The module whose globals the forward of ``model``'s class reads (the family's modeling module, along the
    class's bases: a class FSDP2 or a user made), if it defines a load-balancing function; else None."""
    for cls in type(model).__mro__:
        forward = vars(cls).get("forward")
        if forward is not None:
            module = sys.modules.get(inspect.unwrap(forward).__module__)
            return module if callable(getattr(module, NAME, None)) else None
    return None


def check(model) -> None:
    """ValueError when ``model``'s config sets ``output_router_logits`` and its family's load-balancing function is
    not the formula hf_ring sums (before anything is patched)."""
    if getattr(model.config.get_text_config(), "output_router_logits", False) and _own(model)[1] is None:
        raise ValueError(
            f"{model.config.model_type}: config.output_router_logits=True adds the MoE router's load-balancing loss, "
            "which hf_ring computes over the whole sequence for the families whose model computes Mixtral's "
            "(Switch Transformer) formula, not this one (it computes none, or another); set "
            "config.output_router_logits=False to train with context parallelism"
        )


def _own(model) -> tuple:
    """``(module, its own load-balancing function)`` of ``model``'s family, the function None when it has none that
    ``balanced`` computes."""
    module = _module_of(model)
    function = None if module is None else getattr(module, NAME)
    original = function.original if isinstance(function, _Balanced) else function
    return module, original if original is not None and _agrees(original) else None


def install(model, cfg: RingConfig) -> None:
    """Mark ``model``'s forward as the scope of hf_ring's load-balancing loss (``check`` first), its family's
    function replaced by ``_Balanced`` (once per process: outside a patched model's forward it is the family's
    own, so a deep copy of a patched model, or another model of the family, finds what it needs)."""
    remove(model)
    module, original = _own(model)
    if original is None:
        return
    if not isinstance(getattr(module, NAME), _Balanced):
        setattr(module, NAME, _Balanced(original))
    scoper = _Scoper(cfg)
    model.register_forward_pre_hook(scoper.enter, with_kwargs=True)
    model.register_forward_hook(scoper.leave, always_call=True)


def remove(model) -> None:
    """Undo ``install`` on ``model``: its forward is no scope any more (the family's own loss)."""
    remove_hooks(model, _Scoper)


class _Scoper:
    """The patched model's forward hooks: its forward is the scope (``_Scope``) of the load-balancing function."""

    def __init__(self, cfg: RingConfig):
        self.cfg = cfg
        self.tokens = []

    def __getstate__(self):  # (a copy of a patched model, deep or pickled: none of its scopes open)
        return {"cfg": self.cfg, "tokens": []}

    def enter(self, module, args, kwargs) -> None:
        info = kwargs.get(SHARD_INFO_KWARG)
        docs = kwargs.get(DOCUMENT_IDS_KWARG)
        scope = _Scope(self.cfg, info, None if docs is None else docs.detach(), kwargs.get(DECODE_KWARG) is not None)
        self.tokens.append(_SCOPE.set(scope))

    def leave(self, module, args, output) -> None:  # (also when the forward raises)
        if self.tokens:
            _SCOPE.reset(self.tokens.pop())


class _Balanced:
    """The family's ``load_balancing_loss_func`` while a model of it is patched: inside a patched model's forward,
    the rank's share of the whole sequence's loss (``balanced``); elsewhere the family's own."""

    def __init__(self, original):
        self.original = original
        functools.update_wrapper(self, original)  # (its name, docstring and signature, as the module's own)

    def __call__(self, gate_logits, num_experts=None, top_k=2, attention_mask=None):
        scope = _SCOPE.get()
        if scope is None:
            return self.original(gate_logits, num_experts, top_k, attention_mask)
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        rows = gate_logits[0].shape[0]
        if scope.generate:  # ring_generate's prefill and decode steps: nothing reads aux_loss there; the family's
            return self.original(gate_logits, num_experts, top_k, None)  # own on this rank's tokens, no collective
        keep = scope.keep()
        if keep is None:  # a forward without shard_batch: the model's own, at one rank
            if group_rank_and_size(scope.cfg.group)[1] == 1:
                return self.original(gate_logits, num_experts, top_k, attention_mask)
            raise ValueError(
                "the MoE router's load-balancing loss under context parallelism needs the batch from "
                "hf_ring.shard_batch (it names this rank's tokens)"
            )
        if keep.shape[0] == 1 and rows != keep.numel():
            keep = keep.expand(rows // keep.shape[1], -1)
        if rows != keep.numel():
            raise ValueError(
                f"the MoE router's logits have {rows} rows per layer, not one per token of this rank's shard "
                f"({keep.numel()}); hf_ring cannot compute the load-balancing loss of the whole sequence"
            )
        world = group_rank_and_size(scope.cfg.group)[1]
        what = "the all-gather of the MoE router's load-balancing sums"
        gather = StateGather(scope.cfg.group, scope.cfg.timeout, what=what) if world > 1 else None
        return balanced(gate_logits, num_experts, top_k, keep, gather)


def balanced(gate_logits: tuple, num_experts: int, top_k: int, keep: torch.Tensor, gather=None) -> torch.Tensor:
    """This rank's share of the load-balancing loss over the CP group's real tokens (``keep``: this rank's, [batch,
    local_seq] bool, rows in the order of each layer's logits; ``gather``: the group's ``StateGather``, None at
    one rank)."""
    device = gate_logits[0].device
    flat = keep.reshape(-1).to(device=device, dtype=torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for layer in gate_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), flat.repeat_interleave(top_k))
        probs = probs + (weights.float() * flat[:, None]).sum(0)
    rows = flat.sum() * len(gate_logits)
    stats = torch.cat([counts, probs, rows[None]])
    world = 1 if gather is None else gather.world_size
    if gather is not None:
        stats = gather.gather(stats).sum(0)
    counts, probs, rows = stats[:num_experts].detach(), stats[num_experts:-1], stats[-1].detach()
    return num_experts * torch.sum((counts / rows) * (probs / rows)) / world


_AGREES: dict = {}


def _agrees(original) -> bool:
    """``original`` computes the formula ``balanced`` sums (checked once per function on a small random input, with
    and without an attention mask, at one rank)."""
    if original not in _AGREES:
        g = torch.Generator().manual_seed(0)
        logits = tuple(torch.randn(6, 4, generator=g, device="cpu") for _ in range(2))
        mask = torch.tensor([[1, 1, 1], [0, 1, 1]], device="cpu")
        every = torch.ones(2, 3, dtype=torch.bool, device="cpu")
        try:
            ok = all(
                abs(float(original(logits, 4, 2, m)) - float(balanced(logits, 4, 2, k))) <= 1e-6
                for m, k in ((None, every), (mask, mask.bool()))
            )
        except Exception:  # (another signature or shape rule, e.g. Doge's: not the formula)  # noqa: BLE001
            ok = False
        _AGREES[original] = ok
    return _AGREES[original]
