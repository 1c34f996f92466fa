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
at most twice the model's own plus an allowance for sums taken in another order (``ALLOWANCE``: the loss within 1e-5
in fp32 and 1e-4 in bf16 / fp16, the gradients within 1e-4 and 5e-3; the test suite's rules). In bf16 the model's
own gradients are about 1e-2 off, so the gradients resolve errors of a few percent and the loss those of about 1e-4.
With ``reference_dtype=None`` there is no yardstick: hf_ring is compared with the unmodified model in its own dtype
(``WITHOUT_REFERENCE``), a coarser verdict for models whose kernels refuse a wider dtype.

The unmodified model reads the batch as Transformers does, the loss is the language-model loss of the targets
``shard_batch`` counts (a target is ignored where the predicting or the predicted token is padding), and packed
documents (restarting ``position_ids`` or ``cu_seq_lens_q``) each run alone, their logits put back in the row: what
the packing collators and flash attention give (Llama 4 counts its attention chunks from the row's start, so a
packed Llama 4 batch differs from that by design). A MoE router's auxiliary loss is switched off for the check
(``output_router_logits``; its exactness is in the test suite). A model whose kernels refuse the wider dtype (the
grouped matrix products of Transformers' MoE experts refuse float64) is compared without a yardstick, and the report
says so (``note``).

The model is in eval mode during the check (dropout would draw other masks in each run) and comes back as it was:
every module's mode, its dtypes, gradients and attention (a model patched by ``apply_ring_attention`` is checked with its settings;
an unpatched one with the arguments given, and unpatched after). Every rank must pass the same batch and hold the same
weights (both checked: a digest of the batch and of the parameters' names and shapes, exact sums of each parameter's
bit patterns).
Memory: each rank runs the whole batch, so check at a length one device holds (the configuration is checked, not the
length), and holds the weights in the wider dtype during that run, and both runs' gradients on the CPU. The check
runs in the dtype the model's weights have: call it outside ``torch.autocast`` (under autocast the yardstick would be
autocast too); a model trained with Accelerate's ``mixed_precision="bf16"`` (fp32 weights) is checked in fp32.
A rank that fails in the unmodified model's runs makes every rank raise (none waits in a collective), and the
errors reported are the largest over the group, so every rank gets the same verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math

import torch
import torch.distributed as dist

from .batch import IGNORE_INDEX, TOKEN_TYPE_KEYS, shard_for
from .comm import group_rank_and_size
from .hf_attention import ATTN_IMPLEMENTATION, DOCUMENT_IDS_KWARG
from .ring_config import CONFIG_ATTR

__all__ = ["ExactnessReport", "check_exactness"]

FACTOR = 2.0
"""hf_ring's error may be twice the unmodified model's own (STYLE.md's low-precision rule, for every dtype here)."""
_HALF = (1e-4, 5e-3)
ALLOWANCE = {torch.float32: (1e-5, 1e-4), torch.float16: _HALF, torch.bfloat16: _HALF, torch.float64: (1e-5, 1e-5)}
"""Added to the bounds of the loss and of the gradients, for sums taken in another order, equally valid: the test
suite's (``tests/test_hf_parity.py``: fp32 within 1e-5, most families; bf16 within 2x the model's own error plus 1e-4
for the loss, 1e-3 for the gradients; here 1e-4 for fp32 gradients, as ``tests/test_properties.py`` allows rows that
see a few keys, and 5e-3 for bf16 ones). A float64 model's loss is Transformers' cross-entropy, taken in fp32."""
WITHOUT_REFERENCE = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 5e-2), torch.bfloat16: (1e-3, 5e-2),
                     torch.float64: (1e-5, 1e-5)}  # fmt: skip
