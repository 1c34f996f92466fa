"""The vision tower's work divided over the CP group, for vision-language models that encode images by grid.

A batch with images reaches every rank of a CP group whole (``ShardInfo.whole_inputs``): without this, every rank
runs the vision tower on every image of the batch (the same work and the same activations CP times). The families
whose ``get_image_features(pixel_values, image_grid_thw)`` / ``get_video_features(pixel_values_videos,
video_grid_thw)`` encode each image (video) on its own from its rows of ``pixel_values`` (``prod(grid_thw)`` patches
each: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V, the Qwen-Omni thinkers, ...) get ``SplitEncoder`` in their
place while patched (an instance attribute of the module that defines them innermost; ``remove`` deletes it):

- one small all-gather first compares the ranks' images (their count, grids, shape and a sample of their values):
  ranks given different images raise the same error on every rank, before the split's other collectives;
- the images are assigned to ranks (largest first, to the least loaded rank by patch count; every rank computes
  the same assignment from ``grid_thw``), and each rank encodes its own (a ``get_video_features`` that encodes its
  frames with ``get_image_features`` runs the model's own method on the rank's share);
- one all-gather of the feature counts and one of the features (``comm.StateGather``, padded to the largest rank's
  count; both honour the ring's ``timeout``) bring every image's features (and Qwen3-VL's deepstack features) to
  every rank, in the images' order, as the tower would have returned them;
- the all-gather's backward sums every rank's gradient of each image's features onto the rank that encoded it, so
  the tower's parameters get, summed over the CP group, the gradient of every image: the same as before.

Families whose ``get_image_features(pixel_values)`` takes a batch of images of one size (``[images, channels,
height, width]``: Gemma 3, PaliGemma, LLaVA, InternVL, Aya Vision; ``BATCHED``) and returns one feature row per
image (``pooler_output`` ``[images, tokens, width]``, or a list of them: LLaVA) get ``SplitBatch``: each rank encodes a contiguous share of
the images (as many as the others, give or take one), and one all-gather brings every image's features to every
rank, with the same check first and the same backward.

Fewer images than ranks, or ``pixel_values`` not laid out one image after another by ``grid_thw``: every rank
encodes every image, as before. A method that does not return one feature tensor per image (HunyuanOCR's and
MiniMax M3's on Transformers 5.17) is found out on its first call (which then encodes twice) and encodes every image
on every rank from then on, with a warning. ``last_hidden_state`` (the tower's output before its merger) is not
gathered: it is None under the split (the models read the merged features only); ``hidden_states`` and
``attentions``, when asked for, are the rank's own images'.
"""

from __future__ import annotations

import collections
import functools
import inspect

import torch

__all__ = ["BATCHED", "SplitBatch", "SplitEncoder", "install", "remove"]

METHODS = {"get_image_features": ("pixel_values", "image_grid_thw"),
           "get_video_features": ("pixel_values_videos", "video_grid_thw")}  # fmt: skip


def _assign(rows: list, world: int) -> list:
    """The rank encoding each image: largest first, to the least loaded rank (ties: the lowest rank)."""
    load = [0] * world
    owner = [0] * len(rows)
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += rows[i]
    return owner


