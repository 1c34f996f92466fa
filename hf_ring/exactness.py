"""``check_exactness``: hf_ring against the unmodified model, on your own model and one of your batches.

Equal results up to rounding is what hf_ring promises, and a loss curve cannot show it. ``check_exactness`` runs one
batch three ways on every rank of the context-parallel group, with the same weights:

1. the unmodified model on the whole batch in a wider dtype (float64 for an fp32 model, fp32 for a bf16 or fp16 one):
   the yardstick;
2. the unmodified model on the whole batch in its own dtype: how far the model's own arithmetic is from the yardstick;
3. hf_ring: the batch sharded by ``shard_batch`` over the group, the loss and the gradients summed over it;

and compares 2 and 3 with 1: the loss by its relative error, each parameter's gradient by the norm of its difference
relative to its norm, with a floor of 1% of the largest gradient norm (a gradient that is zero but for rounding is
measured against the others; ``tests/test_properties.py`` measures the same way). It passes when hf_ring's errors are
at most twice the model's own plus an allowance for sums taken in another order: 1e-4 in fp32, 2e-2 in bf16 / fp16
(the test suite's rules and their reasons: ``tests/test_properties.py``). With ``reference_dtype=None`` there is no
yardstick: hf_ring is compared with the unmodified model in its own dtype, within 1e-4 (fp32) or 5e-2 (bf16 / fp16),
a coarser verdict for models whose kernels refuse a wider dtype.

The unmodified model reads the batch as Transformers does, the loss is the language-model loss of the targets
``shard_batch`` counts (a target is ignored where the predicting or the predicted token is padding), and packed
documents (restarting ``position_ids`` or ``cu_seq_lens_q``) each run alone, their logits put back in the row: what
the packing collators and flash attention give (Llama 4 counts its attention chunks from the row's start, so a
packed Llama 4 batch differs from that by design). A MoE router's auxiliary loss is switched off for the check
(``output_router_logits``; its exactness is in the test suite). A model whose kernels refuse the wider dtype (the
grouped matrix products of Transformers' MoE experts refuse float64) is compared without a yardstick, and the report
says so (``note``).

The model is in eval mode during the check (dropout would draw other masks in each run) and comes back as it was:
its mode, dtypes, gradients and attention (a model patched by ``apply_ring_attention`` is checked with its settings;
an unpatched one with the arguments given, and unpatched after). Every rank must pass the same batch (checked).
Memory: each rank runs the whole batch, so check at a length one device holds (the configuration is checked, not the
length), and holds the weights in the wider dtype during the first run and the yardstick's gradients on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib

import torch
import torch.distributed as dist

from .batch import IGNORE_INDEX, shard_for
from .comm import group_rank_and_size
from .hf_attention import DOCUMENT_IDS_KWARG
from .ring_config import CONFIG_ATTR

__all__ = ["ExactnessReport", "check_exactness"]

FACTOR = 2.0
"""hf_ring's error may be twice the unmodified model's own (STYLE.md's low-precision rule, for every dtype here)."""
ALLOWANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float64: 1e-10}
"""Added to the bound: rows that see few keys make a gradient the difference of nearly equal terms, whose rounding
depends on the order of the sums (``tests/test_properties.py``: 1.5e-5 measured in fp32, 1.5e-2 in bf16)."""
WITHOUT_REFERENCE = {torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 5e-2, torch.float64: 1e-10}
"""The bound with no yardstick: hf_ring against the unmodified model in the same dtype, both rounded."""
FLOOR = 1e-2
"""A gradient's error is relative to its norm or to this share of the largest gradient norm, whichever is larger."""