"""The bounds without a yardstick: hf_ring against the unmodified model in the same dtype, both rounded (in bf16 each
is about 1e-2 off in its gradients, so they may be twice that apart)."""
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
    timeout: float | None = None, chunk_multiple: int | None = None, reference_dtype="wider",
) -> ExactnessReport:  # fmt: skip
    """Check hf_ring against the unmodified model on ``model`` and ``batch``; every rank of ``group`` calls it.

    Args:
        model: a Transformers model of a supported family or a PEFT model wrapping one, not wrapped by DDP, FSDP or
            DeepSpeed (every rank runs the whole model), on this rank's device; patched by ``apply_ring_attention``
            (its settings are used: leave ``group``, ``layout``, ``backend``, ``ulysses_size`` and ``timeout``
            unset) or not.
        batch: a collator's full batch with ``labels``, as ``shard_batch`` takes it, the same on every rank.
        group, layout, backend, ulysses_size, timeout: as for ``apply_ring_attention`` (defaults: the world,
            zig-zag, auto, the pure ring, the group's timeout).
        chunk_multiple: as for ``shard_batch``; None: ``hf_ring.chunk_multiple(model)``.
        reference_dtype: the yardstick's dtype: ``"wider"`` (float64 for an fp32 model, fp32 otherwise), a
            ``torch.dtype``, or None (no yardstick; see the module).

    Returns:
        an ``ExactnessReport``, the same on every rank (``report.ok``; print it for the figures).
    """
    from .apply import apply_ring_attention, revert_ring_attention, unwrap_transformers_model
    from .comm import RingComm
    from .compressed import chunk_multiple as model_multiple
    from .patches import get_patch
    from .patches._family import FALLBACK_ATTN_IMPLEMENTATION, _switch

    target = unwrap_transformers_model(model)
    cfg = next((getattr(m, CONFIG_ATTR) for m in target.modules() if hasattr(m, CONFIG_ATTR)), None)
    given = {"group": group, "layout": layout, "backend": backend, "ulysses_size": ulysses_size, "timeout": timeout}
    if cfg is not None and any(v is not None for v in given.values()):
        raise ValueError(
            "check_exactness: the model is patched by apply_ring_attention, whose settings the check uses; leave "
            f"{', '.join(k for k, v in given.items() if v is not None)} unset (or check the model before applying)"
        )
    group = cfg.group if cfg is not None else group
    layout = cfg.layout if cfg is not None else layout or "zigzag"
    timeout = cfg.timeout if cfg is not None else timeout
    comm = RingComm(group, timeout=timeout)
    problem = dtype = wide = None
    try:  # (what one rank alone may see: every rank learns of it in the batch's all-gather below, none waits)
        dtype, wide = _check_inputs(model, batch, reference_dtype, comm)
    except ValueError as e:
        problem = e
    _same_batch_everywhere(batch if problem is None else {}, comm, problem)
    _same_weights_everywhere(model, comm)
    whole = _targets(batch, layout)  # (the reference's targets and documents, for every run of it)
    if int(whole[3]) == 0:  # (the same batch everywhere: the same on every rank)
        raise ValueError("check_exactness: the batch has no target to check (every label ignored or padding)")

    saved = {p: p.grad for p in model.parameters()}
    modes = {m: m.training for m in model.modules()}
    patch = get_patch(getattr(target.config, "model_type", None))
    # loaded with attn_implementation="hf_ring" but not patched: the unmodified model's runs take the fallback
    loaded = cfg is None and target.config.get_text_config()._attn_implementation == ATTN_IMPLEMENTATION
    if cfg is not None:
        revert_ring_attention(model)
    try:
        if loaded:
            _switch(target, FALLBACK_ATTN_IMPLEMENTATION)
        model.eval()
        with _without_router_loss(target):
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            own = yardstick = failure = None
            note = ""
            try:  # 1. the unmodified model in its dtype; 2. in the wider one (their gradients on the CPU)
                own = _reference(model, batch, whole, dtype), _cpu_grads(params)
                if wide is not None:
                    try:
                        with _cast(model, wide):
                            yardstick = _reference(model, batch, whole, wide), _cpu_grads(params)
                    except torch.OutOfMemoryError:
                        raise
                    except (RuntimeError, NotImplementedError, TypeError) as e:  # a kernel without that dtype
                        note = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            except Exception as e:  # (raised below, once every rank knows: none waits in a collective)
                failure = e
            # every rank learns whether any failed (then each raises), whether each had its yardstick, and why not
            flags = comm.all_gather_ints([int(failure is not None), int(yardstick is not None), *_text_ints(note)])
            if failure is not None:
                raise failure
            if any(f[0] for f in flags):
                failed = [r for r, f in enumerate(flags) if f[0]]
                raise RuntimeError(f"check_exactness: rank(s) {failed} of the group failed in the unmodified model's "
                                   "runs; see their errors")  # fmt: skip
            if wide is not None and not all(f[1] for f in flags):
                refused = [r for r, f in enumerate(flags) if not f[1]]
                why = _ints_text(flags[refused[0]][2:])  # (the first refusing rank's reason, the same note everywhere)
                note = f"the unmodified model refused {_name(wide)} on rank(s) {refused} ({why}): no yardstick"
                yardstick, wide = None, None
            (ref_loss, grads), model_errors = (yardstick, own) if yardstick is not None else (own, None)
            ref = {n: g for n, g in grads.items() if g is not None}
            floor = FLOOR * max((float(g.norm()) for g in ref.values()), default=0.0)
            # 3. hf_ring
            if cfg is not None:
                patch.apply(target, cfg)
            else:
                apply_ring_attention(model, group=group, layout=layout, backend=backend or "auto",
                                     ulysses_size=ulysses_size, timeout=timeout)  # fmt: skip
            try:
                multiple = model_multiple(model) if chunk_multiple is None else chunk_multiple
                ring_loss = _ring(model, batch, group, layout, multiple)
            finally:
                if cfg is None:
                    revert_ring_attention(model)
            ring_err, worst = _largest_error(_summed(params, group), ref, floor)
    finally:
        for m, mode in modes.items():
            m.training = mode
        for p, g in saved.items():
            p.grad = g
        if cfg is not None and not any(hasattr(m, CONFIG_ATTR) for m in target.modules()):
            patch.apply(target, cfg)
        if loaded:
            _switch(target, ATTN_IMPLEMENTATION)

    errors = [_rel(ring_loss, ref_loss), ring_err]
    if model_errors is not None:
        own_loss, own_grads = model_errors
        errors += [_rel(own_loss, ref_loss), _largest_error(own_grads.items(), ref, floor)[0]]
    # the largest over the group: every rank reports the same (kernels that do not repeat themselves bit for bit)
    errors = comm.all_reduce_max(torch.tensor(errors, dtype=torch.float64), what="the check's errors").tolist()
    loss_error, ring_err, *own_errors = errors
    loss_allowance, grad_allowance = ALLOWANCE.get(dtype, ALLOWANCE[torch.float32])
    if own_errors:
        loss_bound = FACTOR * own_errors[0] + loss_allowance
        grad_bound = FACTOR * own_errors[1] + grad_allowance
    else:
        loss_bound, grad_bound = WITHOUT_REFERENCE.get(dtype, WITHOUT_REFERENCE[torch.float32])
    ok = math.isfinite(loss_error + ring_err) and loss_error <= loss_bound and ring_err <= grad_bound
    return ExactnessReport(
        ok=ok, dtype=dtype, reference_dtype=wide, ranks=comm.world_size, layout=layout, loss=float(ring_loss),
        reference_loss=float(ref_loss), loss_error=loss_error,
        grad_error=ring_err, worst=worst, loss_bound=loss_bound, grad_bound=grad_bound,
        model_loss_error=own_errors[0] if own_errors else None, model_grad_error=own_errors[1] if own_errors else None,
        parameters=len(ref), note=note,
    )  # fmt: skip


