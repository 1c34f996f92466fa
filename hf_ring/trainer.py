"""Context parallelism for the Hugging Face ``Trainer`` and TRL's SFT, DPO, KTO, GRPO and RLOO trainers.

``RingAttentionTrainer`` (a ``transformers.Trainer``), ``RingSFTTrainer`` (a ``trl.SFTTrainer``),
``RingDPOTrainer`` / ``RingKTOTrainer`` (TRL's ``DPOTrainer`` / ``KTOTrainer``) and ``RingGRPOTrainer`` /
``RingRLOOTrainer`` (TRL's ``GRPOTrainer`` / ``RLOOTrainer``; when TRL is installed) are the stock
trainers plus ``RingAttentionTrainerMixin``; mix it into your own Trainer subclass the same way
(``class MyTrainer(RingAttentionTrainerMixin, Trainer)``). Pass ``ring_plugin=RingAttentionPlugin(cp_size=...)``
(default: ``RingAttentionPlugin()``, configured from ``HF_RING_CP_SIZE`` / ``HF_RING_LAYOUT`` / ``HF_RING_BACKEND``,
every process in one CP group).

How the numbers stay exact. Batches are built by the Trainer's collator (padding, or packing with
``DataCollatorWithFlattening``), split over the data-parallel (DP) groups like a ``dp_size``-process
run, and sharded over the context-parallel (CP) group by the DataLoader (``hf_ring.shard_batch``).
The Trainer's own token-weighted loss then does the rest: it counts the valid targets of every
micro-batch on every rank (the local shards add up to the whole global batch), passes that total
as ``num_items_in_batch`` to the model and multiplies the loss by the number of processes, which
the average over all processes of DDP, of FSDP2 (``fsdp_version: 2``, sharding over every
process) or of DeepSpeed ZeRO (``deepspeed=``, stages 0-3) undoes. So the gradient is the sum of token losses over the CP
shards, DP replicas and accumulated micro-batches divided by their total number of targets, exactly
what a single process computes on the full sequences, and the logged training loss is that global
token-weighted loss. Evaluation returns, per DP group, the loss a plain DP run gives that process and
gathers it over the DP group only, so ``eval_loss`` equals the plain run's.

Memory: the model computes its loss chunk by chunk (``hf_ring.apply_chunked_loss``, the plugin's
default ``chunked_loss=True``), never holding the ``[tokens, vocab]`` logits; under ``RingSFTTrainer``
TRL's own fused LM head, installed by ``SFTTrainer``, stays in charge instead.

Preference optimization (``RingDPOTrainer``, ``RingKTOTrainer``) is a function of each sequence's summed
log-probabilities, not a sum of token losses, so it goes another way: every rank of a CP group gets the whole batch
(its DP group's), and the model's call (TRL's fused LM head, ``fused_lm_head=True``) shards it, runs the ring, and
all-gathers the per-token log-probabilities (and TRL's per-token metrics) into the whole sequence's, in TRL's
coordinates. Every rank then computes TRL's loss and metrics on them, the same on every rank of the group; the
all-gather's backward sums every rank's gradient of its own tokens, so the average over all processes of DDP / FSDP2 /
DeepSpeed gives the gradient of a plain ``dp_size``-process run. The reference model runs the same way.

The online trainers (``RingGRPOTrainer``, ``RingRLOOTrainer``) score completions the same way; they generate them with
``hf_ring.ring_generate`` (the prompt and the KV cache sharded over the CP group, the same completions on every rank),
and inside TRL's generation and loss steps its gathers, reductions, ``process_index`` and ``num_processes`` are the DP
group's (``_OverDP``), so the rewards' normalization over prompt groups and every metric are a plain DP run's.

Caveats: evaluation returns the loss only (logits are sharded over the CP group, so
``compute_metrics`` on logits is not supported); ``average_tokens_across_devices`` must stay True;
``train_sampling_strategy="batch_rebalance"`` and ``dispatch_batches`` are refused; FSDP1 is refused
(see ``hf_ring.accelerate``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer

from .accelerate import RingAttentionPlugin, apply_to_model, reshard_prepared_data_loader
from .engines import check_ddp_reaches_every_parameter
from .hf_attention import SHARD_INFO_KWARG, ShardInfo

__all__ = ["RingAttentionTrainerMixin", "RingAttentionTrainer", "RingSFTTrainer", "RingDPOTrainer",  # noqa: F822 - lazy
           "RingKTOTrainer", "RingGRPOTrainer", "RingRLOOTrainer"]  # fmt: skip


class RingAttentionTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to train with ring attention across CP groups."""

    def __init__(self, *args, ring_plugin: RingAttentionPlugin | None = None, **kwargs):
        self.ring_plugin = ring_plugin if ring_plugin is not None else RingAttentionPlugin()
        super().__init__(*args, **kwargs)
        plugin = self.ring_plugin
        # every check that needs no communication first, so a mistake never turns into a hang
        plugin.check(self.accelerator)
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and pc.cp_enabled:
            raise ValueError(
                f"the Trainer's ParallelismConfig has cp_size={pc.cp_size}, which would run Accelerate's own context "
                f"parallelism inside the Trainer; leave parallelism_config out and pass "
                f"ring_plugin=RingAttentionPlugin(cp_size={pc.cp_size}) (with fsdp_version: 2 for FSDP2)"
            )
        self._check_loss_contract()
        if getattr(self.args, "train_sampling_strategy", None) == "batch_rebalance":
            raise ValueError(
                "train_sampling_strategy='batch_rebalance' splits batches over every process; use 'random', "
                "'sequential' or 'group_by_length' with context parallelism"
            )
        check_ddp_reaches_every_parameter(
            self.accelerator, self.model, "set TrainingArguments(ddp_find_unused_parameters=True)"
        )
        self.ring_setup = plugin.setup(self.accelerator)  # the frozen RingSetup: groups, sizes, ranks
        apply_to_model(self.ring_setup, self.model)

    def check_exactness(self, batch: dict | None = None, *, reference_dtype="wider"):
        """``hf_ring.check_exactness`` of this trainer's model (its CP group, settings and loss, as ``train`` runs
        them) on ``batch``, or on the training collator's batch of the train dataset's first
        ``per_device_train_batch_size`` examples (an iterable dataset's first ones: a one-shot stream loses them;
        every rank must see the same). Call it before ``train``, on every rank, with the model whole on each (before
        FSDP or DeepSpeed shard it); it runs on the training device (a model that FSDP or DeepSpeed leave on the CPU
        until ``train`` is moved there for the check and back). Returns the ``ExactnessReport``; the model comes
        back as it was. For trainers
        whose loss is the language-model loss (``RingAttentionTrainer``, ``RingSFTTrainer``)."""
        from itertools import islice

        from .exactness import check_exactness, on_device

        if not self.shards_batches:
            raise ValueError(
                f"{type(self).__name__}.check_exactness: this trainer's loss is computed from the sequences' "
                "log-probabilities, not the language-model loss the check compares; check the model with "
                "RingAttentionTrainer or hf_ring.check_exactness on a batch with labels"
            )
        if batch is None:
            dataset, collator = self.train_dataset, self.data_collator
            try:
                import datasets
            except ImportError:
                datasets = None
            if datasets is not None and isinstance(dataset, datasets.Dataset):  # (as the Trainer's loaders do)
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
            n = self.args.per_device_train_batch_size
            iterable = isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__")
            iterable = iterable or (datasets is not None and isinstance(dataset, datasets.IterableDataset))
            rows = list(islice(iter(dataset), n)) if iterable else [dataset[i] for i in range(min(n, len(dataset)))]
            batch = collator(rows)
        with on_device(self.model, batch, self.args.device) as batch:  # (FSDP / DeepSpeed: on the CPU until train)
            return check_exactness(self.model, batch, chunk_multiple=self.ring_setup.chunks.value,
                                   reference_dtype=reference_dtype)  # fmt: skip

    def _check_loss_contract(self) -> None:
        """ValueError unless the Trainer weights the CP shards' token losses by the global number of targets."""
        if not self.args.average_tokens_across_devices:
            raise ValueError(
                "context parallelism needs TrainingArguments(average_tokens_across_devices=True): the loss of each "
                "rank is its share of the global token-weighted loss"
            )
        if self.args.label_smoothing_factor > 0:
            raise ValueError(
                "hf_ring's trainers do not support label_smoothing_factor > 0: the Trainer's label smoother would shift "
                "the labels shard_batch has already shifted (and ignore num_items_in_batch); set "
                "TrainingArguments(label_smoothing_factor=0)"
            )
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            raise ValueError(
                f"{type(self.model).__name__}.forward takes no loss kwargs (num_items_in_batch), so the Trainer "
                "cannot weight the CP shards by the global number of targets"
            )

    shards_batches = True
    """The DataLoader shards each batch over the CP group (the preference trainers: no, the model's call does)."""

    # data: split over DP groups, sharded over the CP group
    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        return reshard_prepared_data_loader(self.ring_setup, loader, shard_batches=self.shards_batches)

    def _whole(self, inputs) -> bool:
        """The batch reached every rank of the CP group whole (one with images, ``ShardInfo.whole_inputs``; any
        batch of a trainer whose model call shards), not as shards."""
        if not self.shards_batches:
            return True
        info = inputs.get(SHARD_INFO_KWARG) if isinstance(inputs, dict) else None
        return isinstance(info, ShardInfo) and info.whole_inputs

    def get_total_train_batch_size(self, args) -> int:
        """Samples per optimizer step: CP ranks share their samples, so divide the Trainer's count by cp_size."""
        return super().get_total_train_batch_size(args) // self.ring_setup.cp_size

    # a batch with images reaches every CP rank whole (``ShardInfo.whole_inputs``), where a text batch's shards add
    # up to the batch: the Trainer's token and FLOP counts take it once per CP group
    def _track_num_input_tokens(self, inputs):
        """Only the CP group's first rank counts the tokens of a whole-input batch (its padded length, or with
        ``"non_padding"`` its attention mask's tokens)."""
        if isinstance(inputs, dict) and self._whole(inputs) and self.ring_setup.cp_rank != 0:
            inputs = {k: v[:, :0] if k in ("input_ids", "attention_mask") else v for k, v in inputs.items()}
        return super()._track_num_input_tokens(inputs)

    def floating_point_ops(self, inputs) -> int:
        """A whole-input batch's FLOPs shared by its CP group's ranks, as a text batch's shards share them."""
        flops = super().floating_point_ops(inputs)
        return flops // self.ring_setup.cp_size if self._whole(inputs) else flops

    # evaluation: the plain-DP loss of this rank's DP group, gathered over the DP group
    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys: list | None = None):
        if not prediction_loss_only and not getattr(self, "_ring_warned_logits", False):
            from transformers.utils import logging

            logging.get_logger(__name__).warning(
                "hf_ring: evaluation returns the loss only; logits are sharded over the context-parallel group"
            )
            self._ring_warned_logits = True
        loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys=ignore_keys)
        ring = self.ring_setup
        if loss is not None and ring.world_size > 1:
            # each rank holds world * (its token-loss sum) / (global targets); the CP sum over cp_size is
            # the value process d of a plain dp-process run holds: dp * S_d / N
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=ring.cp_group)
            loss = loss / ring.cp_size
        return loss, None, None

    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = self._ring_gather_for_metrics
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = self.accelerator.gather_for_metrics

    def _ring_gather_for_metrics(self, data: Any, **kwargs):
        """``gather_for_metrics`` over the DP group (every CP rank of a group holds the same values)."""
        ring = self.ring_setup
        if ring.world_size == 1 or not isinstance(data, torch.Tensor):
            return self.accelerator.gather_for_metrics(data, **kwargs)
        out = _gather_over_dp(ring, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            out = out[: state.remainder]  # the samples a plain run pads the last batch with
        return out


def _gather_over_dp(ring, data: torch.Tensor) -> torch.Tensor:
    """Every DP replica's ``data`` (a 0-d tensor as [1]), concatenated on dim 0 in DP-rank order."""
    data = data.contiguous()
    if data.dim() == 0:
        data = data[None]
    parts = [torch.empty_like(data) for _ in range(ring.dp_size)]
    dist.all_gather(parts, data, group=ring.dp_group)
    return torch.cat(parts)


class RingAttentionTrainer(RingAttentionTrainerMixin, Trainer):
    """``transformers.Trainer`` with context parallelism (``ring_plugin=RingAttentionPlugin(...)``)."""


@functools.cache
def _ring_sft_trainer() -> type:
    try:
        from trl import SFTTrainer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("RingSFTTrainer needs TRL: pip install trl") from e

    class RingSFTTrainer(RingAttentionTrainerMixin, SFTTrainer):
        """``trl.SFTTrainer`` with context parallelism (``ring_plugin=RingAttentionPlugin(...)``).

        A batch with images reaches every CP rank whole (``ShardInfo.whole_inputs``), where TRL counts the tokens of
        its ``attention_mask`` on every process for its ``num_tokens`` metric: such a batch gets an all-ones
        ``attention_mask`` when it has none (nothing is padding; TRL requires one), and in training every process
        joins one small all-gather that takes back what the CP group's other ranks counted again (DP groups may
        mix image and text batches)."""

        def _check_loss_contract(self) -> None:
            super()._check_loss_contract()
            cp = self.ring_plugin.cp_size or self.accelerator.num_processes
            if getattr(self, "aux_loss_enabled", False) and cp > 1:
                # (TRL adds it beside its fused head's loss, weighted for data parallelism: under the ring each rank's
                # share would count 1 / CP size of a plain run's)
                raise ValueError(
                    "RingSFTTrainer does not support the MoE router's auxiliary loss under context parallelism; set "
                    "SFTConfig(router_aux_loss_coef=0.0), or train with RingAttentionTrainer, whose model adds the "
                    "router loss of the whole sequence"
                )

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            info = inputs.get(SHARD_INFO_KWARG)
            whole = isinstance(info, ShardInfo) and info.whole_inputs
            if whole and inputs.get("attention_mask") is None:
                ids = inputs["input_ids"]
                inputs = {**inputs, "attention_mask": torch.ones(ids.shape, dtype=torch.long, device=ids.device)}
            ring = self.ring_setup
            if ring.world_size > 1:  # TRL's per-rank sums (entropy, accuracy, tokens): see _cp_summed_gather
                self.accelerator.gather_for_metrics = self._cp_summed_gather
            try:
                out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                vars(self.accelerator).pop("gather_for_metrics", None)
            if self.model.training and ring.world_size > 1:  # TRL counted the tokens (every process)
                again = (
                    inputs["attention_mask"].sum() if whole and info.rank != 0 else inputs["input_ids"].new_zeros(())
                )
                self._total_train_tokens -= self._cp_summed_gather(again.reshape(1)).sum().item()
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return out

        def _cp_summed_gather(self, data, **kwargs):
            """``gather_for_metrics`` of a value each rank holds for its shard (a sum over its tokens): summed over the
            CP group, then gathered over the DP group with Accelerate's cut of the last batch, so the values equal a
            plain data-parallel run's (Accelerate's own cut, over every process, would drop whole CP ranks)."""
            if not isinstance(data, torch.Tensor):  # (Accelerate's own: this one stands in for it on the instance)
                return type(self.accelerator).gather_for_metrics(self.accelerator, data, **kwargs)
            summed = data.detach().clone()
            dist.all_reduce(summed, group=self.ring_setup.cp_group)
            return self._ring_gather_for_metrics(summed)

    RingSFTTrainer.__module__, RingSFTTrainer.__qualname__ = __name__, "RingSFTTrainer"
    return RingSFTTrainer


_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""The per-token fields of TRL's ``FusedCausalLMOutput``."""


class ShardedFusedHead:
    """The instance ``forward`` of a model carrying TRL's fused LM head, under a preference trainer: a call with
    ``fused_lm_head=True`` brings the whole batch (the same on every rank of the CP group); it is sharded here as
    ``shard_batch`` shards it (the labels shifted on the whole sequence), TRL's fused forward scores this rank's
    tokens, and every per-token field is all-gathered into the whole sequence's ``[batch, seq_len - 1]`` (TRL's
    coordinates: position i scores token i + 1). The log-probabilities keep their gradient (the all-gather's backward
    sums every rank's gradient of this rank's tokens). Any other call goes to the model as it is."""

    def __init__(self, fused, ring, model=None):
        self.fused = fused  # TRL's fused forward, bound to the model
        self.ring = ring
        self.model = model  # (whose NEFTune noise gets the whole batch's magnitude: ``patches._neftune``)
        functools.update_wrapper(self, fused)  # its signature: the model's forward's, which generate() reads

    def __call__(self, *args, fused_lm_head: bool = False, **kwargs):
        if not fused_lm_head:
            return self.fused(*args, **kwargs)
        from .batch import multimodal, shard_for
        from .comm import StateGather
        from .layout import unshard
        from .patches._neftune import unsharded_noise

        ring = self.ring
        names = ("input_ids", "attention_mask")
        if len(args) > len(names) or multimodal(kwargs) or kwargs.get("output_router_logits"):
            raise ValueError(
                "hf_ring's preference trainers: images, the MoE router's auxiliary loss and positional arguments "
                "beyond input_ids and attention_mask are not supported under context parallelism"
            )
        kwargs.update(zip(names, args))
        if not isinstance(kwargs.get("input_ids"), torch.Tensor):  # (prompt-learning PEFT sends inputs_embeds)
            raise ValueError("hf_ring's preference trainers: the model's call must bring input_ids (not inputs_embeds)")
        batch = {k: kwargs.pop(k) for k in (*names, "labels") if kwargs.get(k) is not None}
        seq_len = batch["input_ids"].shape[1]
        local = shard_for(batch, ring.cp_rank, ring.cp_size, layout=ring.plugin.layout,
                          pad_to_multiple=ring.plugin.pad_to_multiple, chunk_multiple=ring.chunks.value)  # fmt: skip
        shift = local.pop("shift_labels", None)
        for key in ("labels", "num_items_in_batch"):
            local.pop(key, None)
        kwargs.pop("shift_labels", None)
        with unsharded_noise(self.model, local.get(SHARD_INFO_KWARG)):
            out = self.fused(**{**kwargs, **local}, shift_labels=shift, fused_lm_head=True)
        gather = StateGather(ring.cp_group, timeout=ring.plugin.timeout, what="the log-probabilities' all-gather")
        for name in _PER_TOKEN:
            x = getattr(out, name, None)
            if not isinstance(x, torch.Tensor):
                continue
            flag = x.dtype == torch.bool  # (gloo gathers no booleans)
            parts = gather.gather(x.to(torch.uint8) if flag else x)  # [cp, batch, local]
            whole = unshard(list(parts.unbind(0)), dim=1, layout=ring.plugin.layout)[:, : seq_len - 1]
            setattr(out, name, whole.bool() if flag else whole)
        if isinstance(out.log_probs, torch.Tensor) and isinstance(out.label_mask, torch.Tensor):
            out.loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
        return out


class _DPState:
    """The accelerator's state as a plain ``dp_size``-process run's process ``dp_rank`` sees it."""

    def __init__(self, state, ring):
        self._state, self.process_index, self.num_processes = state, ring.dp_rank, ring.dp_size

    def __getattr__(self, name):
        return getattr(self._state, name)


class _OverDP:
    """Within TRL's own steps of a trainer whose CP group's ranks hold the same batch (the preference and online
    trainers): the accelerator's ``process_index`` / ``num_processes`` are the DP group's, and its ``gather``,
    ``gather_for_metrics`` and ``reduce`` (and the ``gather`` / ``gather_object`` TRL's module imported) run over the
    DP group, so every rank computes what process ``dp_rank`` of a plain ``dp_size``-process run computes. Entered
    again inside itself, it does nothing."""

    _NAMES = ("gather", "gather_for_metrics", "reduce")

    def __init__(self, trainer):
        self.trainer = trainer
        self.on = False

    def __enter__(self):
        trainer = self.trainer
        ring, acc = trainer.ring_setup, trainer.accelerator
        if ring.cp_size == 1 or ring.world_size == 1 or isinstance(acc.state, _DPState):
            return self
        self.on = True
        self.own = {name: vars(acc)[name] for name in self._NAMES if name in vars(acc)}
        acc.state = _DPState(acc.state, ring)
        acc.gather = self.gather
        acc.gather_for_metrics = self.gather_for_metrics
        acc.reduce = self.reduce
        import sys

        self.module = vars(sys.modules[trainer.trl_base.__module__])  # the names TRL's module imported
        self.globals = {name: self.module[name] for name in ("gather", "gather_object") if name in self.module}
        self.module.update({name: getattr(self, name) for name in self.globals})
        return self

    def __exit__(self, *exc):
        if not self.on:
            return
        acc = self.trainer.accelerator
        acc.state = acc.state._state
        for name in self._NAMES:
            vars(acc).pop(name, None)
        vars(acc).update(self.own)
        self.module.update(self.globals)
        self.on = False

    def gather(self, data):
        """``accelerate.utils.gather`` over the DP group: tensors (0-d ones as [1]), concatenated on dim 0."""
        if isinstance(data, (list, tuple)):
            return type(data)(self.gather(x) for x in data)
        if isinstance(data, dict):
            return {k: self.gather(v) for k, v in data.items()}
        return _gather_over_dp(self.trainer.ring_setup, data)

    def gather_object(self, obj):
        """``accelerate.utils.gather_object`` over the DP group (a list's items flattened)."""
        ring = self.trainer.ring_setup
        parts = [None] * ring.dp_size
        dist.all_gather_object(parts, obj, group=ring.dp_group)
        return [x for part in parts for x in part] if isinstance(obj, (list, tuple)) else parts

    def gather_for_metrics(self, data, **kwargs):
        """``Accelerator.gather_for_metrics`` over the DP group: tensors (in tuples, lists and dicts too) gathered
        each, anything else as objects."""
        if isinstance(data, torch.Tensor):
            return self.trainer._ring_gather_for_metrics(data, **kwargs)
        if isinstance(data, (tuple, list)) and data and all(isinstance(x, torch.Tensor) for x in data):
            return type(data)(self.gather_for_metrics(x, **kwargs) for x in data)
        if isinstance(data, dict) and data and all(isinstance(x, torch.Tensor) for x in data.values()):
            return {k: self.gather_for_metrics(x, **kwargs) for k, x in data.items()}
        return self.gather_object(data)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """``Accelerator.reduce`` over the DP group."""
        ring = self.trainer.ring_setup
        out = tensor.clone() * scale
        dist.all_reduce(out, group=ring.dp_group)
        return out / ring.dp_size if reduction == "mean" else out


class _RingGenerate:
    """A model's ``generate`` while TRL's online trainer generates completions: ``hf_ring.ring_generate`` (every rank
    of the CP group holds the same prompts; the prompt and the KV cache are sharded over the group, the new tokens
    the same on every rank)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids=None, attention_mask=None, **kwargs):
        from .generate import ring_generate

        inputs = {"input_ids": input_ids}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        del self.model.generate  # (ring_generate calls the model's own)
        try:
            return ring_generate(self.model, inputs, **kwargs)
        finally:
            self.model.generate = self


class _OnlineTrainerMixin:
    """What TRL's online trainers (``GRPOTrainer``, ``RLOOTrainer``) need beside the preference trainers' way: their
    generation, reward and advantage steps see the DP group (``_OverDP``), completions are generated by
    ``ring_generate``, the rewards are the CP group's first rank's, the generation batch counts DP groups as TRL counts
    processes, and the sampling seed is the DP rank's."""

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        name = type(self).__name__
        gen = getattr(config, "generation_kwargs", None) or {}
        refused = {
            "vLLM generation (use_vllm=True)": getattr(config, "use_vllm", False),
            "continuous batching (use_transformers_continuous_batching=True)": getattr(
                config, "use_transformers_continuous_batching", False
            ),
            "a cache_implementation": getattr(config, "cache_implementation", None) is not None
            or gen.get("cache_implementation") is not None,
            "generation_kwargs use_cache=False or num_beams > 1": gen.get("use_cache") is False
            or (gen.get("num_beams") or 1) > 1,
            # (their outputs may differ between the CP group's ranks, whose generation steps must agree)
            "tools, environment_factory or rollout_func": any(
                kwargs.get(k) for k in ("tools", "environment_factory", "rollout_func")
            ),
        }
        given = [what for what, on in refused.items() if on]
        if given:  # (before TRL starts vLLM)
            raise ValueError(
                f"{name} does not support {', '.join(given)} under context parallelism: completions are generated "
                "with hf_ring.ring_generate (the prompt and the KV cache sharded over the CP group)"
            )
        super().__init__(*args, **kwargs)
        ring, cfg = self.ring_setup, self.args
        # TRL counted every process: a plain run of dp_size processes generates this many completions at a time
        size = cfg.per_device_train_batch_size * ring.dp_size * cfg.steps_per_generation
        evals = self.num_generations_eval or self.num_generations
        if size % self.num_generations:
            raise ValueError(
                f"{name}: the generation batch (per_device_train_batch_size x dp_size x steps_per_generation = "
                f"{size}; CP ranks share their batch) must be divisible by num_generations ({self.num_generations})"
            )
        if cfg.do_eval and cfg.eval_strategy != "no" and cfg.per_device_eval_batch_size * ring.dp_size % evals:
            raise ValueError(
                f"{name}: the eval batch (per_device_eval_batch_size x dp_size = "
                f"{cfg.per_device_eval_batch_size * ring.dp_size}; CP ranks share their batch) must be divisible by "
                f"the generations per prompt in evaluation ({evals})"
            )
        if size != cfg.generation_batch_size:
            from transformers.utils import logging

            logging.get_logger(__name__).warning(
                f"{name}: generation_batch_size is {size} (per_device_train_batch_size x dp_size x "
                f"steps_per_generation; TRL counted the CP group's ranks as processes: {cfg.generation_batch_size})"
            )
            cfg.generation_batch_size = size
            self._logs = _resized(self._logs, size)  # (TRL keeps the last generation batch's completions)
        from accelerate.utils import set_seed

        set_seed(cfg.seed + ring.dp_rank)  # TRL's seed of process dp_rank, alike on the CP group's ranks

    def _calculate_rewards(self, *args, **kwargs):
        """TRL's rewards (every DP group's), those of the CP group's first rank on every rank of the group: reward
        functions run on every rank (a reward model's engine may need every process), and one that is not
        deterministic (a judge, an API) would otherwise give the group's ranks different advantages."""
        rewards = super()._calculate_rewards(*args, **kwargs)
        ring = self.ring_setup
        if ring.cp_size > 1:
            from .comm import global_rank

            dist.broadcast(rewards, src=global_rank(ring.cp_group, 0), group=ring.cp_group)
        return rewards

    def _prepare_inputs(self, *args, **kwargs):
        with _OverDP(self):
            return super()._prepare_inputs(*args, **kwargs)

    def _generate_single_turn(self, *args, **kwargs):
        if self.ring_setup.cp_size == 1:
            return super()._generate_single_turn(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model_wrapped)  # what TRL's unwrap_model_for_generation yields
        model.generate = _RingGenerate(model)
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            vars(model).pop("generate", None)


def _resized(logs: dict, size: int) -> dict:
    """TRL's completion logs (deques, and default dicts of them) holding at most ``size`` entries each."""
    import collections

    out = {}
    for key, value in logs.items():
        if isinstance(value, collections.defaultdict):
            out[key] = collections.defaultdict(lambda: collections.deque(maxlen=size), value)
        elif isinstance(value, collections.deque):
            out[key] = collections.deque(value, maxlen=size)
        else:
            out[key] = value
    return out


def _ring_preference_trainer(name: str) -> type:
    """``RingDPOTrainer``, ``RingKTOTrainer``, ``RingGRPOTrainer`` or ``RingRLOOTrainer``: TRL's trainer of that name
    with context parallelism."""
    base = name.removeprefix("Ring")
    try:
        import trl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"{name} needs TRL: pip install trl") from e
    return _preference_class(getattr(trl, base), name)


