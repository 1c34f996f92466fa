"""How each training engine reduces the context-parallel gradients and steps schedulers (adapters of the plugin).

Functions over the plugin's ``RingSetup`` (``hf_ring.accelerate``; only its sizes and ``engine`` are read,
so it is not imported here). Each rank's loss is its share of its CP group's loss, so the CP shares must
be summed and the DP replicas averaged:

- DDP averages over the whole world: a communication hook all-reduces over the world and divides by
  ``dp_size`` (``reduce_gradients``);
- FSDP2: every FSDP2 module sums over its ranks and divides by ``dp_size`` (``hf_ring.fsdp``);
- DeepSpeed ZeRO 0-3 averages over the world: ``outputs.loss`` keeps its value but back-propagates
  ``cp_size`` times its share (``_ScaleLossGrad``), and the engine's micro-batch size is filled from the
  plugin's own loaders (``fill_deepspeed_micro_batch``);
- schedulers step ``dp_size`` times per optimizer step, as for a plain ``dp_size``-process run
  (``data_parallel_scheduler``); a scheduler from the DeepSpeed config is left to the engine;
- Accelerate's own context parallelism (a ``ParallelismConfig`` with ``cp_size > 1``) is set aside
  while the plugin prepares (``without_accelerate_cp``): hf_ring's ring attention runs in its place;
- DDP refuses parameters that get no gradient (unless ``find_unused_parameters``): a vision-language model
  trained on text has them (its vision tower), and so has a model with DeepSeek sparse attention (its indexers,
  which Transformers runs without gradients), so ``check_ddp_reaches_every_parameter`` says so up front.

Caveat: DeepSpeed is imported only when the engine is DeepSpeed (Accelerate exports its DeepSpeed
helpers only where ``deepspeed`` is installed).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

__all__ = [
    "ACCELERATOR_WAY_OUT",
    "DISCRETE_TOKENIZERS",
    "check_ddp_reaches_every_parameter",
    "data_parallel_scheduler",
    "engine_of",
    "fill_deepspeed_micro_batch",
    "outside_text_model",
    "reduce_gradients",
    "without_accelerate_cp",
    "without_gradient",
]


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


def engine_of(accelerator) -> str:
    """``"fsdp2"``, ``"deepspeed"``, ``"ddp"`` or ``"none"`` for ``accelerator``; NotImplementedError for what is not supported."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind == "FSDP":
        version = getattr(getattr(getattr(accelerator, "state", None), "fsdp_plugin", None), "fsdp_version", 1)
        if version != 2:
            raise NotImplementedError(
                f"RingAttentionPlugin supports FSDP2, not FSDP version {version}: set fsdp_version: 2 in the "
                "accelerate config file (fsdp_config), or FullyShardedDataParallelPlugin(fsdp_version=2)"
            )
        return "fsdp2"
    if kind == "DEEPSPEED":
        return "deepspeed"
    if kind not in _DDP_TYPES:
        raise NotImplementedError(
            f"RingAttentionPlugin supports DDP, FSDP2 (fsdp_version: 2), DeepSpeed ZeRO and single-process "
            f"training, not distributed_type={kind}: Megatron-LM and XLA reduce gradients with their own averaging, "
            "which would average the context-parallel shares instead of summing them, and were not tested with "
            "hf_ring. Use DDP (accelerate launch --multi_gpu / multi-CPU), FSDP2 or DeepSpeed"
        )
    return "none" if kind == "NO" else "ddp"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _ScaleLossGrad:
    """Forward hook: ``outputs.loss`` keeps its value, its gradient is multiplied by ``factor`` (the CP size).

    For engines that average gradients over every rank (DeepSpeed): with each rank's gradient scaled
    by cp_size, the average over dp x cp ranks is the CP shares summed and the DP replicas averaged.
    """

    def __init__(self, factor: int):
        self.factor = float(factor)

    def __call__(self, module, args, output):
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            output.loss = _ScaleGrad.apply(loss, self.factor)
        return output