@dataclasses.dataclass(frozen=True)
class ExactnessReport:
    """What ``check_exactness`` found: hf_ring's errors and the unmodified model's own (relative, see the module).

    ``ok``: hf_ring's loss and gradient errors are within ``loss_bound`` and ``grad_bound``. ``model_*`` are None
    without a yardstick (``reference_dtype=None``, or the model refused it: ``note`` says why; the errors are then
    against the unmodified model). ``worst`` names
    the parameter of hf_ring's largest gradient error. ``str(report)`` says it all in a few lines.
    """

    ok: bool
    dtype: torch.dtype
    reference_dtype: torch.dtype | None
    ranks: int
    layout: str
    loss: float
    reference_loss: float
    loss_error: float
    grad_error: float
    worst: str
    loss_bound: float
    grad_bound: float
    model_loss_error: float | None = None
    model_grad_error: float | None = None
    parameters: int = 0
    note: str = ""

    def __str__(self) -> str:
        against = (
            f"the unmodified model in {_name(self.reference_dtype)}" if self.reference_dtype else "the unmodified model"
        )
        own = ""
        if self.model_loss_error is not None:
            own = f" (the unmodified model in {_name(self.dtype)}: {self.model_loss_error:.1e}, {self.model_grad_error:.1e})"
        return (
            f"hf_ring exactness check: {'OK' if self.ok else 'FAILED'}, {_name(self.dtype)} model, {self.ranks} rank(s), "
            f"{self.layout}, against {against}\n"
            f"  loss {self.loss:.6f} vs {self.reference_loss:.6f}: relative error {self.loss_error:.1e} "
            f"(bound {self.loss_bound:.1e})\n"
            f"  gradients of {self.parameters} parameters: worst relative error {self.grad_error:.1e} in {self.worst} "
            f"(bound {self.grad_bound:.1e}){own}" + (f"\n  {self.note}" if self.note else "")
        )  # fmt: skip


def check_exactness(
    model, batch, *, group=None, layout: str | None = None, backend: str | None = None, ulysses_size=None,
    reference_dtype="wider",
) -> ExactnessReport:  # fmt: skip
    """Check hf_ring against the unmodified model on ``model`` and ``batch``; every rank of ``group`` calls it.

    Args:
        model: a Transformers model of a supported family or a PEFT model wrapping one, not wrapped by DDP, FSDP or
            DeepSpeed (every rank runs the whole model), on this rank's device; patched by ``apply_ring_attention``
            (its settings are used: leave ``group``, ``layout``, ``backend`` and ``ulysses_size`` unset) or not.
        batch: a collator's full batch with ``labels``, as ``shard_batch`` takes it, the same on every rank.
        group, layout, backend, ulysses_size: as for ``apply_ring_attention`` (defaults: the world, zig-zag, auto).
        reference_dtype: the yardstick's dtype: ``"wider"`` (float64 for an fp32 model, fp32 otherwise), a
            ``torch.dtype``, or None (no yardstick; see the module).

    Returns:
        an ``ExactnessReport``, the same on every rank (``report.ok``; print it for the figures).
    """
    from .apply import apply_ring_attention, revert_ring_attention, unwrap_transformers_model
    from .compressed import chunk_multiple
    from .patches import get_patch

    target = unwrap_transformers_model(model)
    cfg = next((getattr(m, CONFIG_ATTR) for m in target.modules() if hasattr(m, CONFIG_ATTR)), None)
    given = {"group": group, "layout": layout, "backend": backend, "ulysses_size": ulysses_size}
    if cfg is not None and any(v is not None for v in given.values()):
        raise ValueError(
            "check_exactness: the model is patched by apply_ring_attention, whose settings the check uses; leave "
            f"{', '.join(k for k, v in given.items() if v is not None)} unset (or check the model before applying)"
        )
    group = cfg.group if cfg is not None else group
    layout = cfg.layout if cfg is not None else layout or "zigzag"
    if not isinstance(batch, dict) or batch.get("labels") is None:
        raise ValueError("check_exactness needs a batch (a dict, as a collator returns it) with labels")
    dtype = _dtype(model)
    wide = _wider(dtype) if isinstance(reference_dtype, str) and reference_dtype == "wider" else reference_dtype
    if wide is not None and not (isinstance(wide, torch.dtype) and wide.is_floating_point):
        raise ValueError(f"reference_dtype must be 'wider', a floating torch.dtype or None, got {reference_dtype!r}")
    _same_batch_everywhere(batch, group)

    rank, world = group_rank_and_size(group)
    saved = {p: p.grad for p in model.parameters()}
    training = model.training
    patch = get_patch(getattr(target.config, "model_type", None))
    if cfg is not None:
        revert_ring_attention(model)
    try:
        model.eval()
        with _without_router_loss(target):
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            own_err = own_loss_err = None
            note = ""
            if wide is not None:  # 1. the yardstick (its gradients on the CPU)
                try:
                    with _cast(model, wide):
                        ref_loss = _reference(model, batch, layout, wide)
                        ref = {n: p.grad.detach().cpu() for n, p in params if p.grad is not None}
                except (RuntimeError, NotImplementedError, TypeError) as e:  # a kernel without that dtype
                    first = (str(e).splitlines() or [""])[0][:160]
                    note = f"the unmodified model refused {_name(wide)} ({type(e).__name__}: {first}): no yardstick"
                    wide = None
            if wide is not None:
                floor = _floor(ref)
                own_loss = _reference(model, batch, layout, dtype)  # 2. the model's own
                own_err, _ = _grad_error(params, ref, floor)
                own_loss_err = _rel(own_loss, ref_loss)
            else:
                ref_loss = _reference(model, batch, layout, dtype)
                ref = {n: p.grad.detach().cpu() for n, p in params if p.grad is not None}
                floor = _floor(ref)
            # 3. hf_ring
            if cfg is not None:
                patch.apply(target, cfg)
            else:
                apply_ring_attention(model, group=group, layout=layout, backend=backend or "auto",
                                     ulysses_size=ulysses_size)  # fmt: skip
            try:
                ring_loss = _ring(model, batch, group, layout, chunk_multiple(model))
            finally:
                if cfg is None:
                    revert_ring_attention(model)
            ring_err, worst = _grad_error(params, ref, floor, summed=True, group=group)
    finally:
        model.train(training)
        for p, g in saved.items():
            p.grad = g
        if cfg is not None and not any(hasattr(m, CONFIG_ATTR) for m in target.modules()):
            patch.apply(target, cfg)

    loss_error = _rel(ring_loss, ref_loss)
    if own_err is not None:
        allowance = ALLOWANCE.get(dtype, ALLOWANCE[torch.float32])
        loss_bound, grad_bound = FACTOR * own_loss_err + allowance, FACTOR * own_err + allowance
    else:
        loss_bound = grad_bound = WITHOUT_REFERENCE.get(dtype, WITHOUT_REFERENCE[torch.float32])
    return ExactnessReport(
        ok=loss_error <= loss_bound and ring_err <= grad_bound, dtype=dtype, reference_dtype=wide, ranks=world,
        layout=layout, loss=float(ring_loss), reference_loss=float(ref_loss), loss_error=loss_error,
        grad_error=ring_err, worst=worst, loss_bound=loss_bound, grad_bound=grad_bound, model_loss_error=own_loss_err,
        model_grad_error=own_err, parameters=len(ref), note=note,
    )  # fmt: skip


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(model) -> torch.dtype:
    """The dtype most of ``model``'s floating parameters have (a bf16 model's fp32 LoRA adapters aside)."""
    counts: dict = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if not counts:
        raise ValueError("check_exactness: the model has no floating-point parameters")
    return max(counts, key=counts.get)