@functools.cache
def _preference_class(base: type, name: str) -> type:
    online = (_OnlineTrainerMixin,) if hasattr(base, "_generate_single_turn") else ()

    class RingPreferenceTrainer(*online, RingAttentionTrainerMixin, base):
        """TRL's preference or online trainer (``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``) with
        context parallelism (``ring_plugin=RingAttentionPlugin(...)``): each sequence's per-token log-probabilities
        are gathered over the whole CP group before TRL's loss (see the module). Refused: ``precompute_ref_log_probs``
        (TRL's own loader splits over every process), the MoE router's auxiliary loss, and images."""

        shards_batches = False
        trl_base = base

        def __init__(self, *args, **kwargs):
            config = kwargs.get("args", args[2] if len(args) > 2 else None)
            if getattr(config, "precompute_ref_log_probs", False):  # (before TRL computes them over the dataset)
                raise ValueError(
                    f"{name} does not support precompute_ref_log_probs=True under context parallelism (TRL's own "
                    "loader for it splits batches over every process)"
                )
            super().__init__(*args, **kwargs)
            ring = self.ring_setup
            if self.ref_model is not None:  # (DeepSpeed has wrapped it in an engine by now)
                apply_to_model(ring, self.accelerator.unwrap_model(self.ref_model))
            for model in (self.model, self.ref_model):
                if model is None or ring.cp_size == 1:
                    continue
                from .apply import unwrap_transformers_model

                target = unwrap_transformers_model(self.accelerator.unwrap_model(model))
                fused = vars(target).get("forward")
                if fused is None:
                    raise ValueError(f"{name}: {type(target).__name__} has no fused LM head from TRL")
                if not isinstance(fused, ShardedFusedHead):
                    target.forward = ShardedFusedHead(fused, ring, target)

        def compute_loss(self, *args, **kwargs):
            """TRL's loss and metrics with its gathers over the DP group (``_OverDP``): a CP group's ranks hold the
            same values, and gathered over every process the last, short batch's cut would keep other groups than a
            plain DP run's (KTO's KL term, part of its loss, is such a gather)."""
            with _OverDP(self):
                return super().compute_loss(*args, **kwargs)

        def _check_loss_contract(self) -> None:
            config = base.__name__.replace("Trainer", "Config")
            refused = {  # (the MoE router's loss would be each rank's, of its own tokens)
                f"the MoE router's auxiliary loss (set {config}(router_aux_loss_coef=0.0))": self.aux_loss_enabled,
                "a vision dataset": getattr(self, "_is_vision_dataset", False),
                "a vision-language model": getattr(self, "_is_vlm", False),
            }
            given = [what for what, on in refused.items() if on]
            if given:
                raise ValueError(f"{name} does not support {', '.join(given)} under context parallelism")

    RingPreferenceTrainer.__name__ = RingPreferenceTrainer.__qualname__ = name
    RingPreferenceTrainer.__module__ = __name__
    return RingPreferenceTrainer


def __getattr__(name: str):
    # the TRL trainers are built on first use, so importing hf_ring.trainer does not import TRL
    if name == "RingSFTTrainer":
        return _ring_sft_trainer()
    if name in ("RingDPOTrainer", "RingKTOTrainer", "RingGRPOTrainer", "RingRLOOTrainer"):
        return _ring_preference_trainer(name)
    raise AttributeError(f"module 'hf_ring.trainer' has no attribute {name!r}")