_NOTE_BYTES = 192


def _text_ints(text: str) -> list[int]:
    """``text``'s first ``_NOTE_BYTES`` UTF-8 bytes as ints, padded with zeros (to travel in an all-gather of ints)."""
    raw = text.encode()[:_NOTE_BYTES]
    return [*raw, *[0] * (_NOTE_BYTES - len(raw))]


def _ints_text(values) -> str:
    """The text ``_text_ints`` made (a character cut in two at the end dropped)."""
    return bytes(v for v in values if v).decode(errors="ignore")


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


def _check_inputs(model, batch, reference_dtype, comm) -> tuple[torch.dtype, torch.dtype | None]:
    """``(the model's dtype, the yardstick's dtype or None)``; ValueError for what the check cannot take."""
    if not isinstance(batch, dict) or batch.get("labels") is None:
        raise ValueError("check_exactness needs a batch (a dict, as a collator returns it) with labels")
    dtype = _dtype(model)
    wide = _wider(dtype) if isinstance(reference_dtype, str) and reference_dtype == "wider" else reference_dtype
    if wide is not None and not (isinstance(wide, torch.dtype) and wide.is_floating_point):
        raise ValueError(f"reference_dtype must be 'wider', a floating torch.dtype or None, got {reference_dtype!r}")
    narrower = wide is not None and torch.finfo(wide).eps > torch.finfo(dtype).eps
    if narrower or (wide == dtype and dtype != torch.float64):  # (the same dtype: the model's own run again)
        raise ValueError(f"reference_dtype {_name(wide)} is not wider than the model's {_name(dtype)}: no yardstick "
                         "(reference_dtype=None compares with the model in its own dtype, by a coarser rule)")  # fmt: skip
    sharded = _sharded(model)
    if sharded:
        raise ValueError(f"check_exactness runs the whole model on every rank, but {sharded}: check the model before "
                         "FSDP2 or DeepSpeed shard it (before prepare / train; with ZeRO-3, before zero.Init)")  # fmt: skip
    device = next(model.parameters()).device
    if comm.world_size > 1 and dist.get_backend(comm.group) == "nccl" and device.type != "cuda":
        raise ValueError(f"check_exactness: the model is on {device}, but the group's backend is NCCL, which "
                         "communicates GPU tensors only: move the model (and the batch) to this rank's GPU first")  # fmt: skip
    return dtype, wide