def _wider(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _same_batch_everywhere(batch, group) -> None:
    """ValueError on every rank unless every rank of ``group`` passed the same batch (a digest of its tensors, one
    small all-gather)."""
    from .comm import RingComm

    digest = hashlib.blake2b(digest_size=7)
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            digest.update(f"{key} {value.dtype} {tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    comm = RingComm(group)
    device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), None)
    mine = [int.from_bytes(digest.digest(), "little")]
    every = comm.all_gather_ints(mine, device=device)
    if any(e != every[0] for e in every):
        raise ValueError(
            "check_exactness: the ranks of the group passed different batches; give every rank the same full batch "
            "(shard_batch cuts each rank's share from it)"
        )


@contextlib.contextmanager
def _cast(model, dtype: torch.dtype):
    """``model``'s floating parameters and buffers in ``dtype`` inside the block; afterwards the very tensors it had
    (nothing is rounded back)."""
    params, buffers, seen = [], [], set()
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and p.is_floating_point() and p.dtype != dtype and id(p) not in seen:
                seen.add(id(p))
                params.append((p, p.data))
                p.data = p.data.to(dtype)
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                buffers.append((module, name, b))
                module._buffers[name] = b.to(dtype)
    try:
        yield
    finally:
        for p, data in params:
            p.data = data
        for module, name, b in buffers:
            module._buffers[name] = b