class SplitEncoder:
    """A vision-language model's ``get_image_features`` / ``get_video_features`` while patched (see the module).

    ``shared``: one dict for a module's encoders: a call inside another (a ``get_video_features`` that encodes its
    frames with ``get_image_features``: Qwen3-VL, Qwen3.5, Kimi K2.5, ...) runs the model's own method on the share
    the outer call gave it."""

    def __init__(self, fn, cfg, names: tuple, shared: dict):
        self.fn = fn  # the model's own method, bound
        self.cfg = cfg
        self.names = names  # its first two parameters: pixel values, grid
        self.shared = shared
        self.whole = False  # the method returns no feature tensor per image: every rank encodes every image
        functools.update_wrapper(self, fn)  # its signature, which generate() reads to encode a prompt's images ahead

    def __call__(self, *args, **kwargs):
        from hf_ring.comm import RingComm, StateGather, group_rank_and_size
        from hf_ring.preflight import check_everywhere, fingerprint

        pixels = args[0] if args else kwargs.pop(self.names[0])
        grid = args[1] if len(args) > 1 else kwargs.pop(self.names[1], None)
        rank, world = group_rank_and_size(self.cfg.group)
        if (
            world == 1
            or self.whole
            or self.shared.get("inside")
            or len(args) > 2
            or not isinstance(pixels, torch.Tensor)
        ):
            return self.fn(pixels, grid, *args[2:], **kwargs)
        n = grid.shape[0] if isinstance(grid, torch.Tensor) and grid.dim() == 2 else 0
        rows = grid.prod(-1).tolist() if n else []
        # every rank must hold the same images before the split's collectives: their count, grids, shape and a
        # sample of their values, compared in one small all-gather (a rank given others raises on every rank)
        flat = pixels.detach().flatten()
        probe = flat[:: max(1, flat.numel() // 4096)].float().cpu().view(torch.int32)
        summary = [0, n, fingerprint(grid) if n else 0, fingerprint(torch.tensor(pixels.shape), probe)]
        check_everywhere(None, summary, RingComm(self.cfg.group), pixels.device, op="hf_ring's vision split",
                         fields=("error", "images", "grids", "pixel values"))  # fmt: skip
        if n < world or pixels.shape[0] != sum(rows):
            return self.fn(pixels, grid, *args[2:], **kwargs)
        owner = _assign(rows, world)
        mine = [i for i in range(n) if owner[i] == rank]
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + r)
        own = torch.cat([pixels[starts[i] : starts[i + 1]] for i in mine])
        asked, given = _as_dict(self.fn, kwargs)
        self.shared["inside"] = True
        try:
            out = self.fn(own, grid[mine], **given)
        finally:
            self.shared["inside"] = False
        pooled = getattr(out, "pooler_output", None)
        if not (isinstance(pooled, (tuple, list)) and len(pooled) == len(mine)):  # (alike on every rank)
            from transformers.utils import logging

            logging.get_logger(__name__).warning(
                f"hf_ring: {getattr(self.fn, '__qualname__', self.fn)} does not return one feature tensor per image "
                "(pooler_output): every rank encodes every image"
            )
            self.whole = True
            return self.fn(pixels, grid, *args[2:], **kwargs)
        local = [f.shape[0] for f in pooled]
        # deepstack features: per image (as pooler_output), or the images' concatenated (Transformers 5.17)
        deep = list(getattr(out, "deepstack_features", None) or [])
        joined = [isinstance(f, torch.Tensor) for f in deep]
        fields = [pooled, *(torch.split(f, local) if j else f for f, j in zip(deep, joined, strict=True))]
        timeout = self.cfg.timeout
        counts = torch.zeros(n, dtype=torch.long, device=pixels.device)
        counts[mine] = torch.tensor(local, dtype=torch.long, device=pixels.device)
        counts = StateGather(self.cfg.group, timeout=timeout, what="the vision features' counts").gather(counts)
        counts = counts.sum(0).tolist()  # every image's feature count, on every rank
        widths = [f[0].shape[-1] for f in fields]
        mixed = torch.cat([torch.cat(list(f), dim=0) for f in fields], dim=-1)  # [my features, sum of widths]
        loads = [sum(counts[i] for i in range(n) if owner[i] == r) for r in range(world)]
        mixed = torch.nn.functional.pad(mixed, (0, 0, 0, max(loads) - mixed.shape[0]))
        every = StateGather(self.cfg.group, timeout=timeout, what="the vision features' all-gather").gather(mixed)
        feats, seen = [None] * n, [0] * world  # every: [world, most features, width]
        for i in range(n):
            r = owner[i]
            feats[i] = every[r, seen[r] : seen[r] + counts[i]]
            seen[r] += counts[i]
        cuts = [sum(widths[:k]) for k in range(len(widths) + 1)]
        parts = [tuple(f[:, cuts[k] : cuts[k + 1]] for f in feats) for k in range(len(widths))]
        out.pooler_output = parts[0]
        if deep:
            out.deepstack_features = [torch.cat(f) if j else f for f, j in zip(parts[1:], joined, strict=True)]
        return _finished(out, asked)


BATCHED = ("gemma3", "paligemma", "llava", "internvl", "aya_vision")
"""Vision-language model types whose ``get_image_features(pixel_values, ...)`` encodes a batch of images of one size
(``SplitBatch``)."""


class SplitBatch:
    """A vision-language model's ``get_image_features(pixel_values [images, ...], ...)`` while patched, for a batch
    of images of one size (``BATCHED``): each rank encodes its contiguous share, the features are all-gathered."""

    def __init__(self, fn, cfg):
        self.fn = fn
        self.cfg = cfg
        self.whole = False  # the method returns no feature row per image: every rank encodes every image
        functools.update_wrapper(self, fn)

    def __call__(self, pixel_values, *args, **kwargs):
        from hf_ring.comm import RingComm, StateGather, group_rank_and_size
        from hf_ring.preflight import check_everywhere, fingerprint

        rank, world = group_rank_and_size(self.cfg.group)
        sized = any(kwargs.get(k) is not None for k in ("image_sizes", "pixel_attention_mask"))
        if world == 1 or self.whole or args or sized or not isinstance(pixel_values, torch.Tensor):
            return self.fn(pixel_values, *args, **kwargs)
        n = pixel_values.shape[0]
        flat = pixel_values.detach().flatten()
        probe = flat[:: max(1, flat.numel() // 4096)].float().cpu().view(torch.int32)
        summary = [0, n, 0, fingerprint(torch.tensor(pixel_values.shape), probe)]
        check_everywhere(None, summary, RingComm(self.cfg.group), pixel_values.device, op="hf_ring's vision split",
                         fields=("error", "images", "grids", "pixel values"))  # fmt: skip
        if n < world:
            return self.fn(pixel_values, **kwargs)
        bounds = [n * r // world for r in range(world + 1)]
        asked, given = _as_dict(self.fn, kwargs)
        out = self.fn(pixel_values[bounds[rank] : bounds[rank + 1]], **given)
        pooled = getattr(out, "pooler_output", None)
        listed = isinstance(pooled, (list, tuple))  # (LLaVA's: a list of the images' features)
        if listed and len(pooled) and len({tuple(f.shape) for f in pooled}) == 1:
            pooled = torch.stack(list(pooled))
        if not (isinstance(pooled, torch.Tensor) and pooled.shape[0] == bounds[rank + 1] - bounds[rank]):
            from transformers.utils import logging  # (alike on every rank)

            logging.get_logger(__name__).warning(
                f"hf_ring: {getattr(self.fn, '__qualname__', self.fn)} does not return one feature row per image "
                "(pooler_output): every rank encodes every image"
            )
            self.whole = True
            return self.fn(pixel_values, **kwargs)
        most = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        padded = torch.nn.functional.pad(pooled, (0, 0) * (pooled.dim() - 1) + (0, most - pooled.shape[0]))
        every = StateGather(self.cfg.group, timeout=self.cfg.timeout, what="the vision features' all-gather")
        every = every.gather(padded)  # [world, most, ...]
        joined = torch.cat([every[r, : bounds[r + 1] - bounds[r]] for r in range(world)])
        out.pooler_output = list(joined.unbind(0)) if listed else joined
        return _finished(out, asked)


def _as_dict(fn, kwargs: dict) -> tuple:
    """``(the caller's return_dict, the keywords with return_dict=True where fn takes it)``: the split reads the
    output's fields, and gives the caller a tuple back where it asked for one."""
    params = inspect.signature(fn).parameters.values()
    if not any(p.name == "return_dict" or p.kind is p.VAR_KEYWORD for p in params):
        return None, kwargs
    return kwargs.get("return_dict"), {**kwargs, "return_dict": True}


def _finished(out, asked):
    """The split's output: without the tower's ``last_hidden_state`` (the rank's own images'; the models read the
    merged features only), as a tuple where the caller asked for one (``return_dict=False``)."""
    if "last_hidden_state" in out.keys():
        collections.OrderedDict.__delitem__(out, "last_hidden_state")  # (ModelOutput keeps it in its dict too)
    out.last_hidden_state = None
    return out.to_tuple() if asked is False else out


def _encoders(model) -> list:
    """(module, method name, its two parameters) for every method of ``METHODS`` a module of ``model`` defines with
    them, innermost only (a wrapper's method that calls its inner model's is left alone)."""
    found = []
    for m in model.modules():
        for name, params in METHODS.items():
            fn = getattr(type(m), name, None)
            if fn is None:
                continue
            names = tuple(list(inspect.signature(fn).parameters)[1:3])
            if names == params:
                found.append((m, name, names))
    inner = []
    for m, name, names in found:
        if not any(o is not m and o_name == name and _holds(m, o) for o, o_name, _ in found):
            inner.append((m, name, names))
    return inner


def _holds(outer, inner) -> bool:
    return any(x is inner for x in outer.modules())


def install(model, cfg) -> None:
    remove(model)
    if getattr(model.config, "model_type", None) in BATCHED:
        found = [m for m in model.modules() if callable(getattr(type(m), "get_image_features", None))]
        for m in found:  # the innermost (a wrapper's method calls its inner model's; a class FSDP2 made inherits it)
            if not any(o is not m and _holds(m, o) for o in found):
                m.get_image_features = SplitBatch(m.get_image_features, cfg)
        return
    shared = {}  # per module
    for m, name, names in _encoders(model):
        setattr(m, name, SplitEncoder(getattr(m, name), cfg, names, shared.setdefault(id(m), {})))


def remove(model) -> None:
    for m in model.modules():
        for name in METHODS:
            if isinstance(vars(m).get(name), (SplitEncoder, SplitBatch)):
                delattr(m, name)