def _same_batch_everywhere(batch, comm, problem: Exception | None = None) -> None:
    """ValueError on every rank unless every rank of ``comm``'s group passed the same batch (a digest of its tensors,
    one small all-gather); ``problem``, this rank's error with its input, raised here after that all-gather, and
    the other ranks raise naming this one."""
    digest = hashlib.blake2b(digest_size=7)
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            digest.update(f"{key} {value.dtype} {tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), None)
    mine = [int(problem is not None), int.from_bytes(digest.digest(), "little")]
    every = comm.all_gather_ints(mine, device=device)
    if problem is not None:
        raise problem
    if any(e[0] for e in every):
        refused = [r for r, e in enumerate(every) if e[0]]
        raise ValueError(f"check_exactness: rank(s) {refused} of the group refused their input; see their errors")
    if any(e[1] != every[0][1] for e in every):
        raise ValueError(
            "check_exactness: the ranks of the group passed different batches; give every rank the same full batch "
            "(shard_batch cuts each rank's share from it)"
        )


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_sums(p: torch.Tensor, chunk: int = 1 << 24) -> list[int]:
    """Two sums of ``p``'s bit patterns as integers (plain, and weighted by position modulo 65521), exact and in any
    order the same (int64, wrapping), over chunks of ``chunk`` elements (no full-size copy)."""
    flat = p.detach().reshape(-1)
    bits = flat.view(_INTS[flat.element_size()]) if flat.is_floating_point() else flat
    plain = weighted = 0
    for start in range(0, bits.numel(), chunk):
        x = bits[start : start + chunk].to(torch.int64)
        w = torch.arange(start, start + x.numel(), device=x.device).remainder_(65521).add_(1)
        plain += int(x.sum())
        weighted += int((x * w).sum())
    wrap = lambda v: (v + (1 << 63)) % (1 << 64) - (1 << 63)  # noqa: E731 - (int64, as the tensors' sums wrap)
    return [wrap(plain), wrap(weighted)]


def _same_weights_everywhere(model, comm) -> None:
    """ValueError on every rank unless every rank of ``comm``'s group holds the same parameters (names and shapes: a
    digest, one all-gather) with the same values (two exact sums of each one's bit patterns, their largest and
    smallest over the group: two all-reduces). A rank that fails to read its weights (out of memory, say) makes every
    rank raise. Parameters sharded by FSDP2 or DeepSpeed ZeRO-3 are refused before (the same on every rank)."""
    if comm.world_size == 1:
        return
    names, sums, failure = [], [], None
    digest = hashlib.blake2b(digest_size=7)
    try:
        for n, p in model.named_parameters():
            names.append(n)
            digest.update(f"{n} {p.dtype} {tuple(p.shape)};".encode())
            sums.append(_bit_sums(p))
    except Exception as e:  # (raised below, once every rank knows: none waits in a collective)
        failure = e
    every = comm.all_gather_ints([int(failure is not None), int.from_bytes(digest.digest(), "little")])
    if failure is not None:
        raise failure
    if any(e[0] for e in every):
        raise RuntimeError(f"check_exactness: rank(s) {[r for r, e in enumerate(every) if e[0]]} of the group "
                           "failed to read their weights; see their errors")  # fmt: skip
    if any(e[1] != every[0][1] for e in every):
        raise ValueError("check_exactness: the ranks of the group hold models of different parameters (names, "
                         "dtypes or shapes): give every rank the same model")  # fmt: skip
    mine = torch.tensor(sums, dtype=torch.int64).reshape(-1, 2)
    high = comm.all_reduce_max(mine, what="the check of the weights")
    low = -comm.all_reduce_max(-mine, what="the check of the weights")
    differ = [n for n, h, lo in zip(names, high, low) if not torch.equal(h, lo)]
    if differ:
        raise ValueError(
            f"check_exactness: the ranks of the group hold different weights ({len(differ)} parameter(s), first "
            f"{differ[0]}): give every rank the same model (LoRA adapters, for one, are initialised from each "
            "process's random state: call transformers.set_seed(seed) before creating them)"
        )


def _sharded(model) -> str | None:
    """Why ``model``'s parameters are not whole on this rank (FSDP2's DTensors, DeepSpeed ZeRO-3's partitions), or
    None."""
    for n, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return f"{n} is sharded by FSDP2 (a DTensor)"
        if hasattr(p, "ds_id"):
            return f"{n} is partitioned by DeepSpeed ZeRO"
    return None


@contextlib.contextmanager
def on_device(model, batch: dict, device: torch.device):
    """``batch`` on ``device`` inside the block, and ``model`` too unless FSDP2 or DeepSpeed ZeRO-3 shard it; the model
    back where it was afterwards. For the Trainer and the plugin, whose model stays on the CPU until FSDP or DeepSpeed
    place it in ``train`` / ``prepare``: the check runs on the device (and kernels) training will use."""
    device = torch.device(device)
    was = next(model.parameters()).device
    moved = was != device and was.type != "meta" and _sharded(model) is None
    if moved:
        model.to(device)
    try:
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in dict(batch).items()}
    finally:
        if moved:
            model.to(was)