@contextlib.contextmanager
def _without_router_loss(target):
    """The language-model loss only: ``output_router_logits`` off in the model's configs inside the block."""
    configs = [c for c in {id(c): c for c in (target.config, target.config.get_text_config())}.values()]
    was = [(c, c.output_router_logits) for c in configs if getattr(c, "output_router_logits", False)]
    for c, _ in was:
        c.output_router_logits = False
    try:
        yield
    finally:
        for c, value in was:
            c.output_router_logits = value


def _targets(batch, layout: str) -> tuple[dict, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The batch as one rank's shard of one (the targets and documents ``shard_batch`` derives): ``(shard, targets
    [batch, seq_len], documents or None, number of targets)``."""
    local = shard_for(batch, 0, 1, layout=layout)
    s = batch["input_ids"].shape[1]
    docs = local[DOCUMENT_IDS_KWARG]
    return local, local["shift_labels"][:, :s], None if docs is None else docs[:, :s], local["num_items_in_batch"]


def _reference(model, batch, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """The unmodified model's loss on the whole batch (its cross-entropy in fp32, float64 for a float64 run); its
    gradients left in the parameters' ``grad``."""
    local, targets, docs, count = _targets(batch, layout)
    model.zero_grad(set_to_none=True)
    if docs is not None and bool((docs > 0).any()):  # packed: each document alone, its logits put back in the row
        rows = []
        pos = local["position_ids"][:, : targets.shape[1]]
        for b in range(targets.shape[0]):
            pieces = []
            for d in docs[b].unique_consecutive().tolist():
                where = (docs[b] == d).nonzero().flatten()
                a, e = int(where[0]), int(where[-1]) + 1
                if d < 0:  # padding: no target reads it
                    pieces.append(None)
                    continue
                ids = batch["input_ids"][b : b + 1, a:e]
                pieces.append(model(input_ids=ids, position_ids=pos[b : b + 1, a:e].to(ids.device), use_cache=False))
            like = next(p.logits for p in pieces if p is not None)
            spans = docs[b].unique_consecutive(return_counts=True)[1].tolist()
            rows.append(torch.cat([like.new_zeros(1, n, like.shape[-1]) if p is None else p.logits
                                   for p, n in zip(pieces, spans)], 1))  # fmt: skip
        logits = torch.cat(rows, 0)
    else:
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**kwargs, use_cache=False).logits
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    loss = torch.nn.functional.cross_entropy(
        logits.to(wide).flatten(0, 1), targets.to(logits.device).flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    ) / count.to(logits.device)
    loss.backward()
    return loss.detach().double().cpu()


def _ring(model, batch, group, layout: str, multiple: int) -> torch.Tensor:
    """hf_ring's loss on the whole batch (the group's shares summed); this rank's gradients left in ``grad``."""
    from .batch import reduce_loss, shard_batch

    model.zero_grad(set_to_none=True)
    local = shard_batch(batch, group=group, layout=layout, chunk_multiple=multiple)
    loss = model(**local).loss
    loss.backward()
    return reduce_loss(loss, group=group).double().cpu()


def _rel(x, ref) -> float:
    return abs(float(x) - float(ref)) / max(abs(float(ref)), 1e-30)


def _floor(ref: dict) -> float:
    return FLOOR * max((float(g.double().norm()) for g in ref.values()), default=0.0)


def _grad_error(params: list, ref: dict, floor: float, *, summed: bool = False, group=None) -> tuple[float, str]:
    """The largest relative error of the parameters' gradients (``summed``: their sums over ``group``, one parameter
    at a time, no flat copy of them all) against ``ref``, and that parameter's name. A gradient missing on one side
    counts as zeros; one missing on both is skipped (parameters no token reaches, as a vision tower under a text
    batch)."""
    world = group_rank_and_size(group)[1] if summed else 1
    worst, name = 0.0, "-"
    for n, p in params:
        g = p.grad
        if world > 1:  # (every rank reduces every parameter, in the same order)
            g = torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float()
            dist.all_reduce(g, group=group)
        r = ref.get(n)
        if r is None and (g is None or not bool(g.any())):
            continue
        g = torch.zeros(p.shape, dtype=torch.float64) if g is None else g.detach().double().cpu()
        diff = g if r is None else g - r.double()
        err = float(diff.norm()) / max(0.0 if r is None else float(r.double().norm()), floor, 1e-30)
        if err > worst or name == "-":
            worst, name = err, n
    return worst, name
