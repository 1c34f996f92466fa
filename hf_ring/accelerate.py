"""``RingAttentionPlugin``: context parallelism (ring attention) for an ``accelerate launch`` training script.

Groups: the world of ``world_size = dp_size x cp_size`` processes is a 2-D ``DeviceMesh`` with dims
``("dp", "cp")``; consecutive ranks form a context-parallel (CP) group (ranks ``0..cp-1`` are CP group 0,
the first data-parallel replica), and ranks with the same CP rank form a data-parallel (DP) group.

What ``plugin.prepare(accelerator, ...)`` does, and why the result equals plain data parallelism:

- models get ring attention over their CP group (``hf_ring.apply_ring_attention``);
- each DataLoader is prepared exactly as Accelerate would for ``dp_size`` processes, with process
  index ``dp_rank`` (so DP group d sees what process d of a plain run sees, in order, and every rank
  of a CP group sees the same batch), and its collate function then keeps this rank's zig-zag shard
  (``hf_ring.shard_batch``);
- everything else goes through ``accelerator.prepare`` unchanged (DDP, optimizer, mixed precision);
- gradients: each rank's loss is its share of its CP group's loss, so the reduction (DDP, FSDP2 or
  DeepSpeed ZeRO 0-3) is made to sum the CP shares and average the DP replicas, and LR schedulers step
  like a plain ``dp_size``-process run (``hf_ring.engines``, which says how for each engine).

Accelerate's own ``ParallelismConfig`` (``parallelism_config`` in the accelerate config): its
``cp_size`` is the CP size (the plugin's must agree or be None), its mesh puts consecutive ranks in a
CP group as hf_ring does, and ring attention runs in place of Accelerate's SDPA-only context
parallelism (whose hooks ``prepare`` skips; ``accelerator.maybe_context_parallel`` becomes a no-op,
the batches being sharded already).

Supported: no distribution, DDP, FSDP2 and DeepSpeed ZeRO 0-3 on CPU (gloo) and GPU (NCCL), gradient
accumulation, Accelerate mixed precision and FSDP2 mixed-precision policies, a ``ParallelismConfig``
with dp_shard and cp sizes. FSDP1, Megatron-LM, XLA, tp / sp sizes and HSDP with CP are refused with
an error (their gradient reduction would average the CP shares instead of summing them, or they were
not tested).

Structure: ``RingAttentionPlugin`` is the frozen, validated configuration; ``plugin.check(accelerator)``
validates an Accelerator without communicating; ``plugin.setup(accelerator)`` returns a frozen
``RingSetup`` (sizes, ranks, mesh, groups, engine). The integrations are functions over it, one per
concern: ``apply_to_model``, ``prepare_data_loader`` / ``reshard_prepared_data_loader`` /
``shard_collate`` (data), ``reduce_gradients`` (DDP hook, FSDP2 or DeepSpeed), ``data_parallel_scheduler``,
``reduce_loss``, and ``prepare`` (all of them for ``accelerator.prepare``'s objects); the engine adapters
live in ``hf_ring.engines``.
``plugin.prepare(accelerator, ...)`` is ``check`` + ``setup`` + ``prepare``.

Configuration enters here only: arguments, or the environment variables ``HF_RING_CP_SIZE``,
``HF_RING_LAYOUT``, ``HF_RING_BACKEND``, ``HF_RING_ULYSSES_SIZE``, ``HF_RING_TIMEOUT``, ``HF_RING_CHUNKED_LOSS``,
``HF_RING_LOSS_BACKEND`` and ``HF_RING_OFFLOAD_ACTIVATIONS`` for the arguments left as None (read at
construction).

Memory: models get the chunked loss by default (``chunked_loss=True``, ``hf_ring.apply_chunked_loss``):
with labels they compute the loss without the ``[tokens, vocab]`` logits and return ``logits=None``.
``offload_activations=True`` also keeps the inputs of the checkpointed layers in pinned host memory
(``hf_ring.apply_activation_offload``; needs activation checkpointing).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .apply import unwrap_transformers_model
from .batch import check_chunk_multiple
from .engines import (
    check_ddp_reaches_every_parameter,
    data_parallel_scheduler,
    engine_of,
    fill_deepspeed_micro_batch,
    reduce_gradients,
    without_accelerate_cp,
)
from .hf_attention import RingConfig
from .layout import check_layout
from .loss import check_chunk_size, check_loss_backend

__all__ = [
    "ENV_BACKEND", "ENV_CHUNKED_LOSS", "ENV_CP_SIZE", "ENV_LAYOUT", "ENV_LOSS_BACKEND", "ENV_OFFLOAD_ACTIVATIONS",
    "ENV_TIMEOUT", "ENV_ULYSSES_SIZE", "RingAttentionPlugin", "RingSetup", "apply_to_model",
    "data_parallel_scheduler", "prepare", "prepare_data_loader", "reduce_gradients", "reduce_loss",
    "reshard_prepared_data_loader", "shard_collate",
]  # fmt: skip

ENV_CP_SIZE = "HF_RING_CP_SIZE"
ENV_LAYOUT = "HF_RING_LAYOUT"
ENV_BACKEND = "HF_RING_BACKEND"
ENV_ULYSSES_SIZE = "HF_RING_ULYSSES_SIZE"
ENV_TIMEOUT = "HF_RING_TIMEOUT"
ENV_CHUNKED_LOSS = "HF_RING_CHUNKED_LOSS"
ENV_LOSS_BACKEND = "HF_RING_LOSS_BACKEND"
ENV_OFFLOAD_ACTIVATIONS = "HF_RING_OFFLOAD_ACTIVATIONS"


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer; set it to the context-parallel size, e.g. {name}=2"
        ) from None


def _env_seconds(name: str) -> float | None:
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


def _env_ulysses():
    raw = (os.environ.get(ENV_ULYSSES_SIZE) or "").strip().lower()
    if raw in ("", "auto"):
        return 1 if raw == "" else "auto"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV_ULYSSES_SIZE}={raw!r} is not an integer or 'auto'") from None


def _env_flag(name: str, default: bool) -> bool:
    raw = (os.environ.get(name) or "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; set it to 1 or 0")


def _check_supported_model(model) -> None:
    from .patches import get_patch

    target = unwrap_transformers_model(model)
    if target is None:
        raise TypeError(
            f"RingAttentionPlugin.prepare got a model of type {type(model).__name__}; hf_ring patches transformers "
            "PreTrainedModel (of a family in hf_ring.patches.supported_model_types()) or peft PeftModel wrapping one. "
            "Pass the model before "
            "accelerator.prepare (not a DDP/FSDP-wrapped one)"
        )
    get_patch(getattr(target.config, "model_type", None))  # ValueError naming the supported families


class _ShardCollate:
    """A DataLoader collate function: the wrapped collator's full batch -> this rank's ``shard_batch`` shard.

    It holds this rank's place in its CP group as numbers, not the group: sharding communicates nothing, so it runs
    in the main process and in DataLoader workers of every start method (``fork``; ``spawn`` and ``forkserver``,
    the default from Python 3.14, pickle it, and the wrapped collator with it).
    """

    def __init__(self, collate_fn, cp_rank: int, cp_size: int, layout: str, pad_to_multiple: bool, chunks=None):
        self.collate_fn = collate_fn
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.layout = layout
        self.pad_to_multiple = pad_to_multiple
        self.chunks = chunks if chunks is not None else _ChunkMultiple(1)

    def __call__(self, features):
        from .batch import shard_for

        batch = self.collate_fn(features)
        return shard_for(
            dict(batch), self.cp_rank, self.cp_size, layout=self.layout, pad_to_multiple=self.pad_to_multiple,
            chunk_multiple=self.chunks.value,
        )  # fmt: skip


class _ChunkMultiple:
    """The ``chunk_multiple`` a setup's batches are padded to (``hf_ring.shard_batch``): the plugin's, else the lcm of
    those of the models it prepared (``hf_ring.chunk_multiple``, 1 but for DeepSeek-V4). Read when a batch is
    sharded, so a loader prepared before its model pads by the model's too (a worker's copy is taken when the loader
    starts its workers)."""

    def __init__(self, value: int | None):
        self.fixed = value is not None
        self.value = value if value is not None else 1

    def add(self, model) -> None:
        from .compressed import chunk_multiple

        if not self.fixed:
            self.value = math.lcm(self.value, chunk_multiple(model))


def _set_collate(loader, collate_fn) -> None:
    """Set the collate function of a prepared loader (on the wrapped DataLoader of Accelerate's adapters)."""
    getattr(loader, "base_dataloader", loader).collate_fn = collate_fn


@dataclasses.dataclass(frozen=True)
class RingSetup:
    """What ``RingAttentionPlugin.setup`` built for one Accelerator: sizes, ranks, mesh and groups (frozen).

    Every adapter of this module is a function over it. ``engine`` is ``"ddp"``, ``"fsdp2"``, ``"deepspeed"`` or ``"none"``
    (one process or cp_size = world without DDP wrapping). ``dp_size = world_size // cp_size``; this rank
    is ``cp_rank`` in its CP group (consecutive ranks) and ``dp_rank`` among the replicas.
    """

    plugin: RingAttentionPlugin
    world_size: int
    rank: int
    cp_size: int
    engine: str
    mesh: Any = dataclasses.field(default=None, repr=False)
    cp_group: Any = dataclasses.field(default=None, repr=False)
    dp_group: Any = dataclasses.field(default=None, repr=False)
    loss_counts: _LossCounts = dataclasses.field(default_factory=lambda: _LossCounts(), repr=False, compare=False)
    chunks: _ChunkMultiple = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.chunks is None:
            object.__setattr__(self, "chunks", _ChunkMultiple(self.plugin.chunk_multiple))

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def layout(self) -> str:
        return self.plugin.layout


class _LossCounts:
    """The number of valid targets a patched model saw in its last forward (for ``reduce_loss``)."""

    def __init__(self):
        self.last = None
        self.hooked: set = set()

    def __call__(self, module, args, kwargs) -> None:
        n = kwargs.get("num_items_in_batch")
        if n is not None:
            self.last = n


@dataclasses.dataclass(frozen=True)
class RingAttentionPlugin:
    """Context parallelism for Accelerate: CP x DP groups, zig-zag data sharding, exact loss and gradients.

    Args:
        cp_size: ranks per context-parallel group; must divide the number of processes. None: the
            environment variable ``HF_RING_CP_SIZE``, else every process (one CP group, no DP).
        layout: ``"zigzag"`` (default), ``"striped"`` or ``"contiguous"``. None: ``HF_RING_LAYOUT`` or zigzag.
        backend: local attention kernel: ``"auto"``, ``"torch"``, ``"triton"``, ``"sdpa"``, ``"cudnn"``,
            ``"flash_attn"``.
            None: ``HF_RING_BACKEND`` or auto.
        ulysses_size: the Ulysses x Ring hybrid inside each CP group (``hf_ring.apply_ring_attention``): U
            consecutive ranks exchange heads for sequence, the ring runs across the cp_size / U groups; an
            int, ``"auto"`` (the largest U that divides cp_size and the query heads inside one node), or
            None: ``HF_RING_ULYSSES_SIZE`` (an int or ``auto``), else 1 (the pure ring).
        timeout: seconds a rank waits inside the ring for a peer (CPU / gloo) before it raises, naming the ring
            step and the peer (``hf_ring.apply_ring_attention``). None: ``HF_RING_TIMEOUT``, else the process
            group's own timeout.
        pad_to_multiple: pad each batch's sequence to the layout's multiple (2 x cp_size for zigzag) times
            ``chunk_multiple`` with ignored tokens; if False, other lengths raise.
        chunk_multiple: with cp_size > 1, each chunk of the layout holds a multiple of this many tokens
            (``hf_ring.shard_batch``). None: what the prepared models need (``hf_ring.chunk_multiple``: the lcm
            of DeepSeek-V4's compress rates, 1 for other families).
        chunked_loss: compute the loss chunk by chunk of tokens, never holding the [tokens, vocab] logits
            (``hf_ring.apply_chunked_loss``; outputs with labels then have ``logits=None``). None:
            ``HF_RING_CHUNKED_LOSS`` (``0`` turns it off), else on. A model whose forward another library
            already replaced (TRL's fused LM head) keeps that one.
        loss_chunk_size: tokens per chunk of the chunked loss (None: one chunk's fp32 logits within 256 MiB).
        loss_backend: ``"torch"`` (default) or ``"liger"`` (Liger-Kernel's fused linear cross-entropy, CUDA;
            see ``hf_ring.apply_chunked_loss``). None: ``HF_RING_LOSS_BACKEND`` or torch.
        offload_activations: keep the inputs the checkpointed layers save for the backward in pinned host
            memory (``hf_ring.apply_activation_offload``; the model must train with activation
            checkpointing). None: ``HF_RING_OFFLOAD_ACTIVATIONS`` (``1`` turns it on), else off.

    The configuration is frozen and validated at construction (the environment is read there and only
    there). ``check(accelerator)`` validates an Accelerator without communicating; ``setup(accelerator)``
    builds the groups and returns a frozen ``RingSetup``; ``prepare`` does both and prepares the objects.
    After ``prepare`` the plugin also answers for that setup: ``ring``, ``cp_group``, ``dp_group``,
    ``device_mesh``, ``cp_rank``, ``dp_rank``, ``dp_size``, ``world_size``, ``reduce_loss(loss)``.
    """

    cp_size: int | None = None
    layout: str | None = None
    backend: str | None = None
    ulysses_size: int | str | None = None
    timeout: float | None = None
    pad_to_multiple: bool = True
    chunk_multiple: int | None = None
    chunked_loss: bool | None = None
    loss_chunk_size: int | None = None
    loss_backend: str | None = None
    offload_activations: bool | None = None
    _setups: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        resolved = {
            "cp_size": self.cp_size if self.cp_size is not None else _env_int(ENV_CP_SIZE),
            "layout": self.layout if self.layout is not None else (os.environ.get(ENV_LAYOUT) or "zigzag"),
            "backend": self.backend if self.backend is not None else (os.environ.get(ENV_BACKEND) or "auto"),
            "ulysses_size": self.ulysses_size if self.ulysses_size is not None else _env_ulysses(),
            "timeout": self.timeout if self.timeout is not None else _env_seconds(ENV_TIMEOUT),
            "chunked_loss": self.chunked_loss if self.chunked_loss is not None else _env_flag(ENV_CHUNKED_LOSS, True),
            "loss_backend": self.loss_backend
            if self.loss_backend is not None
            else (os.environ.get(ENV_LOSS_BACKEND) or "torch"),
            "offload_activations": self.offload_activations
            if self.offload_activations is not None
            else _env_flag(ENV_OFFLOAD_ACTIVATIONS, False),
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        if self.cp_size is not None and (isinstance(self.cp_size, bool) or not isinstance(self.cp_size, int)):
            raise TypeError(f"cp_size must be an int or None, got {self.cp_size!r}")
        if self.cp_size is not None and self.cp_size < 1:
            raise ValueError(f"cp_size must be at least 1, got {self.cp_size} (set cp_size or {ENV_CP_SIZE})")
        check_layout(self.layout)
        RingConfig(timeout=self.timeout)  # validates the timeout
        u = self.ulysses_size
        if u != "auto" and (isinstance(u, bool) or not isinstance(u, int) or u < 1):
            raise ValueError(
                f"ulysses_size must be a positive int or 'auto', got {u!r} (set ulysses_size or {ENV_ULYSSES_SIZE})"
            )
        if isinstance(u, int) and self.cp_size is not None and self.cp_size % u:
            raise ValueError(
                f"ulysses_size={u} does not divide cp_size={self.cp_size}: choose a divisor of {self.cp_size}"
            )
        RingConfig(layout=self.layout, backend=self.backend)  # validates the backend name
        for name in ("chunked_loss", "offload_activations"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        check_chunk_multiple(self.chunk_multiple, optional=True)
        check_chunk_size(self.loss_chunk_size, "loss_chunk_size")
        check_loss_backend(self.loss_backend, "loss_backend")

    # ---- checks (no communication) and setup ---------------------------------------------------

    def validate(self, world_size: int) -> int:
        """The CP size for ``world_size`` processes; ValueError (before any collective) if it does not fit."""
        cp = world_size if self.cp_size is None else self.cp_size
        if world_size % cp:
            raise ValueError(
                f"cp_size={cp} does not divide the number of processes {world_size}: the world is split into "
                f"dp x cp groups of consecutive ranks. Choose a cp_size that divides {world_size} (set cp_size or "
                f"{ENV_CP_SIZE}), or launch a multiple of {cp} processes (accelerate launch --num_processes)"
            )
        return cp

    def check(self, accelerator) -> int:
        """Validate ``accelerator`` (sizes, distributed type, parallelism config) without communicating; the CP size."""
        world = int(accelerator.num_processes)
        engine = engine_of(accelerator)  # raises for what is not supported
        pc = getattr(accelerator, "parallelism_config", None)
        cp = self.validate(world) if pc is None else self._cp_of_parallelism_config(pc, engine, world)
        if cp > 1 and world == 1:
            raise ValueError(
                f"cp_size={cp} needs {cp} processes but this is a single process; launch with "
                f"accelerate launch --num_processes {cp} (or a multiple of it)"
            )
        return cp

    def _cp_of_parallelism_config(self, pc, engine: str, world: int) -> int:
        """The CP size of an Accelerator with a ``ParallelismConfig``: its ``cp_size`` (hf_ring runs it).

        Accelerate's mesh is ``(dp_replicate, dp_shard, cp)`` with consecutive ranks in a CP group, the
        groups hf_ring builds; its tp / sp dimensions and HSDP with CP are not supported.
        """
        if pc.tp_size > 1 or pc.sp_size > 1:
            raise ValueError(
                f"the Accelerator's ParallelismConfig has tp_size={pc.tp_size}, sp_size={pc.sp_size}; hf_ring composes "
                "context parallelism with data parallelism (dp_replicate / dp_shard) only: set tp_size and sp_size to 1"
            )
        if self.cp_size is not None and self.cp_size != pc.cp_size:
            raise ValueError(
                f"RingAttentionPlugin(cp_size={self.cp_size}) disagrees with the Accelerator's ParallelismConfig "
                f"cp_size={pc.cp_size}: set the CP size in one place (parallelism_config_cp_size in the accelerate "
                "config, or RingAttentionPlugin(cp_size=...) without a ParallelismConfig)"
            )
        if pc.cp_size > 1 and pc.dp_replicate_size > 1:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={pc.dp_replicate_size}, cp_size={pc.cp_size}) (HSDP with context "
                "parallelism) is not supported by hf_ring yet: use dp_shard_size for the data-parallel replicas"
            )
        if pc.cp_size > 1 and engine != "fsdp2":
            raise ValueError(
                f"a ParallelismConfig with cp_size={pc.cp_size} needs FSDP2 (fsdp_version: 2), as Accelerate requires; "
                "for DDP or DeepSpeed leave parallelism_config out and set RingAttentionPlugin(cp_size=...)"
            )
        return self.validate(world) if pc.total_size == 1 else pc.cp_size

    def setup(self, accelerator) -> RingSetup:
        """``check`` it, then build the dp x cp mesh and groups; the same ``RingSetup`` for the same Accelerator."""
        return self._build(accelerator, self.check(accelerator))

    def _build(self, accelerator, cp: int) -> RingSetup:
        """The ``RingSetup`` of ``accelerator``, already checked (``cp`` from ``check``): built once, then reused."""
        known = self._setups.get(id(accelerator))
        if known is not None and known[0] is accelerator:
            self._setups["last"] = known[1]
            return known[1]
        world, rank = int(accelerator.num_processes), int(accelerator.process_index)
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{world} processes but torch.distributed is not initialised; create the Accelerator first "
                "(launch with accelerate launch or torchrun)"
            )
        mesh = cp_group = dp_group = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            device_type = torch.device(accelerator.device).type
            mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
            cp_group, dp_group = mesh.get_group("cp"), mesh.get_group("dp")
        ring = RingSetup(self, world, rank, cp, engine_of(accelerator), mesh, cp_group, dp_group)
        self._setups[id(accelerator)] = (accelerator, ring)
        self._setups["last"] = ring
        return ring

    def prepare(self, accelerator, *args, device_placement=None):
        """Like ``accelerator.prepare(*args)`` (same objects, same order), with context parallelism.

        Models (PreTrainedModel / PeftModel) get ring attention over their CP group, DataLoaders yield
        this rank's shard of its DP group's batches, optimizers and schedulers are prepared by Accelerate
        (schedulers stepping like a plain ``dp_size``-process run), and the gradient reduction (DDP or
        FSDP2 or DeepSpeed) sums the CP shares and averages the DP replicas.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        # every check that needs no communication comes first, so a mistake never turns into a hang
        cp = self.check(accelerator)
        if device_placement is not None and engine_of(accelerator) == "deepspeed":
            raise ValueError("device_placement cannot be customised with DeepSpeed (it places the model itself)")
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                _check_supported_model(obj)
                check_ddp_reaches_every_parameter(accelerator, obj)
            if isinstance(obj, DataLoader) and getattr(obj, "_is_accelerate_prepared", False):
                raise ValueError(
                    "pass plain DataLoaders to plugin.prepare, not ones already prepared by accelerator.prepare"
                )
        return prepare(self._build(accelerator, cp), accelerator, *args, device_placement=device_placement)

    # ---- the setup of the last prepare / setup -------------------------------------------------

    @property
    def ring(self) -> RingSetup:
        """The ``RingSetup`` of the last ``prepare`` or ``setup``."""
        ring = self._setups.get("last")
        if ring is None:
            raise RuntimeError(
                "RingAttentionPlugin has no process groups yet: call plugin.prepare(accelerator, ...) "
                "(or plugin.setup(accelerator)) first"
            )
        return ring

    world_size = property(lambda self: self.ring.world_size, doc="Number of processes.")
    dp_size = property(lambda self: self.ring.dp_size, doc="Number of data-parallel replicas.")
    cp_rank = property(lambda self: self.ring.cp_rank, doc="This rank's index in its CP group.")
    dp_rank = property(lambda self: self.ring.dp_rank, doc="This rank's data-parallel replica.")
    cp_group = property(lambda self: self.ring.cp_group, doc="The CP process group (None for one process).")
    dp_group = property(lambda self: self.ring.dp_group, doc="The DP process group (None for one process).")
    device_mesh = property(lambda self: self.ring.mesh, doc='``DeviceMesh`` (dp, cp), dims ``("dp", "cp")``.')

    def reduce_loss(self, loss: torch.Tensor, *, num_items=None) -> torch.Tensor:
        """``reduce_loss(plugin.ring, loss, num_items=...)``: the global loss of the last batch, for logging."""
        return reduce_loss(self.ring, loss, num_items=num_items)

    def check_exactness(self, accelerator, model, batch, *, reference_dtype="wider"):
        """``hf_ring.check_exactness`` over this rank's CP group with the plugin's settings, and with the chunked loss
        if the plugin computes the loss that way (what ``prepare`` will train): call it before ``prepare``, with the
        model unwrapped and this CP group's full batch (every DP group checks its own). It runs on
        ``accelerator.device``: a model elsewhere (on the CPU, for FSDP2 to shard) is moved there for the check and
        back. Returns the ``ExactnessReport``; the model comes back as it was."""
        from .exactness import check_exactness, on_device
        from .loss import apply_chunked_loss, is_chunked, revert_chunked_loss

        _check_supported_model(model)
        ring = self.setup(accelerator)
        target = unwrap_transformers_model(model)
        chunked = self.chunked_loss and not is_chunked(target) and "forward" not in vars(target)
        if chunked:
            apply_chunked_loss(target, chunk_size=self.loss_chunk_size, backend=self.loss_backend)
        try:
            with on_device(model, batch, accelerator.device) as batch:
                return check_exactness(
                    model, batch, group=ring.cp_group, layout=self.layout, backend=self.backend,
                    ulysses_size=self.ulysses_size, timeout=self.timeout, chunk_multiple=self.chunk_multiple,
                    reference_dtype=reference_dtype,
                )  # fmt: skip
        finally:
            if chunked:
                revert_chunked_loss(target)


# ---- the adapters: functions over a RingSetup --------------------------------------------------------


def apply_to_model(ring: RingSetup, model):
    """Switch ``model`` (PreTrainedModel or PeftModel) to ring attention over this rank's CP group, to the
    chunked loss if the plugin asks for it (unless another library already replaced its forward), and to
    activation offload if it asks for that."""
    from .apply import apply_ring_attention, unwrap_transformers_model
    from .loss import apply_chunked_loss, is_chunked
    from .offload import apply_activation_offload

    _check_supported_model(model)
    ring.chunks.add(model)
    apply_ring_attention(
        model, group=ring.cp_group, layout=ring.plugin.layout, backend=ring.plugin.backend,
        ulysses_size=ring.plugin.ulysses_size, timeout=ring.plugin.timeout,
    )  # fmt: skip
    target = unwrap_transformers_model(model)
    if ring.plugin.chunked_loss and (is_chunked(target) or "forward" not in vars(target)):
        apply_chunked_loss(target, chunk_size=ring.plugin.loss_chunk_size, backend=ring.plugin.loss_backend)
    if ring.plugin.offload_activations:
        apply_activation_offload(target)
    if id(model) not in ring.loss_counts.hooked:
        model.register_forward_pre_hook(ring.loss_counts, with_kwargs=True)
        ring.loss_counts.hooked.add(id(model))
    return model


def shard_collate(ring: RingSetup, collate_fn):
    """``collate_fn`` wrapped so that it returns this rank's shard (``hf_ring.shard_batch``)."""
    return _ShardCollate(
        collate_fn, ring.cp_rank, ring.cp_size, ring.plugin.layout, ring.plugin.pad_to_multiple, ring.chunks
    )


def prepare_data_loader(ring: RingSetup, accelerator, dataloader: DataLoader, device_placement: bool | None = None):
    """``dataloader`` prepared as Accelerate would for ``dp_size`` processes (index ``dp_rank``), yielding shards."""
    from accelerate.data_loader import prepare_data_loader as accelerate_prepare_data_loader

    if getattr(dataloader, "_is_accelerate_prepared", False):
        raise ValueError(
            "this DataLoader was already prepared by accelerator.prepare; pass the plain DataLoader to "
            "plugin.prepare so that it is split over the data-parallel groups, not over every process"
        )
    if accelerator.dispatch_batches:
        raise ValueError(
            "dispatch_batches=True is not supported with context parallelism (rank 0 would split batches over "
            "every process); use DataLoaderConfiguration(dispatch_batches=False)"
        )
    if accelerator.use_stateful_dataloader:
        raise NotImplementedError(
            "use_stateful_dataloader=True is not supported with context parallelism yet (its resume bookkeeping "
            "counts every process as a data-parallel replica); use the default DataLoader"
        )
    if device_placement is None:
        device_placement = accelerator.device_placement
    prepared = accelerate_prepare_data_loader(
        dataloader,
        accelerator.device,
        num_processes=ring.dp_size,
        process_index=ring.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=list(accelerator.rng_types),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    _set_collate(prepared, shard_collate(ring, prepared.collate_fn))
    prepared._is_accelerate_prepared = True
    return accelerator.prepare_data_loader(prepared)  # registers it for save_state / load_state


def reshard_prepared_data_loader(ring: RingSetup, prepared, *, shard_batches: bool = True):
    """Turn a loader that ``accelerator.prepare`` split over every process into one split over DP groups.

    For integrations that let Accelerate build the loader (the HF Trainer): the batch sampler (or
    iterable-dataset shard) is re-pointed at ``dp_size`` / ``dp_rank`` and the collate function shards
    (``shard_batches=False``: it does not, every rank of a CP group gets the whole batch: ``RingDPOTrainer`` shards
    in the model's call).
    """
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    if isinstance(prepared, DataLoaderDispatcher):
        raise ValueError(
            "dispatch_batches=True is not supported with context parallelism; set "
            "accelerator_config={'dispatch_batches': False} (TrainingArguments) or "
            "DataLoaderConfiguration(dispatch_batches=False)"
        )
    shard = None
    for holder in (getattr(prepared, "batch_sampler", None), getattr(prepared, "sampler", None)):
        if isinstance(holder, BatchSamplerShard):
            shard = holder
    if shard is None and isinstance(getattr(prepared, "dataset", None), IterableDatasetShard):
        shard = prepared.dataset
    if shard is not None:
        shard.num_processes, shard.process_index = ring.dp_size, ring.dp_rank
        if ring.dp_size == 1 and isinstance(shard, BatchSamplerShard):
            shard.even_batches = False  # one replica: plain batches, no padding of the last one
    elif ring.world_size > 1 and ring.dp_size != ring.world_size and getattr(prepared, "dataset", None) is not None:
        raise ValueError(
            f"cannot re-split a {type(prepared).__name__} over the data-parallel groups (a sharded datasets "
            "IterableDataset?); use a map-style dataset or a torch IterableDataset"
        )
    if shard_batches:
        _set_collate(prepared, shard_collate(ring, prepared.collate_fn))
    return prepared


def reduce_loss(ring: RingSetup, loss: torch.Tensor, *, num_items=None) -> torch.Tensor:
    """The global token-weighted loss of the last batch, the same on every rank (detached).

    ``loss`` is this rank's share (``model(**batch).loss``). The CP shares are summed; DP groups are
    weighted by their number of valid targets (``num_items``, default: the count the model saw in
    its last forward). Single process: ``loss`` itself.
    """
    loss = loss.detach()
    if ring.world_size == 1:
        return loss.clone()
    n = num_items if num_items is not None else ring.loss_counts.last
    if ring.dp_size == 1 or n is None:
        total = loss.float().clone()
        dist.all_reduce(total)
        return (total / ring.dp_size).to(loss.dtype)
    n = torch.as_tensor(n, dtype=torch.float32).to(loss.device)
    buf = torch.stack([loss.float() * n, n])
    dist.all_reduce(buf)
    return (ring.cp_size * buf[0] / buf[1].clamp(min=1)).to(loss.dtype)


def prepare(ring: RingSetup, accelerator, *args, device_placement=None):
    """``RingAttentionPlugin.prepare`` over a ``RingSetup``: the objects prepared, in order."""
    placement = list(device_placement) if device_placement is not None else [None] * len(args)
    out: list[Any] = list(args)
    rest = []
    for i, obj in enumerate(args):
        if isinstance(obj, DataLoader):
            out[i] = prepare_data_loader(ring, accelerator, obj, device_placement=placement[i])
        else:
            if isinstance(obj, torch.nn.Module):
                apply_to_model(ring, obj)
            rest.append(i)
    if rest:
        kwargs = {"device_placement": [placement[i] for i in rest]}
        if ring.engine == "deepspeed":
            fill_deepspeed_micro_batch(ring, accelerator, [obj for obj in args if isinstance(obj, DataLoader)])
            kwargs = {}
        with without_accelerate_cp(accelerator):
            prepared = accelerator.prepare(*[args[i] for i in rest], **kwargs)
        prepared = prepared if len(rest) > 1 else (prepared,)
        for i, obj in zip(rest, prepared):
            out[i] = data_parallel_scheduler(ring, reduce_gradients(ring, obj))
    return out[0] if len(out) == 1 else tuple(out)