def reduce_gradients(ring, model):
    """Make the prepared ``model``'s gradient reduction sum the CP shares and average the DP replicas.

    DDP: a communication hook (all-reduce over the world, divide by ``dp_size``). FSDP2: every FSDP2
    module sums over its ranks and divides by ``dp_size`` (``hf_ring.fsdp.set_cp_gradient_reduction``).
    DeepSpeed (ZeRO 0-3), which averages over every rank: the engine's ``outputs.loss`` gets a gradient
    ``cp_size`` times its share (its value is unchanged), so the average is the CP sum over DP replicas.
    Other objects, and ``cp_size == 1``, are returned unchanged.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from .fsdp import set_cp_gradient_reduction

    if ring.cp_size == 1:
        return model
    if isinstance(model, FSDPModule):
        return set_cp_gradient_reduction(model, dp_size=ring.dp_size)
    if ring.engine == "deepspeed" and _is_deepspeed_engine(model):
        if not any(isinstance(h, _ScaleLossGrad) for h in model._forward_hooks.values()):
            model.register_forward_hook(_ScaleLossGrad(ring.cp_size))
        return model
    if isinstance(model, DistributedDataParallel):
        group = model.process_group
        size = dist.get_world_size(group)
        if size != ring.world_size:
            raise ValueError(f"the DDP process group has {size} ranks; expected the whole world of {ring.world_size}")
        try:
            model.register_comm_hook(state=(group, ring.dp_size), hook=_dp_allreduce_hook)
        except RuntimeError as e:
            raise RuntimeError(
                "hf_ring registers its own DDP communication hook (sum over CP, average over DP); remove "
                f"comm_hook from DistributedDataParallelKwargs ({e})"
            ) from e
    return model


def _is_deepspeed_engine(obj) -> bool:
    from deepspeed import DeepSpeedEngine

    return isinstance(obj, DeepSpeedEngine)


def data_parallel_scheduler(ring, scheduler):
    """An Accelerate-prepared scheduler that steps like a plain ``dp_size``-process run (unchanged without CP)."""
    from accelerate.scheduler import AcceleratedScheduler

    if ring.engine == "deepspeed":
        from accelerate.utils import DeepSpeedSchedulerWrapper  # exported only where deepspeed is installed

        if isinstance(scheduler, DeepSpeedSchedulerWrapper):
            return scheduler  # a scheduler from the DeepSpeed config: the engine steps it once per optimizer step
    if isinstance(scheduler, AcceleratedScheduler) and ring.dp_size != ring.world_size:
        return _data_parallel_scheduler_class()(scheduler, ring.dp_size)
    return scheduler


def _keep(*args):
    return args


def _already_sharded(buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
    return contextlib.nullcontext()


@contextlib.contextmanager
def without_accelerate_cp(accelerator):
    """``accelerator.prepare`` without Accelerate's own context parallelism, when its ParallelismConfig has cp_size > 1.

    Accelerate's CP attaches hooks that drop the attention mask for PyTorch's SDPA-only ring and shards
    buffers inside ``accelerator.maybe_context_parallel``. hf_ring runs the CP attention (ring attention
    on its own DataLoader shards) instead, so ``prepare`` skips the hooks, and ``maybe_context_parallel``
    becomes a no-op: a script written for Accelerate's CP runs unchanged, on batches already sharded.
    """
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None or not pc.cp_enabled:
        yield
        return
    accelerator._prepare_cp = _keep  # an instance attribute over the method, removed again below
    try:
        yield
    finally:
        del accelerator._prepare_cp
    accelerator._cp_context = _already_sharded


def fill_deepspeed_micro_batch(ring, accelerator, loaders: list) -> None:
    """Fill DeepSpeed's ``train_micro_batch_size_per_gpu: auto`` from the plain loaders, as Accelerate does.

    Accelerate reads it from the loaders passed to the same ``accelerator.prepare`` call; hf_ring prepares
    its loaders itself (split over the DP groups), so it fills the value: a rank's micro-batch is its
    DP replica's batch (every CP rank holds a shard of it).
    """
    ds_plugin = accelerator.state.deepspeed_plugin
    sizes = [dl.batch_size for dl in loaders if dl.batch_size is not None]
    if not sizes or not ds_plugin.is_auto("train_micro_batch_size_per_gpu"):
        return  # Accelerate raises its own clear error when the value stays unknown
    size = min(sizes) if ds_plugin.is_train_batch_min else max(sizes)
    if accelerator.split_batches:
        size //= ring.dp_size
    ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = size


def outside_text_model(model) -> list:
    """Names of ``model``'s trainable parameters that a text-only batch cannot reach: those of a vision-language
    model outside its text model and output embeddings (vision tower, projector); [] for a text model."""
    from transformers import PreTrainedModel

    from .apply import unwrap_transformers_model

    target = unwrap_transformers_model(model)
    text = target.config.get_text_config()
    if text is target.config:
        return []
    reached = [m for m in target.modules() if isinstance(m, PreTrainedModel) and m.config is text]
    head = target.get_output_embeddings()
    reached += [head] if head is not None else []
    ids = {id(p) for m in reached for p in m.parameters()}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]


DISCRETE_TOKENIZERS = ("ChameleonVQVAE", "Emu3VQVAE")
"""Image tokenizers inside a model whose output is discrete codes (a VQ-VAE's argmin): no gradient reaches them."""


def _idle_modules(model) -> tuple[dict, list]:
    """``({name: image tokenizer}, [sparse-attention indexers])``: the modules of ``model`` that no batch gives a
    gradient (``without_gradient``), the tokenizers by their name in ``model``."""
    from .apply import unwrap_transformers_model
    from .patches import REGISTRY

    target = unwrap_transformers_model(model)
    patch = REGISTRY.get(getattr(target.config, "model_type", None))
    tokenizers = {n: m for n, m in model.named_modules() if type(m).__name__ in DISCRETE_TOKENIZERS}
    layers = patch.attention_modules(target) if getattr(patch, "sparse", False) else []
    indexers = [getattr(m, "indexer", None) for m in layers]
    return tokenizers, [m for m in indexers if isinstance(m, torch.nn.Module)]


def _trainable_in(model, modules) -> list:
    """Names of ``model``'s trainable parameters that belong to ``modules``."""
    ids = {id(p) for m in modules for p in m.parameters()}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) in ids]


