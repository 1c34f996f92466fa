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
- gradients: each rank's loss is its share of its CP group's loss, so the CP shares must be summed
  and the DP replicas averaged. DDP averages over the whole world (divides by dp x cp), so the plugin
  registers a DDP communication hook that all-reduces over the world and divides by ``dp_size``.
  FSDP2 (``fsdp_version: 2``) shards the model over the whole world with Accelerate's own FSDP2 path;
  its reduce-scatter then sums over the world and divides by ``dp_size``
  (``hf_ring.fsdp.set_cp_gradient_reduction``), which needs no special reduce op (gloo and NCCL);
- LR schedulers step ``dp_size`` times per optimizer step (Accelerate's rule for ``dp_size``
  processes, instead of once per process of the world).

Supported: no distribution, DDP and FSDP2 on CPU (gloo) and GPU (NCCL), gradient accumulation,
Accelerate mixed precision and FSDP2 mixed-precision policies. FSDP1, DeepSpeed, Megatron-LM, XLA and
Accelerate's own ``ParallelismConfig`` with tp/cp sizes are refused with an error (their gradient
reduction would average the CP shares instead of summing them, or they were not tested).

Configuration enters here only: arguments, or the environment variables ``HF_RING_CP_SIZE``,
``HF_RING_LAYOUT`` and ``HF_RING_BACKEND`` for the arguments left as None.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .apply import unwrap_transformers_model
from .hf_attention import RingConfig
from .layout import check_layout

__all__ = ["RingAttentionPlugin", "ENV_CP_SIZE", "ENV_LAYOUT", "ENV_BACKEND"]

ENV_CP_SIZE = "HF_RING_CP_SIZE"
ENV_LAYOUT = "HF_RING_LAYOUT"
ENV_BACKEND = "HF_RING_BACKEND"

_DDP_TYPES = (
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_XPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_HPU",
)


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


def _check_supported_model(model) -> None:
    from .patches import get_patch

    target = unwrap_transformers_model(model)
    if target is None:
        raise TypeError(
            f"RingAttentionPlugin.prepare got a model of type {type(model).__name__}; hf_ring patches transformers "
            "PreTrainedModel (Llama, Mistral, Qwen2, Qwen3) or peft PeftModel wrapping one. Pass the model before "
            "accelerator.prepare (not a DDP/FSDP-wrapped one)"
        )
    get_patch(getattr(target.config, "model_type", None))  # ValueError naming the supported families


class _ShardCollate:
    """A DataLoader collate function: the wrapped collator's full batch -> this rank's ``shard_batch`` shard.

    Runs in the main process (``num_workers=0``) or in forked workers, which inherit the process
    group. It cannot be pickled (spawned workers): it holds a process group.
    """

    def __init__(self, collate_fn, group, layout: str, pad_to_multiple: bool):
        self.collate_fn = collate_fn
        self.group = group
        self.layout = layout
        self.pad_to_multiple = pad_to_multiple

    def __call__(self, features):
        from .batch import shard_batch

        batch = self.collate_fn(features)
        return shard_batch(dict(batch), group=self.group, layout=self.layout, pad_to_multiple=self.pad_to_multiple)

    def __reduce__(self):
        raise TypeError(
            "hf_ring shards each batch in the DataLoader's collate function, which needs the context-parallel process "
            "group and cannot be sent to spawned workers; use num_workers=0 or multiprocessing_context='fork'"
        )


def _set_collate(loader, collate_fn) -> None:
    """Set the collate function of a prepared loader (on the wrapped DataLoader of Accelerate's adapters)."""
    getattr(loader, "base_dataloader", loader).collate_fn = collate_fn


