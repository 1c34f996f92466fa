"""Sequence mixers other than attention under context parallelism: Gated DeltaNet layers (Qwen3-Next, Qwen3.5,
Qwen3.5-MoE, OLMo Hybrid), Kimi Delta Attention (Kimi Linear), lightning attention (MiniMax), Mamba layers (Jamba,
Zamba: one scan per head, Mamba, Falcon-Mamba), Mamba2 layers (Granite 4.0-H, Bamba, Nemotron-H,
Falcon-H1, Zamba2, and the pure Mamba2 model, which has no attention layer), short convolutions (LFM2, LFM2-MoE),
RecurrentGemma's recurrent blocks (a short convolution and the RG-LRU: ``ShardedRecurrentBlock``) and ZAYA's
convolutional attention projection (``ShardedCCA``).

These hybrid models interleave full-attention layers (switched to ring attention like every family) with layers
that look back along the sequence another way: a short causal convolution, followed in the Gated DeltaNet by the
gated delta rule and in Mamba2 by a selective state-space scan, recurrences over the sequence. While a model is patched, each such module's ``forward`` is
replaced (an instance attribute; ``revert`` removes it) by a ``ShardedMixer`` (``ShardedLinear`` for the
linear-attention, Mamba and short-convolution layers), which computes what the module
computes on the unsharded sequence, with the module's own projections, norm and kernels (Transformers'
``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention`` and ``mamba2_chunk_scan``,
or the hub kernels they dispatch to), around ``hf_ring.linear_attention`` (the states and convolution inputs each
chunk needs from the chunks before it, from other ranks).

Checked once per forward, on every rank alike (the ring's pre-flight exchange, so bad input never hangs a rank):
ranks agree on shapes, dtype, layout and batch; the batch is what ``shard_batch`` cut for this group. Packed
documents are kept apart (``hf_ring.linear_attention``: the state and the convolution start afresh at each).
Refused: the striped layout, chunks shorter than the convolution, and a cache holding earlier tokens
(of ``model.generate()``; ``hf_ring.ring_generate`` keeps each layer's state and convolution inputs on every rank
after its prefill, and runs the decode steps locally from them). Padding (``shard_batch``'s
document id -1, or a 2-D ``attention_mask`` with one rank) zeroes the layer's input there, as Transformers does;
a layer its decoder layer calls without the batch's keywords (LFM2 on Transformers 5.17) refuses padded batches.

Qwen4-Exp's per-layer embeddings look back too (hashed n-grams of the token ids, a dilated causal convolution):
``ShardedPLE`` runs their own forward on each run of the rank's tokens, given what lies before it. ZAYA's attention
mixes its queries and keys by two causal convolutions and delays half of each value by a token: ``ShardedCCA``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import guard, preflight
from ..batch_checks import documents, dropped_documents_error, sharding_error, without_all_true
from ..chunks import Uses, previous
from ..comm import RingComm, StateGather, group_rank_and_size
from ..hf_attention import DOCUMENT_IDS_KWARG, LOST_GROUP, RingConfig, lost_group
from ..layout import LAYOUTS, documents_from_cu_seqlens, positions, several_documents
from ..linear_attention import causal_conv1d, chunks, diagonal_scan
from . import _lend, _mixers
from ._hooks import remove_forward
from ._lend import LENT, Lent

__all__ = ["FIELDS", "ShardedCCA", "ShardedLinear", "ShardedMixer", "ShardedPLE", "ShardedRecurrentBlock",
           "ShardedResidualConv", "check", "install", "remove"]  # fmt: skip

FIELDS = ("error", "local_seq", "batch", "hidden", "dtype", "layout", "conv_kernel", "documents",
          *(f"unused_{i}" for i in range(8)))  # fmt: skip
"""What ranks must agree on (as many fields as the ring's pre-flight, whose exchange this joins)."""


class ShardedMixer:
    """The ``forward`` of a sequence-mixing module other than attention while its model is patched: what every kind
    shares (the checks on every rank, padding, packed documents, the group's failure handling, ``ring_generate``'s
    records); each kind's computation is its ``run`` (``ShardedLinear``, ``ShardedPLE``, ``ShardedRecurrentBlock``,
    ``ShardedCCA``).
    Transformers' signatures: ``(hidden_states, cache_params / past_key_values / cache, attention_mask, **kwargs)``
    (Transformers 5.24 names the cache ``cache``)."""

    def __init__(self, module: torch.nn.Module, cfg: RingConfig):
        self.module = module
        self.cfg = cfg

    masks_input = True  # (the module's input is zeroed at padding)

    def __call__(
        self, hidden_states, cache_params=None, attention_mask=None, past_key_values=None, cache=None, **kwargs
    ):
        m, cfg = self.module, self.cfg
        if lost_group(cfg):
            raise ValueError(LOST_GROUP)
        rank, world_size = group_rank_and_size(cfg.group)
        batch, local_len, _ = hidden_states.shape
        if isinstance(attention_mask, Lent):  # the batch's keywords its decoder layer was given (``Lent``)
            attention_mask, kwargs = attention_mask.mask, {**attention_mask.kwargs, **kwargs}
        attention_mask = without_all_true(attention_mask, cfg.plans)  # (GLM-5.3-Flash's text model makes one)
        cache = next((c for c in (cache_params, past_key_values, cache) if c is not None), None)
        memory = _memory(cache, self.record())
        if memory:  # a decode step of ring_generate: the same new tokens on every rank, after the prefill's state
            plan = chunks(local_len, rank=0, world_size=1, layout=cfg.layout)
            try:
                return self.run(hidden_states, plan, None, None, None, memory, kwargs)
            except BaseException as e:  # the peers would wait in the next layer's exchange: stop the group
                if world_size > 1:
                    guard.failed([cfg.group], e, f" in a decode step of layer {self.layer}")
                raise
        if memory is not None:  # the prefill: the padding ring_generate added before the prompt reaches no convolution
            memory["added"] = _added(cache, hidden_states.device)
        error = _refusal(m, cache, memory, cfg, rank, world_size, local_len) or dropped_documents_error(m, kwargs, cfg)
        keep = docs = packed = None
        if error is None:
            error, keep, docs, packed = _padding(m, attention_mask, kwargs, cfg, rank, world_size, local_len)
        if world_size == 1:
            if error:
                raise guard.InStepError(f"{type(m).__name__}: {error}")
        else:
            self._check(error, hidden_states, docs, rank, world_size)
        # padding: the input zeroed there, as Transformers' apply_mask_to_padding_states
        if keep is not None and self.masks_input:
            hidden_states = _mixers.masked(hidden_states, keep)
        plan = chunks(local_len, rank=rank, world_size=world_size, layout=cfg.layout)
        if world_size == 1:
            return self.run(hidden_states, plan, None, packed, keep, memory, kwargs)
        groups = [cfg.group]
        grad = torch.is_grad_enabled() and hidden_states.requires_grad
        name = "a linear-attention layer"
        if cfg.plans is not None:  # counted as the ring's calls are (hf_ring.guard), named by its layer
            cfg.plans.progress.label = f"layer {self.layer}"
            name = cfg.plans.progress.call(groups, grad)
        try:
            gather = StateGather(cfg.group, cfg.timeout)
            return self.run(hidden_states, plan, gather, packed, keep, memory, kwargs)
        except BaseException as e:  # out of step with the peers from here on: stop the group (hf_ring.guard)
            guard.failed(groups, e, f" in {name}")
            raise

    @property
    def layer(self) -> int:
        """The index of the module's decoder layer."""
        return self.module.layer_idx

    def record(self):
        """The key of the module's record in ``ring_generate``'s sharded cache (``_memory``)."""
        return self.layer

    def run(self, hidden_states, plan, gather, packed, keep, memory, kwargs):
        """The module's computation on this rank's tokens (after the checks)."""
        raise NotImplementedError

    def _check(self, error, hidden_states, docs, rank, world_size) -> None:
        """The cross-rank check, once per forward (the plan cache's), joined by every rank (``docs``: the batch's
        document ids of the unsharded sequence, the same on every rank, or None)."""
        m, cfg = self.module, self.cfg
        plans = cfg.plans
        key = ("mixer", rank, world_size, cfg.layout, tuple(hidden_states.shape), hidden_states.dtype)
        if error is None and plans is not None and plans.checked(key, (docs,)) is not None:
            return
        b, n, _ = hidden_states.shape
        summary = [
            0, n, b, hidden_states.shape[-1], preflight.dtype_index(hidden_states.dtype), LAYOUTS.index(cfg.layout),
            conv_kernel_size(m), -1 if docs is None else preflight.fingerprint(docs), 0, 0, 0, 0, 0, 0, 0, 0,
        ]  # fmt: skip
        if error is not None:
            summary = [1] + [0] * (len(FIELDS) - 1)
        comm = RingComm(cfg.group, timeout=cfg.timeout)
        preflight.check_everywhere(error, summary, comm, hidden_states.device, fields=FIELDS, op=type(m).__name__)
        if plans is not None:
            plans.store(key, (docs,), True)


class ShardedLinear(ShardedMixer):
    """A linear-attention, Mamba / Mamba2 or short-convolution module (``_mixers.computation``), with the kernels of the
    Transformers module defining its class (``_mixers.kernels``: found when installed, or a clear error)."""

    def __init__(self, module: torch.nn.Module, cfg: RingConfig):
        super().__init__(module, cfg)
        self.compute = _mixers.computation(module)
        self.kernels = _mixers.kernels(module)

    def run(self, hidden_states, plan, gather, packed, keep, memory, kwargs):
        return self.compute(self.module, self.kernels, hidden_states, plan, gather, packed, keep, memory)


class ShardedPLE(ShardedMixer):
    """The ``forward`` of Qwen4-Exp's per-layer embedding (``(hidden_states, input_ids, cache, conv_mask)``) while
    its model is patched. It looks back along the sequence twice: its n-gram embedding hashes each token's id with
    the ``n - 1`` ids before it, and a dilated causal convolution mixes its gated values with those of the tokens
    before. Its own forward runs on each of this rank's runs of tokens, given what lies before the run (``_Halo``).
    Its decoder layer calls it without the batch's keywords: the layer lends them in ``conv_mask`` (``Lent``). In
    ``ring_generate`` its record (``("ple", layer)``, beside its layer's mixer's) keeps the sequence's last ids and
    convolution inputs, the same on every rank, from which a decode step runs locally."""

    masks_input = False  # (the module zeroes its gated values at padding itself, given the padding as conv_mask)

    def __call__(self, hidden_states, input_ids, cache=None, conv_mask=None, **kwargs):
        return super().__call__(hidden_states, attention_mask=conv_mask, cache=cache, ple_input_ids=input_ids)

    def record(self) -> tuple:
        return ("ple", self.module.layer_idx)

    def run(self, hidden_states, plan, gather, packed, keep, memory, kwargs):
        m = self.module
        eos = m.ple_embedding.eos_token_id
        ids = kwargs["ple_input_ids"]
        added = None if memory is None else memory.pop("added", None)
        if added is not None:  # ring_generate's padding before the prompt: as if nothing were there
            kept = ~added.to(ids.device)[None]
            keep = kept if keep is None else keep.bool() & kept
        if keep is not None:  # (the model gives padding the end-of-sequence id when it sees a 2-D mask)
            ids = torch.where(keep.bool(), ids, eos)
        batch = hidden_states.shape[0]
        runs = plan.split(ids.expand(batch, -1), dim=1)  # [runs, batch, run length]
        context = m.ple_embedding.context_len
        fill = torch.full_like(runs[0, :, :context], eos)  # (the model's context before the sequence)
        tails = None
        if memory:  # a decode step of ring_generate: after the sequence's last ids and convolution inputs
            before = memory["ids"][None]
        elif gather is None:
            before = fill.expand(plan.count, *fill.shape)
        else:
            with torch.no_grad():
                tails = gather.gather(runs[..., runs.shape[-1] - context :])
            before = previous(tails, plan, fill)
        halo = _Halo(before.flatten(0, 1), plan, gather, None if not memory else memory["conv"])
        stacked = plan.split(hidden_states, dim=1).flatten(0, 1)
        mask = None if keep is None else plan.split(keep.expand(batch, -1), dim=1).flatten(0, 1)
        out = type(m).forward(m, hidden_states=stacked, input_ids=runs.flatten(0, 1), cache=halo, conv_mask=mask)
        out = plan.join(out.unflatten(0, (plan.count, batch)), dim=1)
        if memory is not None:  # the sequence's last ids and convolution inputs, for ring_generate's next step
            if tails is not None:
                last = tails[plan.owner(plan.total - 1)]
            else:
                last = torch.cat([before[-1], runs[-1]], dim=-1)[..., -context:] if context else before[-1]
            memory["ids"], memory["conv"] = last, halo.last
        return out if halo.tails is None else Uses.apply(out, halo.tails)


class ShardedResidualConv(ShardedLinear):
    """The ``forward`` of Inkling's and Inkling 2's short convolutions (``(hidden_states, dynamic_input, cache,
    conv_mask, cache_offset)``: four per layer, on the keys, the values and the outputs of attention and MLP, each
    added to its input; Inkling 2's full layers weight their keys' and values' by taps projected from
    ``dynamic_input``) while the model is patched. Inkling's callers leave out the batch's keywords: the module calling
    each lends them in ``conv_mask`` (``Lent``)."""

    masks_input = False  # (its input is zeroed at padding for the convolution only, not for the residual)

    def __call__(self, hidden_states, dynamic_input=None, cache=None, conv_mask=None, cache_offset=0, **kwargs):
        if cache_offset and cache is not None:  # (Inkling 2 Loop's passes: caches of their own; ring_generate refuses)
            raise ValueError(f"{type(self.module).__name__}: a cache at cache_offset={cache_offset} is not supported")
        kwargs = {**kwargs, "conv_dynamic_input": dynamic_input}
        return super().__call__(hidden_states, attention_mask=conv_mask, cache=cache, **kwargs)

    def run(self, hidden_states, plan, gather, packed, keep, memory, kwargs):
        dynamic = kwargs.get("conv_dynamic_input")
        return self.compute(self.module, self.kernels, hidden_states, plan, gather, packed, keep, memory, dynamic)

    def record(self) -> tuple:
        return ("conv", self.module.layer_idx, self.module.conv_idx)


class ShardedRecurrentBlock(ShardedMixer):
    """The ``forward`` of RecurrentGemma's recurrent block (Griffin's: ``(input_states, position_ids, attention_mask,
    use_cache, ...)``, returning ``(output, None)``) while its model is patched: its depthwise convolution over the
    CP group (``causal_conv1d``), then the RG-LRU's gates computed by the module itself on this rank's tokens and
    its recurrence over the group (``hf_ring.linear_attention.diagonal_scan``); in ``ring_generate`` its record keeps
    the convolution's last inputs and the state after the prompt, from which decode steps run locally, as the
    model's own decoding runs from the state it keeps on the module. The recurrence starts afresh where
    ``position_ids`` is 0, as in the model, and packed documents are kept apart in the convolution and the
    recurrence both, as if each ran alone (the model's convolution would run across them). Padding is not zeroed:
    the model feeds it into its recurrence as it is."""

    masks_input = False
    layer = None  # (the module keeps no index: ``install`` finds it)

    def __init__(self, module: torch.nn.Module, cfg: RingConfig, layer: int | None = None):
        super().__init__(module, cfg)
        self.layer = layer

    def record(self):
        return ("recurrent_block", self.layer)

    def run(self, hidden_states, plan, gather, packed, keep, memory, kwargs):
        m = self.module
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(f"{type(m).__name__} was called without position_ids: its recurrence resets at position 0")
        y = m.act_fn(m.linear_y(hidden_states))
        x = m.linear_x(hidden_states).transpose(1, 2)

        def conv(t):  # (the model's own convolution, padded on both sides: its first outputs are the causal ones)
            return m.conv_1d(t)[..., : t.shape[-1]]

        x = causal_conv1d(x, conv, m.conv1d_width, plan, gather, packed, memory).transpose(1, 2)
        starts = None
        if packed is not None:  # (once per forward with a plan cache: every layer then reuses its device copy)
            rank, world_size = group_rank_and_size(self.cfg.group) if plan.world_size > 1 else (0, 1)

            def make():
                return _document_starts(packed, rank, world_size, self.cfg.layout).to(x.device, non_blocking=True)

            starts = make() if self.cfg.plans is None else self.cfg.plans.derived((_document_starts, packed), make)

        def scan(hidden_states, recurrent_gate, reset, recurrent_states=None, **_):
            if starts is not None:
                reset = reset | starts[:, :, None]
            a = recurrent_gate.float() * ~reset  # (as the model's scan: no carry across a reset)
            out = diagonal_scan(hidden_states, a, plan=plan, gather=gather, memory=memory)
            return out.to(hidden_states.dtype), None

        lru = m.rg_lru
        lru._rnn_scan = scan  # the module's gates, then this scan (an instance attribute for this call)
        try:
            x = lru(x, position_ids.expand(x.shape[0], -1))
        finally:
            del lru._rnn_scan
            lru.recurrent_states = None
        return m.linear_out(x * y), None


class ShardedCCA(ShardedMixer):
    """The ``forward`` of ZAYA's compressed convolutional attention projection (``(hidden_states, cache, conv_mask)
    -> (query, key, value)``) while its model is patched: queries and keys mixed by its two causal convolutions over
    the CP group (``causal_conv1d``: the inputs before each chunk from the ranks holding them), their residual paths
    per token, and the values' delayed half from the token before (the same exchange, one token back). Packed
    documents are kept apart in both (the model's own convolution and delay run across them, as if each ran alone
    here). Its attention module calls it without the batch's keywords: the module lends them in ``conv_mask``. In
    ``ring_generate`` its record keeps the last convolution inputs and the last token's input."""

    def record(self):
        return ("cca", self.module.layer_idx)

    def run(self, hidden_states, plan, gather, packed, keep, memory, kwargs):
        m = self.module
        qk_memory = v_memory = None
        if memory is not None:  # (two convolutions: a record each, ring_generate's padding given to both)
            added = memory.pop("added", None)
            qk_memory, v_memory = memory.setdefault("qk", {}), memory.setdefault("v", {})
            if added is not None:
                qk_memory["added"] = v_memory["added"] = added
        batch, n, _ = hidden_states.shape
        heads = (batch, n, -1, m.head_dim)
        queries, keys = m.q_proj(hidden_states), m.k_proj(hidden_states)
        # the residual paths, per token (as the module computes them)
        key_residual = keys.view(heads).repeat_interleave(m.num_key_value_groups, dim=2)
        query_residual = (queries.view(heads) + key_residual) * 0.5
        key_residual = query_residual.view(batch, n, -1, m.num_key_value_groups, m.head_dim).mean(dim=-2)

        def conv(t):  # (the module's two convolutions, unpadded: zeros before the start make them causal)
            return m.conv_qk_grouped(m.conv_qk_depthwise(F.pad(t, (m.conv_kernel_size, 0))))

        mixed = torch.cat([queries, keys], dim=-1).transpose(1, 2)
        mixed = causal_conv1d(mixed, conv, m.conv_kernel_size + 1, plan, gather, packed, qk_memory).transpose(1, 2)
        width = query_residual.shape[-2] * query_residual.shape[-1]
        query = mixed[..., :width].reshape(heads) + query_residual
        key = mixed[..., width:].reshape(heads) + key_residual

        def shift(t):  # each token's input is the one before it (zeros before the start)
            return F.pad(t, (1, 0))[..., :-1]

        before = causal_conv1d(hidden_states.transpose(1, 2), shift, 2, plan, gather, packed, v_memory)
        value = torch.cat([m.v_proj_current(hidden_states), m.v_proj_delayed(before.transpose(1, 2))], dim=-1)
        return query, key, value.view(heads)


def _document_starts(documents: torch.Tensor, rank: int, world_size: int, layout: str) -> torch.Tensor:
    """[1 or batch, local_seq] True at this rank's tokens that start a document (``documents``: the unsharded
    sequence's ids, [1 or batch, full_seq])."""
    at = positions(documents.shape[1], rank=rank, world_size=world_size, layout=layout)
    before = documents[:, (at - 1).clamp_min(0)]
    return (at == 0) | (documents[:, at] != before)


class _Halo:
    """Stands for the cache of Qwen4-Exp's per-layer embedding run on this rank's runs of tokens, stacked on the
    batch: its n-gram context is the ids before each run (``ids``); handed its convolution's inputs, it puts the
    last ones before each run in front of them (gathered from the ranks holding them; zeros before the sequence;
    ``conv``, in a decode step: the sequence's last ones), and keeps the sequence's last ones (``last``)."""

    def __init__(self, ids: torch.Tensor, plan, gather, conv: torch.Tensor | None = None):
        self.ids, self.plan, self.gather, self.conv = ids, plan, gather, conv
        self.tails = self.last = None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.ids

    def update_conv_state(self, x, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 0, **kwargs):
        if state_idx != 1 or conv_kernel_size == 0:  # (the n-gram context, kept by nobody)
            return x
        runs = x.unflatten(0, (self.plan.count, -1))  # [runs, batch, channels, run length]
        zeros = torch.zeros_like(runs[0, ..., :conv_kernel_size])
        if self.conv is not None:
            before = self.conv[None]
        elif self.gather is None:
            before = zeros.expand(self.plan.count, *zeros.shape)
        else:
            self.tails = self.gather.gather(runs[..., runs.shape[-1] - conv_kernel_size :])
            before = previous(self.tails, self.plan, zeros)
        joined = torch.cat([before, runs], dim=-1)
        if self.tails is not None:
            self.last = self.tails[self.plan.owner(self.plan.total - 1)].detach()
        else:
            self.last = joined[-1, ..., joined.shape[-1] - conv_kernel_size :].detach()
        return joined.flatten(0, 1)


def _memory(cache, layer_idx) -> dict | None:
    """``hf_ring.ring_generate``'s record of this layer (its convolution's last inputs and its state after the
    sequence, or a record per head under ``"heads"``: Zamba; empty before the prefill), kept by its sharded cache;
    None outside ``ring_generate``."""
    records = getattr(cache, "mixer_records", None)
    return None if records is None else records.setdefault(layer_idx, {})


def _added(cache, device) -> torch.Tensor | None:
    """[local_seq] True at this rank's tokens that ``ring_generate`` added before the prompt (None: none)."""
    st = cache.state
    return None if st.offset == 0 else (st.local < st.offset).to(device)


def _refusal(m, cache_params, memory, cfg: RingConfig, rank: int, world_size: int, local_len: int) -> str | None:
    """What this rank cannot run, as a message that says what to do; or None."""
    layer = getattr(m, "layer_idx", None)  # (RecurrentGemma's recurrent blocks keep none: their caches are their own)
    if cache_params is not None and (
        (layer is not None and _has_state(cache_params, layer)) or _passed(cache_params, m, memory)
    ):
        return (
            "a cache holding earlier tokens (generation) is not supported for linear-attention layers under "
            "hf_ring; generate with hf_ring.ring_generate(model, inputs, ...), or call "
            "hf_ring.revert_ring_attention(model) before generate()"
        )
    try:
        n = chunks(local_len, rank=rank, world_size=world_size, layout=cfg.layout).length
    except ValueError as e:  # the striped layout
        return str(e)
    if world_size > 1 and n < conv_kernel_size(m) - 1:
        return (
            f"each rank's chunks hold {n} tokens, fewer than the convolution's {conv_kernel_size(m) - 1} inputs "
            "before a token; use longer sequences"
        )
    return None


_PASSED = "_hf_ring_passed"


def _passed(cache, m, memory) -> bool:
    """A cache of Transformers' (not ``ring_generate``'s: ``memory`` None) that went through this layer before: the
    replaced forward does not fill it, so this call is a decode step after it (``model.generate()``), which would
    start from a zero state. Notes this call's passing."""
    if memory is not None:
        return False
    try:
        seen = cache.__dict__.setdefault(_PASSED, set())
    except AttributeError:  # (a cache without a __dict__: not marked)
        return False
    passed = id(m) in seen
    seen.add(id(m))
    return passed


def conv_kernel_size(m) -> int:
    """The module's convolution width (1: none, MiniMax's lightning attention; Qwen4-Exp's per-layer embedding: one
    more than the tokens it looks back, by its dilated convolution or its n-grams)."""
    if hasattr(m, "ple_embedding"):
        return max(m.short_conv_state_len, m.ple_embedding.context_len) + 1
    if hasattr(m, "conv_qk_depthwise"):  # ZAYA's CCA: its two convolutions look back conv_kernel_size tokens
        return m.conv_kernel_size + 1
    return getattr(m, "conv_kernel_size", getattr(m, "conv1d_width", 1))


def _has_state(cache, layer_idx: int) -> bool:
    """The cache already holds this layer's state (Transformers 5.23's and 5.17's cache interfaces)."""
    for name in ("get_recurrent_state", "get_conv_state"):  # 5.23
        get = getattr(cache, name, None)
        if get is not None:
            try:
                if get(layer_idx, state_idx=0) is not None:
                    return True
            except (IndexError, KeyError, TypeError, AttributeError, ValueError):
                pass
    has = getattr(cache, "has_previous_state", None)  # 5.17
    if has is not None:
        try:
            return bool(has(layer_idx))
        except (IndexError, KeyError, TypeError, AttributeError, ValueError):
            return False
    return False


def _padding(m, attention_mask, kwargs, cfg: RingConfig, rank, world_size, local_len):
    """``(error, keep, docs, packed)``: why the batch cannot run here (or None); ``[batch or 1, local_seq]`` 1 for
    tokens, 0 for padding (None: no padding); the document ids of the unsharded sequence (None: none); the same as
    int64 CPU ids when some row holds several documents (else None). Derived as the ring's attention derives
    them; once per forward with a plan cache (every layer then gets the same objects)."""
    sharding = sharding_error(m, kwargs, cfg, rank, world_size, local_len)
    if sharding:
        return sharding, None, None, None
    device = _mixers.output(m).weight.device

    def make():
        return _keep(attention_mask, kwargs, cfg.layout, rank, world_size, local_len, device)

    if cfg.plans is None:
        return make()
    sources = (attention_mask, *(kwargs.get(k) for k in (DOCUMENT_IDS_KWARG, "cu_seq_lens_q", "seq_idx")))
    return cfg.plans.derived((_keep, *sources), make)


def _keep(attention_mask, kwargs, layout, rank, world_size, local_len, device):
    full = local_len * world_size
    try:
        docs, cu = documents(attention_mask, kwargs, full, world_size)
    except ValueError as e:
        return str(e), None, None, None
    if cu is not None:
        docs = documents_from_cu_seqlens(cu, full)[None]
    if docs is None:
        return None, None, None, None
    ids = docs.detach().cpu().long()
    packed = ids if several_documents(ids, None) else None
    if bool((ids >= 0).all()):
        return None, None, docs, packed
    local = positions(full, rank=rank, world_size=world_size, layout=layout)
    return None, (ids[:, local] >= 0).to(device), docs, packed


def check(modules: list) -> None:
    """ValueError for modules whose ``forward`` cannot be replaced (before anything is patched)."""
    hooked = [type(m).__name__ for m in modules if any(hasattr(c, "_hf_hook") for c in m.modules())]
    if hooked:  # its instance forward is Accelerate's (device_map / offload), which a revert must not lose
        raise ValueError(
            f"{hooked[0]} carries Accelerate hooks (a model loaded with device_map= or offloaded): hf_ring cannot "
            "run its layers on a sharded sequence then; load the model without device_map for training"
        )


def install(model: torch.nn.Module, modules: list, cfg: RingConfig, lend: str | None = None) -> None:
    """Replace each module's forward. ``lend``: ``"layer"``, the decoder layer holding each lends it the batch's
    keywords of its call; ``"model"``, ``model`` lends them to all (``Lent``); ``"base"``, ``model`` lends them to
    its base model, which unpacks them into its own call (``UnpackLent``). ``_lend.remove`` takes those hooks down."""
    for m in modules:
        if hasattr(m, "rg_lru"):
            layer = _layer_index(model, m)
            if layer is None:  # (ring_generate keys each block's record by it)
                raise ValueError(f"{type(m).__name__} is in no list of decoder layers: hf_ring cannot number it")
            m.forward = ShardedRecurrentBlock(m, cfg, layer)
        elif hasattr(m, "conv_qk_depthwise"):
            m.forward = ShardedCCA(m, cfg)
        elif hasattr(m, "conv_idx"):
            m.forward = ShardedResidualConv(m, cfg)
        else:
            m.forward = (ShardedPLE if hasattr(m, "ple_embedding") else ShardedLinear)(m, cfg)
    ple = [m for m in modules if hasattr(m, "ple_embedding")]
    if ple:  # (called without the batch's keywords: its decoder layer lends them in conv_mask)
        _lend.install(model, ple, keys=LENT, unpack=False, into="conv_mask")
    convs = [m for m in modules if hasattr(m, "conv_idx")]
    if convs:  # (called without the batch's keywords: the attention module or decoder layer lends them in conv_mask)
        _lend.install(model, convs, keys=LENT, unpack=False, into="conv_mask")
    cca = [m for m in modules if hasattr(m, "conv_qk_depthwise")]
    if cca:  # (called with the mask mapping's "conv" entry alone: its attention module lends the keywords there)
        _lend.install(model, cca, keys=LENT, unpack=False, into="attention_mask", entry="conv")
    if lend == "layer":
        _lend.install(model, modules, keys=LENT, unpack=False)
    elif lend == "model" or (lend == "base" and model.base_model is not model):  # (a bare base model: nothing to lend)
        _lend.install_on_model(model, LENT, unpack_in_base=lend == "base")


def _layer_index(model: torch.nn.Module, module: torch.nn.Module) -> int | None:
    """The index of the decoder layer holding ``module`` in the model's list of layers (None: not in one)."""
    for layers in model.modules():
        if isinstance(layers, torch.nn.ModuleList):
            for i, layer in enumerate(layers):
                if any(sub is module for sub in layer.modules()):
                    return i
    return None


def remove(model: torch.nn.Module) -> None:
    for m in model.modules():
        remove_forward(m, ShardedMixer)  # (ShardedPLE too)
