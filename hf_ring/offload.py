"""``apply_activation_offload``: the checkpointed layers' saved inputs in pinned host memory.

Under activation checkpointing a decoder layer keeps only its inputs for the backward, one ``[batch,
seq, hidden]`` tensor per layer; at long context that is what is left on the device (Llama-3.1-8B, bf16,
512K tokens: 4 GiB per layer, 128 GiB for 32 layers). With the offload switched on, those tensors live
in pinned host memory between the forward and the backward:

- forward: each one (at least ``min_bytes``) is copied to pinned host memory on a side stream that
  waits for the compute stream; the compute stream never waits, and the device memory returns to the
  allocator once the copy has run (``record_stream``);
- backward: the first use copies it back (asynchronously, ordered after its device-to-host copy by an
  event) and starts copying the next one needed (the previous layer's) on the side stream, so that
  copy overlaps this layer's recomputation.

No host synchronisation anywhere; the numbers are exact (copies). On a device other than CUDA the
copies are plain ``.to()`` calls; tensors already on the host are left alone (on a CPU-only machine
the offload changes nothing).

How: each decoder layer's checkpoint function (``_gradient_checkpointing_func``, which Transformers
calls for a checkpointed layer in training) is wrapped so that saved-tensor hooks are pushed around the
checkpoint call. Inside the checkpoint its own hooks take precedence, so what reaches ours is what the
checkpoint keeps: the layer's inputs. Layers that are not checkpointed (``every_n_layers`` > 1) never
call it and keep theirs on the device. The wrapping is renewed by a forward pre-hook of the model, so a
later ``gradient_checkpointing_enable`` (the Trainer calls it in ``train()``) keeps the offload; it does
not depend on where a Transformers release runs module hooks (inside the checkpoint in 5.17, outside
in 5.23). A training forward of a model with offload and no checkpointing at all raises
(offloading every activation would be a different trade).

Transformers' own ``gradient_checkpointing_enable(offload=True)`` (``torch.autograd.graph.save_on_cpu``)
is exact too; its copies run on the compute stream and block the host once per layer.
"""

from __future__ import annotations

import weakref

import torch

__all__ = [
    "DEFAULT_MIN_BYTES", "HostOffload", "activation_offload_of", "apply_activation_offload", "revert_activation_offload",
]  # fmt: skip

DEFAULT_MIN_BYTES = 2**20
"""Saved tensors smaller than this (1 MiB) stay on the device: their copies would cost more than they free."""

_ATTR = "hf_ring_activation_offload"


class _Saved:
    """One offloaded tensor: its host copy, the event after which the copy is complete, and the prefetched
    device copy (if any). ``prev``: the tensor offloaded before it in the same forward (a weak reference)."""

    __slots__ = ("device", "host", "ready", "fetched", "fetched_ready", "prev", "__weakref__")

    def __init__(self, device, host, ready, prev):
        self.device, self.host, self.ready, self.prev = device, host, ready, prev
        self.fetched = self.fetched_ready = None