def _dp_allreduce_hook(state, bucket):
    """DDP communication hook: sum the gradients over the DDP group, divide by the number of DP replicas."""
    group, divisor = state
    tensor = bucket.buffer()
    tensor.div_(divisor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _data_parallel_scheduler_class():
    from accelerate.scheduler import AcceleratedScheduler

    class DataParallelScheduler(AcceleratedScheduler):
        """``AcceleratedScheduler`` that steps like a plain run with ``dp_size`` processes (not one per rank)."""

        def __init__(self, wrapped, dp_size: int):
            super().__init__(
                wrapped.scheduler,
                wrapped.optimizers,
                step_with_optimizer=wrapped.step_with_optimizer,
                split_batches=wrapped.split_batches,
            )
            self.dp_size = dp_size

        def step(self, *args, **kwargs):
            if not self.step_with_optimizer or self.split_batches:
                return super().step(*args, **kwargs)
            if not self.gradient_state.sync_gradients:
                if self.gradient_state.adjust_scheduler:
                    self.scheduler._step_count += 1
                return
            if any(opt.step_was_skipped for opt in self.optimizers):
                return
            for _ in range(self.dp_size):
                total = getattr(self.scheduler, "total_steps", None)
                if total is None or self.scheduler._step_count <= total:
                    self.scheduler.step(*args, **kwargs)

    return DataParallelScheduler


@dataclasses.dataclass
class RingAttentionPlugin:
    """Context parallelism for Accelerate: CP x DP groups, zig-zag data sharding, exact loss and gradients.

    Args:
        cp_size: ranks per context-parallel group; must divide the number of processes. None: the
            environment variable ``HF_RING_CP_SIZE``, else every process (one CP group, no DP).
        layout: ``"zigzag"`` (default), ``"striped"`` or ``"contiguous"``. None: ``HF_RING_LAYOUT`` or zigzag.
        backend: local attention kernel: ``"auto"``, ``"torch"``, ``"triton"``, ``"flash_attn"``. None:
            ``HF_RING_BACKEND`` or auto.
        pad_to_multiple: pad each batch's sequence to the layout's multiple (2 x cp_size for zigzag)
            with ignored tokens; if False, other lengths raise.

    After ``prepare`` (or ``setup``): ``cp_group``, ``dp_group``, ``device_mesh`` (dims ``("dp", "cp")``),
    ``cp_rank``, ``dp_rank``, ``dp_size``, ``world_size``.
    """

    cp_size: int | None = None
    layout: str | None = None
    backend: str | None = None
    pad_to_multiple: bool = True

    def __post_init__(self):
        if self.cp_size is None:
            self.cp_size = _env_int(ENV_CP_SIZE)
        if self.layout is None:
            self.layout = os.environ.get(ENV_LAYOUT) or "zigzag"
        if self.backend is None:
            self.backend = os.environ.get(ENV_BACKEND) or "auto"
        if self.cp_size is not None and (isinstance(self.cp_size, bool) or not isinstance(self.cp_size, int)):
            raise TypeError(f"cp_size must be an int or None, got {self.cp_size!r}")
        if self.cp_size is not None and self.cp_size < 1:
            raise ValueError(f"cp_size must be at least 1, got {self.cp_size} (set cp_size or {ENV_CP_SIZE})")
        check_layout(self.layout)
        RingConfig(layout=self.layout, backend=self.backend)  # validates the backend name
        self._mesh = None
        self._cp_group = None
        self._dp_group = None
        self._world = None
        self._rank = 0
        self._last_num_items = None
        self._hooked = set()

    # ---- groups -------------------------------------------------------------------------------

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

    def setup(self, accelerator) -> RingAttentionPlugin:
        """Validate against ``accelerator`` (an ``Accelerator`` or ``PartialState``) and build the groups (idempotent)."""
        world, rank = int(accelerator.num_processes), int(accelerator.process_index)
        if self._world is not None:
            if world != self._world:
                raise ValueError(f"this plugin was set up for {self._world} processes, not {world}")
            return self
        cp = self.validate(world)
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{world} processes but torch.distributed is not initialised; create the Accelerator first "
                "(launch with accelerate launch or torchrun)"
            )
        if cp > 1 and world == 1:
            raise ValueError(
                f"cp_size={cp} needs {cp} processes but this is a single process; launch with "
                f"accelerate launch --num_processes {cp} (or a multiple of it)"
            )
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            device_type = torch.device(accelerator.device).type
            self._mesh = init_device_mesh(device_type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
            self._cp_group = self._mesh.get_group("cp")
            self._dp_group = self._mesh.get_group("dp")
        self.cp_size, self._world, self._rank = cp, world, rank
        return self

    def _require_setup(self):
        if self._world is None:
            raise RuntimeError(
                "RingAttentionPlugin has no process groups yet: call plugin.prepare(accelerator, ...) "
                "(or plugin.setup(accelerator)) first"
            )

    @property
    def world_size(self) -> int:
        self._require_setup()
        return self._world

    @property
    def dp_size(self) -> int:
        self._require_setup()
        return self._world // self.cp_size

    @property
    def cp_rank(self) -> int:
        self._require_setup()
        return self._rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        self._require_setup()
        return self._rank // self.cp_size

    @property
    def cp_group(self):
        """The context-parallel process group of this rank (None for a single process)."""
        self._require_setup()
        return self._cp_group

    @property
    def dp_group(self):
        """The data-parallel process group of this rank: the ranks with the same CP rank (None for one process)."""
        self._require_setup()
        return self._dp_group

    @property
    def device_mesh(self):
        """``DeviceMesh`` of shape (dp_size, cp_size), dims ``("dp", "cp")`` (None for a single process)."""
        self._require_setup()
        return self._mesh

    # ---- models, data, loss -------------------------------------------------------------------

    def apply(self, model):
        """Switch ``model`` (PreTrainedModel or PeftModel) to ring attention over this rank's CP group."""
        from .apply import apply_ring_attention

        self._require_setup()
        _check_supported_model(model)
        apply_ring_attention(model, group=self._cp_group, layout=self.layout, backend=self.backend)
        if id(model) not in self._hooked:
            model.register_forward_pre_hook(self._record_num_items, with_kwargs=True)
            self._hooked.add(id(model))
        return model

    def _record_num_items(self, module, args, kwargs):
        n = kwargs.get("num_items_in_batch")
        if n is not None:
            self._last_num_items = n

    def shard_batch(self, batch) -> dict:
        """This rank's shard of a full batch (``hf_ring.shard_batch`` with this plugin's group and layout)."""
        from .batch import shard_batch

        self._require_setup()
        return shard_batch(batch, group=self._cp_group, layout=self.layout, pad_to_multiple=self.pad_to_multiple)

    def collate_fn(self, collate_fn):
        """Wrap a collate function so that it returns this rank's shard."""
        self._require_setup()
        return _ShardCollate(collate_fn, self._cp_group, self.layout, self.pad_to_multiple)

    def prepare_data_loader(self, accelerator, dataloader: DataLoader, device_placement: bool | None = None):
        """``dataloader`` prepared as Accelerate would for ``dp_size`` processes (index ``dp_rank``), yielding shards."""
        from accelerate.data_loader import prepare_data_loader

        self.setup(accelerator)
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
        prepared = prepare_data_loader(
            dataloader,
            accelerator.device,
            num_processes=self.dp_size,
            process_index=self.dp_rank,
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
        _set_collate(prepared, self.collate_fn(prepared.collate_fn))
        prepared._is_accelerate_prepared = True
        return accelerator.prepare_data_loader(prepared)  # registers it for save_state / load_state

    def reshard_prepared_data_loader(self, prepared):
        """Turn a loader that ``accelerator.prepare`` split over every process into one split over DP groups.

        For integrations that let Accelerate build the loader (the HF Trainer): the batch sampler (or
        iterable-dataset shard) is re-pointed at ``dp_size`` / ``dp_rank`` and the collate function shards.
        """
        from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

        self._require_setup()
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
            shard.num_processes, shard.process_index = self.dp_size, self.dp_rank
            if self.dp_size == 1 and isinstance(shard, BatchSamplerShard):
                shard.even_batches = False  # one replica: plain batches, no padding of the last one
        elif self._world > 1 and self.dp_size != self._world and getattr(prepared, "dataset", None) is not None:
            raise ValueError(
                f"cannot re-split a {type(prepared).__name__} over the data-parallel groups (a sharded datasets "
                "IterableDataset?); use a map-style dataset or a torch IterableDataset"
            )
        _set_collate(prepared, self.collate_fn(prepared.collate_fn))
        return prepared

    def reduce_loss(self, loss: torch.Tensor, *, num_items=None) -> torch.Tensor:
        """The global token-weighted loss of the last batch, the same on every rank (detached).

        ``loss`` is this rank's share (``model(**batch).loss``). The CP shares are summed; DP groups are
        weighted by their number of valid targets (``num_items``, default: the count the model saw in
        its last forward). Single process: ``loss`` itself.
        """
        self._require_setup()
        loss = loss.detach()
        if self._world == 1:
            return loss.clone()
        n = num_items if num_items is not None else self._last_num_items
        if self.dp_size == 1 or n is None:
            total = loss.float().clone()
            dist.all_reduce(total)
            return (total / self.dp_size).to(loss.dtype)
        n = torch.as_tensor(n, dtype=torch.float32).to(loss.device)
        buf = torch.stack([loss.float() * n, n])
        dist.all_reduce(buf)
        return (self.cp_size * buf[0] / buf[1].clamp(min=1)).to(loss.dtype)

    # ---- prepare ------------------------------------------------------------------------------

    def _check_accelerator(self, accelerator) -> None:
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if kind == "FSDP":
            version = getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", 1)
            if version != 2:
                raise NotImplementedError(
                    f"RingAttentionPlugin supports FSDP2, not FSDP version {version}: set fsdp_version: 2 in the "
                    "accelerate config file (fsdp_config), or FullyShardedDataParallelPlugin(fsdp_version=2)"
                )
        elif kind not in _DDP_TYPES:
            raise NotImplementedError(
                f"RingAttentionPlugin supports DDP, FSDP2 (fsdp_version: 2) and single-process training, not "
                f"distributed_type={kind}: DeepSpeed, Megatron-LM and XLA reduce gradients with their own averaging, "
                "which would average the context-parallel shares instead of summing them, and were not tested with "
                "hf_ring. Use DDP (accelerate launch --multi_gpu / multi-CPU) or FSDP2"
            )
        pc = getattr(accelerator, "parallelism_config", None)
        if pc is not None and (pc.non_data_parallel_size > 1 or pc.dp_shard_size > 1):
            raise ValueError(
                "the Accelerator has a ParallelismConfig (Accelerate's own tp/cp/fsdp mesh); hf_ring builds its own "
                "dp x cp mesh: create the Accelerator without parallelism_config (FSDP2 then shards over every "
                "process, and hf_ring sums the context-parallel shares)"
            )

    def prepare(self, accelerator, *args, device_placement=None):
        """Like ``accelerator.prepare(*args)`` (same objects, same order), with context parallelism.

        Models (PreTrainedModel / PeftModel) get ring attention over their CP group, DataLoaders yield
        this rank's shard of its DP group's batches, optimizers and schedulers are prepared by Accelerate
        (schedulers stepping like a plain ``dp_size``-process run), and DDP sums the CP shares and
        averages the DP replicas.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        placement = list(device_placement) if device_placement is not None else [None] * len(args)
        # every check that needs no communication comes first, so a mistake never turns into a hang
        self.validate(int(accelerator.num_processes))
        self._check_accelerator(accelerator)
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                _check_supported_model(obj)
            if isinstance(obj, DataLoader) and getattr(obj, "_is_accelerate_prepared", False):
                raise ValueError(
                    "pass plain DataLoaders to plugin.prepare, not ones already prepared by accelerator.prepare"
                )
        self.setup(accelerator)

        out: list[Any] = list(args)
        rest = []
        for i, obj in enumerate(args):
            if isinstance(obj, DataLoader):
                out[i] = self.prepare_data_loader(accelerator, obj, device_placement=placement[i])
            else:
                if isinstance(obj, torch.nn.Module):
                    self.apply(obj)
                rest.append(i)
        if rest:
            prepared = accelerator.prepare(*[args[i] for i in rest], device_placement=[placement[i] for i in rest])
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                out[i] = self._post_prepare(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def _post_prepare(self, obj):
        from accelerate.scheduler import AcceleratedScheduler
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        from .fsdp import set_cp_gradient_reduction

        if isinstance(obj, FSDPModule) and self.cp_size > 1:
            set_cp_gradient_reduction(obj, dp_size=self.dp_size)
        if isinstance(obj, DistributedDataParallel) and self.cp_size > 1:
            group = obj.process_group
            size = dist.get_world_size(group)
            if size != self._world:
                raise ValueError(f"the DDP process group has {size} ranks; expected the whole world of {self._world}")
            try:
                obj.register_comm_hook(state=(group, self.dp_size), hook=_dp_allreduce_hook)
            except RuntimeError as e:
                raise RuntimeError(
                    "hf_ring registers its own DDP communication hook (sum over CP, average over DP); remove "
                    f"comm_hook from DistributedDataParallelKwargs ({e})"
                ) from e
        if isinstance(obj, AcceleratedScheduler) and self.dp_size != self._world:
            obj = _data_parallel_scheduler_class()(obj, self.dp_size)
        return obj