@contextlib.contextmanager
def _cast(model, dtype: torch.dtype):
    """``model``'s floating parameters and buffers in ``dtype`` inside the block; afterwards the very tensors it had
    (nothing is rounded back)."""
    params, buffers, seen = [], [], set()
    try:  # (a cast that fails half way, out of memory say, gives back what it had cast)
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and p.is_floating_point() and p.dtype != dtype and id(p) not in seen:
                    seen.add(id(p))
                    data = p.data
                    p.data = data.to(dtype)
                    params.append((p, data))
            for name, b in module._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    module._buffers[name] = b.to(dtype)
                    buffers.append((module, name, b))
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


def _reference(model, batch, whole: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The unmodified model's loss on the whole batch (its cross-entropy in fp32, float64 for a float64 run); its
    gradients left in the parameters' ``grad``. ``whole``: the batch's ``_targets``."""
    local, targets, docs, count = whole
    model.zero_grad(set_to_none=True)
    if docs is not None and bool((docs > 0).any()):  # packed: each document alone, its logits put back in the row
        pos = local["position_ids"][:, : targets.shape[1]]
        per_token = [k for k in TOKEN_TYPE_KEYS if isinstance(batch.get(k), torch.Tensor)]
        pieces = []  # per row, per run of one document: its logits, or the run's length for padding
        for b in range(targets.shape[0]):
            row = []
            ids, counts = docs[b].unique_consecutive(return_counts=True)
            a = 0
            for d, n in zip(ids.tolist(), counts.tolist()):
                if d < 0:  # padding: no target reads it
                    row.append(n)
                else:
                    tokens = batch["input_ids"][b : b + 1, a : a + n]
                    extra = {k: batch[k][b : b + 1, a : a + n] for k in per_token}
                    pos_ = pos[b : b + 1, a : a + n].to(tokens.device)
                    row.append(model(input_ids=tokens, position_ids=pos_, use_cache=False, **extra).logits)
                a += n
            pieces.append(row)
        like = next(x for row in pieces for x in row if isinstance(x, torch.Tensor))  # (the batch has a target)
        logits = torch.cat(
            [torch.cat([x if isinstance(x, torch.Tensor) else like.new_zeros(1, x, like.shape[-1]) for x in row], 1)
             for row in pieces]
        )  # fmt: skip
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
    err = abs(float(x) - float(ref)) / max(abs(float(ref)), 1e-30)
    return err if math.isfinite(err) else math.inf  # (NaN: infinitely wrong, and max-reduced as such)


def _cpu_grads(params: list) -> dict:
    """The parameters' gradients now, float64 on the CPU (None where a parameter has none: the indexers Transformers
    runs without gradients, a vision tower a text batch does not reach)."""
    return {n: None if p.grad is None else p.grad.detach().to("cpu", torch.float64) for n, p in params}


def _summed(params: list, group):
    """``(name, gradient summed over group)`` per parameter, one parameter at a time (no flat copy of them all; every
    rank reduces every parameter in the same order), in the wider of its dtype and fp32."""
    _, world = group_rank_and_size(group)
    for n, p in params:
        g = p.grad
        if world > 1:
            wide = torch.promote_types(p.dtype, torch.float32)
            g = torch.zeros_like(p, dtype=wide) if g is None else g.detach().to(wide)
            dist.all_reduce(g, group=group)
        yield n, g


def _largest_error(grads, ref: dict, floor: float) -> tuple[float, str]:
    """The largest relative error of ``grads`` (``(name, gradient)`` pairs) against ``ref``, and that parameter's name:
    the norm of the difference over the reference's norm or ``floor``, whichever is larger. A gradient missing on one
    side counts as zeros; one missing (or zero) on both sides is skipped (a parameter no token reaches, as a vision
    tower under a text batch)."""
    worst, name = 0.0, "-"
    for n, g in grads:
        r = ref.get(n)
        if r is None and (g is None or not bool(g.any())):
            continue
        g = None if g is None else g.detach().to("cpu", torch.float64)
        diff = r if g is None else g if r is None else g - r
        err = float(diff.norm()) / max(0.0 if r is None else float(r.norm()), floor, 1e-30)
        err = err if math.isfinite(err) else math.inf  # (a NaN gradient is the worst, never passed over)
        if err > worst or name == "-":
            worst, name = err, n
    return worst, name