class HostOffload:
    """The saved-tensor hooks (``pack`` / ``unpack``) that move tensors on ``device_types`` to the host.

    Args:
        min_bytes: tensors smaller than this stay where they are.
        device_types: device types whose tensors are moved (tests add ``"cpu"`` to exercise the path).
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, device_types=("cuda", "xpu", "hpu", "mps")):
        self.min_bytes = min_bytes
        self.device_types = tuple(device_types)
        self.offloaded = 0  # tensors moved (for tests and benchmarks)
        self.offloaded_bytes = 0
        self._last = None
        self._streams = {}

    def new_forward(self) -> None:
        """A new forward starts: prefetching never reaches back into an earlier one."""
        self._last = None

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if t.device.type not in self.device_types or nbytes == 0 or nbytes < self.min_bytes:
            return t  # (torch 2.11's checkpoint also saves an empty placeholder: nothing to move)
        side = self._side_stream(t.device)
        if side is None:
            host, ready = t.detach().to("cpu", copy=True), None
        else:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            side.wait_stream(torch.cuda.current_stream(t.device))  # t is complete
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # its memory is reused only after the copy
            ready = side.record_event()
        saved = _Saved(t.device, host, ready, None if self._last is None else weakref.ref(self._last))
        self._last = saved
        self.offloaded += 1
        self.offloaded_bytes += t.numel() * t.element_size()
        return saved

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.fetched is not None:
            t, saved.fetched = saved.fetched, None
            torch.cuda.current_stream(saved.device).wait_event(saved.fetched_ready)
            t.record_stream(torch.cuda.current_stream(saved.device))
        else:
            if saved.ready is not None:
                torch.cuda.current_stream(saved.device).wait_event(saved.ready)
            t = saved.host.to(saved.device, non_blocking=saved.ready is not None)
        prev = saved.prev() if saved.prev is not None else None
        if prev is not None and prev.ready is not None and prev.fetched is None:
            self._prefetch(prev)
        return t

    def _prefetch(self, saved: _Saved) -> None:
        """Start copying ``saved`` back on the side stream (after its own device-to-host copy)."""
        side = self._side_stream(saved.device)
        with torch.cuda.stream(side):
            side.wait_event(saved.ready)
            saved.fetched = saved.host.to(saved.device, non_blocking=True)
            saved.fetched_ready = side.record_event()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _OffloadedCheckpoint:
    """A layer's ``_gradient_checkpointing_func`` with the saved-tensor hooks pushed around the checkpoint call:
    inside it the checkpoint's own hooks take over, so only what the checkpoint keeps (the layer's inputs)
    reaches ``offload``."""

    def __init__(self, func, offload: HostOffload):
        self.func, self.offload = func, offload

    def __call__(self, function, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.func(function, *args, **kwargs)
        with self.offload.hooks():
            return self.func(function, *args, **kwargs)


def _wrap_checkpoints(layers, offload: HostOffload) -> None:
    """Wrap each checkpointed layer's checkpoint function (again, where enabling checkpointing replaced it)."""
    for layer in layers:
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if func is not None and not isinstance(func, _OffloadedCheckpoint):
            layer._gradient_checkpointing_func = _OffloadedCheckpoint(func, offload)


def _unwrap_checkpoints(layers) -> None:
    for layer in layers:
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if isinstance(func, _OffloadedCheckpoint):
            layer._gradient_checkpointing_func = func.func


def _check_checkpointing(model, args, kwargs):
    """Forward pre-hook of the model: a training forward needs activation checkpointing."""
    offload, _, layers = getattr(model, _ATTR)
    offload.new_forward()
    _wrap_checkpoints(layers, offload)
    if model.training and torch.is_grad_enabled() and not any(layer.gradient_checkpointing for layer in layers):
        raise ValueError(
            f"{type(model).__name__} has activation offload (hf_ring.apply_activation_offload) but no activation "
            "checkpointing: enable it (model.gradient_checkpointing_enable(), or TrainingArguments("
            "gradient_checkpointing=True)), or call hf_ring.revert_activation_offload(model)"
        )


def _layers(target):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in target.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_activation_offload(model, *, min_bytes: int = DEFAULT_MIN_BYTES):
    """Keep what the checkpointed layers save for the backward in pinned host memory (in place).

    Args:
        model: a Transformers ``PreTrainedModel`` or a PEFT model wrapping one, trained with activation
            checkpointing (enabled before or after this call).
        min_bytes: saved tensors smaller than this stay on the device.

    Returns ``model``. Exact; ``revert_activation_offload`` removes it. Calling it again replaces ``min_bytes``.
    """
    from .apply import _transformers_model

    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
    target = _transformers_model(model)
    layers = _layers(target)
    if not layers:
        raise ValueError(
            f"{type(target).__name__} has no checkpointable decoder layers (transformers GradientCheckpointingLayer); "
            "activation offload applies to the inputs those layers keep under activation checkpointing"
        )
    if hasattr(target, _ATTR):
        revert_activation_offload(target)
    offload = HostOffload(min_bytes)
    handles = [target.register_forward_pre_hook(_check_checkpointing, with_kwargs=True)]
    setattr(target, _ATTR, (offload, handles, layers))
    return model


def revert_activation_offload(model):
    """Remove ``apply_activation_offload`` from ``model`` (in place); returns it."""
    from .apply import _transformers_model

    target = _transformers_model(model)
    if not hasattr(target, _ATTR):
        raise ValueError(f"{type(target).__name__} has no activation offload to revert")
    _, handles, layers = getattr(target, _ATTR)
    for handle in handles:
        handle.remove()
    _unwrap_checkpoints(layers)
    delattr(target, _ATTR)
    return model


def activation_offload_of(model) -> HostOffload | None:
    """The ``HostOffload`` of ``model`` (counters ``offloaded``, ``offloaded_bytes``) or None."""
    from .apply import unwrap_transformers_model

    target = unwrap_transformers_model(model)
    state = getattr(target, _ATTR, None) if target is not None else None
    return None if state is None else state[0]