def without_gradient(model) -> list:
    """Names of ``model``'s trainable parameters that no batch gives a gradient: those of DeepSeek sparse attention's
    indexers (Transformers runs them under ``no_grad``; ``hf_ring.sparse``) and of an image tokenizer whose codes
    are discrete (Chameleon's and Emu3's VQ-VAE: ``DISCRETE_TOKENIZERS``); [] for other families."""
    tokenizers, indexers = _idle_modules(model)
    return _trainable_in(model, [*tokenizers.values(), *indexers])


ACCELERATOR_WAY_OUT = (
    "pass kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)] to the Accelerator"
)


def check_ddp_reaches_every_parameter(accelerator, model, way_out: str = ACCELERATOR_WAY_OUT) -> None:
    """ValueError when DDP would fail at the second step: trainable parameters that text-only batches never reach
    (a vision-language model's vision tower) without ``find_unused_parameters`` (``way_out``: how to set it). Not
    for the families that take images under the ring (``patches.multimodal.IMAGES``): their batches may carry
    images, and a mix with text-only batches needs ``find_unused_parameters`` as it does under plain DDP."""
    from .apply import unwrap_transformers_model
    from .patches import REGISTRY

    handler = getattr(accelerator, "ddp_handler", None)
    if engine_of(accelerator) != "ddp" or getattr(handler, "find_unused_parameters", False):
        return
    tokenizers, indexers = _idle_modules(model)
    for name, tokenizer in tokenizers.items():
        idle = _trainable_in(model, [tokenizer])
        if idle:
            raise ValueError(
                f"{len(idle)} trainable parameters of this model's image tokenizer (e.g. {idle[0]}) get no gradient "
                f"(its images become discrete codes), which DDP refuses at the second step: freeze it "
                f"(model.{name}.requires_grad_(False)) or {way_out}"
            )
    idle = _trainable_in(model, indexers)
    if idle:
        raise ValueError(
            f"{len(idle)} trainable parameters of this model's sparse-attention indexers (e.g. {idle[0]}) get no "
            "gradient (Transformers runs the indexers without gradients), which DDP refuses at the second step: "
            "freeze them (for m in model.modules(): if getattr(m, 'indexer', None) is not None: "
            f"m.indexer.requires_grad_(False)) or {way_out}"
        )
    unused = outside_text_model(model)
    patch = REGISTRY.get(getattr(unwrap_transformers_model(model).config, "model_type", None))
    if unused and getattr(patch, "images", False):  # its batches may carry images, which reach the vision tower
        warnings.warn(
            f"{len(unused)} trainable parameters of this vision-language model (e.g. {unused[0]}) lie outside its "
            "text model: under DDP every batch must reach them (images in every batch, and every vision layer "
            "used: LLaVA's default feature layer leaves the last one out), else DDP fails at the second step; "
            f"freeze them or {way_out} if some batches are text-only",
            stacklevel=3,
        )
        return
    if unused:
        raise ValueError(
            f"{len(unused)} trainable parameters of this vision-language model (e.g. {unused[0]}) lie outside its "
            "text model, so text-only batches give them no gradient, which DDP refuses at the second step: freeze "
            "them (e.g. model.model.vision_tower.requires_grad_(False) and the projector; with PEFT, target the "
            f"language model's modules only) or {way_out}"
        )
