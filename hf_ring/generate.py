"""``ring_generate``: Transformers' ``generate()`` on a ring-attention model, with the KV cache sharded over the CP group.

Every rank calls ``hf_ring.ring_generate(model, inputs, **generate_kwargs)`` with the same full prompt (as users
hold it) and gets the same sequences back. Inside, Transformers' own ``generate()`` runs unchanged (logits
processors, stopping criteria, streamers, sampling) with two differences:

- **Prefill**: the prompt is left-padded to the layout's multiple (masked tokens, so the last prompt token stays
  last) and sharded like a training batch (``shard_batch``); the forward runs the ring exactly as training does,
  and each layer's keys/values of this rank's tokens go into a ``ShardedCache`` (a Transformers ``Cache``): 1/N of
  the prompt's cache per rank. The next-token logits come from the rank holding the last position, broadcast to
  the others (one collective).
- **Decoding**: each new token's hidden states are the same on every rank; each layer attends its query to every
  rank's cached keys with ``decode_attention`` (local attention, one all-gather of (out, LSE) per layer, merged by
  the log-sum-exp rule), with the masks from global positions (causal, sliding windows, left padding). New tokens'
  keys/values are kept round-robin (token j of the continuation on rank j mod N), so shards stay balanced.
- **Hybrids** (linear-attention, Mamba2 and short-convolution layers): the prefill leaves each such layer's state
  after the whole prompt and its convolution's last inputs on every rank (composed from the chunks' states it
  exchanges anyway); each decode step runs those layers on the new tokens locally from there with the model's
  one-token kernels, like the unsharded model's decoding, with no exchange. A short prompt is left-padded
  further, so that every rank's chunks hold the convolutions' inputs before a token; the padding added here
  reaches no convolution (its inputs are zeroed there: a projection's bias would otherwise reach the first
  tokens' convolution).

- **Prompts with images** (the vision-language families that take images under the ring): the prefill hands the
  whole left-padded prompt to the model with its images (or the vision features ``generate()`` computed ahead) and
  its position ids (Qwen-VL's multimodal rows as ``generate()`` computed them on the prompt, so the offsets it
  keeps for the decode steps stay its own), as a training batch with images goes (``ShardInfo.whole_inputs``): the
  model merges the features on the whole sequence and its text model cuts the embeddings and positions to the
  rank's shard; Gemma's image tokens see each other both ways there. The decode steps are text. A prompt whose
  images enter by cross-attention (Llama 3.2 Vision: a ``cross_attention_mask``) is sharded as text, that mask with
  it, the images whole; the cross-attention layers' cache keeps every image's keys on every rank.

A model called without a cache during ``generate()`` (Phi-3 drops it when its longrope factors switch, to compute
every key anew) gets a new prefill of the whole sequence into the emptied sharded cache, as Transformers computes it.

Once per forward a pre-flight check (one small all-gather) makes every rank raise the same error when ranks hold
different prompts, different generation settings (its plain keywords and generation configs) or different new
tokens, and after each step's tokens are chosen a stopping criterion that never stops compares them again (the last
step's too, which no forward follows): ranks that sample with different seeds raise together, instead of hanging or
diverging.

Refused with an error naming the option, whether given as a keyword, in the generation config given or in the
model's: beam search (``num_beams > 1``), assisted / speculative decoding (``assistant_model``,
``prompt_lookup_num_tokens``, ``assistant_early_exit``), another cache (``past_key_values``, ``cache`` or
``cache_params``, ``cache_implementation``; the ``"hybrid"`` of sliding-window checkpoints' configs is dropped by
``generate()`` itself), ``use_cache=False``, ``prefill_chunk_size``, ``max_time`` (each rank's clock), ``custom_generate``,
``output_hidden_states`` (each rank's hidden states are its shard's). Sampling works when every rank seeds its
generator alike (the same as for training).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.distributed as dist

from .apply import unwrap_transformers_model
from .batch import (
    CROSS_KEYS,
    ENCODED_KEY,
    MEDIA_KEYS,
    TOKEN_TYPE_KEYS,
    carries,
    multimodal,
    pad_tokens,
    per_token_key,
    shard_batch,
)
from .comm import RingComm, global_rank, group_rank_and_size
from .hf_attention import CONFIG_ATTR, DECODE_KWARG
from .layout import positions, required_multiple, shard
from .preflight import check_everywhere, fingerprint

__all__ = ["ring_generate"]

_REFUSED = {
    "num_beams": (lambda v: v is not None and v > 1, "beam search (num_beams > 1)"),
    "assistant_model": (lambda v: v is not None, "assisted decoding (assistant_model)"),
    "prompt_lookup_num_tokens": (lambda v: v is not None, "prompt-lookup decoding (prompt_lookup_num_tokens)"),
    "past_key_values": (lambda v: v is not None, "a cache of your own (past_key_values)"),
    "cache": (lambda v: v is not None, "a cache of your own (cache)"),
    "cache_params": (lambda v: v is not None, "a cache of your own (cache_params)"),
    "cache_implementation": (lambda v: v is not None, "cache_implementation (static and other caches)"),
    "use_cache": (lambda v: v is False, "use_cache=False (decoding needs the sharded cache)"),
    "assistant_early_exit": (lambda v: v is not None, "self-speculative decoding (assistant_early_exit)"),
    "prefill_chunk_size": (lambda v: v is not None, "chunked prefill (prefill_chunk_size; the ring prefills at once)"),
    "max_time": (lambda v: v is not None, "max_time (each rank's clock would stop it at another step)"),
    "custom_generate": (lambda v: v is not None, "a generation loop of your own (custom_generate)"),
    "output_hidden_states": (lambda v: bool(v), "output_hidden_states (each rank holds its shard's hidden states)"),
}
_PREFILL_FIELDS = ("error", "batch", "length", "fingerprint", "generation settings")
_TOKEN_FIELDS = ("error", "batch", "length", "token_fingerprint")
# what the prefill sets itself (the rest of an image prompt's keywords go to the model with it)
_PREFILL_OWN = ("position_ids", "cache", "cache_params", "past_key_values", "use_cache", "cache_position",
                "logits_to_keep", "return_dict", "output_attentions", "output_hidden_states")  # fmt: skip


@dataclasses.dataclass
class _State:
    """What the cache's layers and the model's hooks share during one ``ring_generate``."""

    group: object
    rank: int
    world: int
    layout: str
    phase: str = "prefill"
    offset: int = 0  # left padding added to the prompt: a global index is generate's position + offset
    prompt: int = 0  # padded prompt length
    local: torch.Tensor | None = None  # global positions of this rank's prompt tokens
    docs: torch.Tensor | None = None  # [batch, padded prompt] int32 document ids (-1: padding)
    q_pos: torch.Tensor | None = None  # global positions of the tokens of the current decode step
    generated: int = 0  # tokens decoded so far (every rank counts them all)
    kv_source: dict = dataclasses.field(default_factory=dict)  # layer that reuses another's keys/values -> that layer
    updated: object = None  # the cache layer updated last (an attention block shared by several layers: its call's)
    halo: int = 0  # hybrids: the most inputs before a token any convolution reads (each chunk needs at least that)
    settings: int = 0  # a digest of the generation settings (the same on every rank: checked at the prefill)
    hooks: list = dataclasses.field(default_factory=list)  # handles of hooks set for one forward (removed at the end)


@functools.cache
def _cache_classes():
    """``(ShardedLayer, ShardedCache)``, built on Transformers' ``DynamicLayer`` and ``Cache`` (imported lazily)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class ShardedLayer(DynamicLayer):
        """One layer's cache: this rank's keys/values, their global positions and document ids.

        ``get_seq_length`` counts every rank's tokens, in ``generate()``'s coordinates (without the padding added
        for the layout), so Transformers' bookkeeping sees the whole sequence."""

        def __init__(self, state: _State):
            super().__init__()
            self.state = state
            self.length = 0
            self.positions = torch.zeros(0, dtype=torch.long)
            self.docs = None
            self.padded = False  # some cached key is padding (else the documents need no mask)
            self.indexer_position_ids = None  # (Qwen4-Exp's model keeps its positions on its first indexed layer)

        def update(self, key_states, value_states, *args, **kwargs):
            st = self.state
            st.updated = self
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if st.phase == "prefill":
                pos, docs = st.local, st.docs[:, st.local]
                self.length += st.prompt - st.offset
            else:
                t = key_states.shape[2]
                mine = [i for i in range(t) if (st.generated + i) % st.world == st.rank]
                pos = st.q_pos[mine]
                docs = torch.zeros(key_states.shape[0], len(mine), dtype=torch.int32)
                index = torch.tensor(mine, dtype=torch.long, device=key_states.device)
                key_states, value_states = key_states.index_select(2, index), value_states.index_select(2, index)
                self.length += t
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = torch.cat([self.positions, pos])
            self.docs = docs if self.docs is None else torch.cat([self.docs, docs], dim=1)
            self.padded = self.padded or bool((docs < 0).any())
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def get_mask_sizes(self, query, *args) -> tuple[int, int]:
            q = query.shape[0] if isinstance(query, torch.Tensor) else int(query)
            return self.length + q, 0

    class ShardedCache(Cache):
        """A Transformers ``Cache`` whose layers keep this rank's shard of the keys/values (see the module)."""

        WHOLE_INDEXER_KEYS = True  # its update_indexer takes the whole sequence's (hf_ring.sparse)

        def __init__(self, state: _State, num_layers: int, local_layers: frozenset = frozenset()):
            self.local_layers = local_layers  # cross-attention layers (Mllama): the image keys, whole on every rank
            Cache.__init__(self, layers=self._new_layers(state, num_layers))  # (not a subclass's base)
            self.state = state
            # hybrids: each recurrent layer's record (its convolution's last inputs, its state after the sequence),
            # the same on every rank: written by the prefill, carried on by every decode step (patches.linear)
            self.mixer_records = {}
            # DeepSeek sparse attention: each layer's indexer keys of every token so far, the same on every rank
            # (hf_ring.sparse: the prefill's gathered, then each decode step's)
            self.indexer_keys = {}

        def _new_layers(self, state: _State, num_layers: int) -> list:
            return [DynamicLayer() if i in self.local_layers else ShardedLayer(state) for i in range(num_layers)]

        def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
            """Append ``keys`` [batch, tokens, dim] (the prefill's whole prompt, or a decode step's new tokens) to
            layer ``layer_idx``'s indexer keys and return all of them."""
            held = self.indexer_keys.get(layer_idx)
            held = keys if held is None else torch.cat([held, keys], dim=1)
            self.indexer_keys[layer_idx] = held
            return held

        def get_seq_length(self, layer_idx: int = 0) -> int:
            """The sequence's length so far, whatever ``layer_idx`` (a hybrid's first layer may hold no keys: the
            longest layer's; Transformers asks before a forward, when every layer holds as many; a cross-attention
            layer's image keys are not the sequence: asked for its own, it says how many it holds, as Transformers
            5.17's Mllama asks to learn whether it holds any)."""
            if layer_idx in self.local_layers:
                return self.layers[layer_idx].get_seq_length()
            return max(layer.get_seq_length() for layer in self.layers if isinstance(layer, ShardedLayer))

        def restart(self) -> None:
            """Empty, for a new prefill of the whole sequence (the model was called without a cache)."""
            st = self.state
            self.layers = self._new_layers(st, len(self.layers))
            self.mixer_records = {}
            self.indexer_keys = {}
            st.phase, st.offset, st.prompt, st.generated = "prefill", 0, 0, 0
            st.local = st.docs = st.q_pos = None

    return ShardedLayer, ShardedCache


@functools.cache
def _sharded_cache_class(required: type | None) -> type:
    """``ShardedCache``, or for a family whose model takes only its own cache class (MiniMax), a subclass of both
    that behaves as ``ShardedCache``: the required class's own methods that ``Cache`` has too are ``Cache``'s."""
    from transformers.cache_utils import Cache

    _, sharded = _cache_classes()
    if required is None:
        return sharded
    own = {name for k in required.__mro__ if k not in Cache.__mro__ for name in vars(k)} - {*vars(sharded), "__init__"}
    methods = {name: inspect.getattr_static(Cache, name, None) for name in own}
    restored = {k: v for k, v in methods.items() if callable(v) or isinstance(v, (property, staticmethod, classmethod))}
    return type(f"Sharded{required.__name__}", (sharded, required), {**restored, "__module__": __name__})


def ring_generate(model, inputs, **generate_kwargs):
    """``model.generate(**inputs, **generate_kwargs)`` with ring prefill and exact distributed decoding.

    Args:
        model: a model patched by ``hf_ring.apply_ring_attention`` (a Transformers causal LM or a PEFT model
            wrapping one), on every rank of its CP group.
        inputs: the full prompt as users hold it, the same on every rank: a dict (or ``BatchEncoding``) with
            ``input_ids`` [batch, prompt] and optionally ``attention_mask`` (left padding for batch > 1); for a
            vision-language model that takes images, also the processor's images and their keys (``pixel_values``,
            ``image_grid_thw``, ``image_sizes``, ``token_type_ids`` / ``mm_token_type_ids``, ...).
        generate_kwargs: passed to ``generate()`` (``max_new_tokens``, ``do_sample``, ``streamer``, ...).

    Returns:
        What ``generate()`` returns (the same on every rank): by default the sequences [batch, prompt + new].
    """
    target = unwrap_transformers_model(model)
    cfg = getattr(next((m for m in target.modules() if hasattr(m, CONFIG_ATTR)), None), CONFIG_ATTR, None)
    if cfg is None:
        raise ValueError("ring_generate needs a model patched by hf_ring.apply_ring_attention(model)")
    if cfg.ulysses is not None and cfg.ulysses.ulysses_size > 1:
        raise ValueError("ring_generate does not support the Ulysses x Ring hybrid; apply_ring_attention without it")
    from .patches import get_patch

    patch = get_patch(getattr(target.config, "model_type", None))
    if patch.no_generate:
        raise ValueError(
            f"ring_generate does not support {patch.name} models: {patch.no_generate}; generate with "
            "hf_ring.revert_ring_attention(model) and model.generate()"
        )
    images = patch.images  # the family takes images under the ring: a prompt's images too
    if patch.media:  # a vision-language model: media must come in inputs, and only where the prefill takes them
        from .patches._family import TextOnly

        given = [k for k in (*patch.media, *TOKEN_TYPE_KEYS) if carries(generate_kwargs.get(k))]
        if images and given:
            raise ValueError(
                f"ring_generate takes the prompt's images, video or audio and their keys in inputs (beside input_ids, "
                f"as the processor returns them), not as generate() keywords: got {given}"
            )
        TextOnly(patch.name, patch.media)(target, (), generate_kwargs)
    for name, (refused, what) in _REFUSED.items():
        if refused(_effective(target, generate_kwargs, name)):
            raise ValueError(f"ring_generate does not support {what}; use greedy or sampled decoding")
    inputs = dict(inputs)
    if patch.cross_modules(target) and multimodal(inputs) and inputs.get("cross_attention_mask") is None:
        raise ValueError(
            f"ring_generate: the prompt carries images without a cross_attention_mask; {patch.name}'s images enter "
            "by cross-attention: pass the prompt as its processor makes it, cross_attention_mask included"
        )
    unknown = sorted(set(inputs) - {"input_ids", "attention_mask"})
    if unknown and images:  # the prompt's images and their keys (the prefill takes them as a training batch's)
        ids = inputs.get("input_ids")
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
        # per-token keys other than the token types: nothing would pad them
        unknown = sorted(k for k in unknown if per_token_key(k, inputs[k], shape))
    if unknown:
        what = "input_ids and attention_mask" if not images else "input_ids, attention_mask, token types, media"
        raise ValueError(f"ring_generate takes {what} in inputs, not {unknown}")
    rank, world = group_rank_and_size(cfg.group)
    state = _State(group=cfg.group, rank=rank, world=world, layout=cfg.layout, kv_source=_kv_sources(target))
    from .patches.linear import conv_kernel_size

    state.halo = max((conv_kernel_size(m) - 1 for m in patch.linear_modules(target)), default=0)
    state.settings = _settings(target, generate_kwargs)
    if world > 1:  # each step's chosen tokens compared on every rank (the last one too: no forward follows it)
        from transformers import StoppingCriteriaList

        given = generate_kwargs.get("stopping_criteria") or []
        generate_kwargs = {**generate_kwargs, "stopping_criteria": StoppingCriteriaList([*given, _same_tokens(state)])}
    # cross-attention layers (Inkling 2's attention residuals, local too, keep no cache: no layer index)
    local = frozenset(m.layer_idx for m in patch.local_modules(target) if getattr(m, "layer_idx", None) is not None)
    cache = _sharded_cache_class(patch.cache_type())(state, target.config.get_text_config().num_hidden_layers, local)
    name = _cache_name(target)
    hooks = [
        target.register_forward_pre_hook(_Before(state, cache, name), with_kwargs=True, prepend=True),
        target.register_forward_hook(_After(state), with_kwargs=True),
    ]
    try:
        return model.generate(**inputs, **generate_kwargs, **{name: cache})
    finally:
        for h in hooks + state.hooks:
            h.remove()


def _effective(target, generate_kwargs: dict, name: str):
    """The value of setting ``name`` that ``generate()`` will use: its keyword, else the generation config given,
    else the model's (``generate()`` fills the given config's unset fields from the model's), ``"hybrid"`` caches
    as none (``generate()`` drops that legacy default of sliding-window checkpoints itself)."""
    if name in generate_kwargs:
        value = generate_kwargs[name]
    else:
        value = getattr(generate_kwargs.get("generation_config"), name, None)
        if value is None:
            value = getattr(getattr(target, "generation_config", None), name, None)
    return None if name == "cache_implementation" and value == "hybrid" else value


def _settings(target, generate_kwargs: dict) -> int:
    """A digest of the settings that decide what ``generate()`` samples and when it stops (its plain keywords, the
    generation configs), compared across ranks at the prefill: ranks that stop at different steps would wait on
    each other."""
    import hashlib

    plain = (bool, int, float, str, type(None))
    keywords = {k: v for k, v in generate_kwargs.items() if isinstance(v, plain) or
                (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))}  # fmt: skip
    configs = [generate_kwargs.get("generation_config"), getattr(target, "generation_config", None)]
    text = repr(sorted(keywords.items())) + "".join(c.to_json_string() for c in configs if c is not None)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _same_tokens(state: _State):
    """A stopping criterion that never stops: after each step's tokens are chosen, every rank's sequences are
    compared (one small all-gather); ranks that chose differently (sampling with other seeds) raise on every rank,
    before any of them stops alone or goes on alone. It is the decode steps' only check: each step's forward takes
    the tokens compared here."""
    from transformers import StoppingCriteria

    class SameTokens(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            summary = [0, input_ids.shape[0], input_ids.shape[1], fingerprint(input_ids)]
            check_everywhere(None, summary, RingComm(state.group), input_ids.device, fields=_TOKEN_FIELDS,
                             op="ring_generate (new tokens)")  # fmt: skip
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return SameTokens()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor as integers for ``fingerprint`` (a floating one's fp32 bits)."""
    return t.detach().float().contiguous().view(torch.int32) if t.dtype.is_floating_point else t


def _media_tensors(kwargs: dict) -> list:
    """The tensors of a forward's images, video or audio, or of the features ``generate()`` computed from them."""
    found = [kwargs[k] for k in MEDIA_KEYS if isinstance(kwargs.get(k), torch.Tensor)]
    for output in (kwargs.get(ENCODED_KEY) or {}).values():
        pooled = getattr(output, "pooler_output", None)
        found += [pooled] if isinstance(pooled, torch.Tensor) else [t for t in pooled or () if torch.is_tensor(t)]
    return found


def _kv_sources(model) -> dict[int, int]:
    """Layers that attend with the keys/values of an earlier layer and keep no cache of their own -> that layer's
    index, whose cache layer gives the decode step the keys' positions and documents: Gemma 4's KV-shared layers (the
    last layer of their type that stores its keys/values), Mistral Large 4's (``config.kv_source_layers`` names each
    layer's source; the keys themselves come from the model, its ``shared_kv_states``)."""
    producers, shared = {}, []
    for m in model.modules():
        if getattr(m, "store_full_length_kv", False) and hasattr(m, "layer_type"):
            producers[m.layer_type] = m.layer_idx
        if getattr(m, "is_kv_shared_layer", False):
            shared.append(m)
    sources, missing = {}, []
    for m in shared:
        named = getattr(getattr(m, "config", None), "kv_source_layers", None)
        if named is not None:
            sources[m.layer_idx] = named[m.layer_idx]
        elif getattr(m, "layer_type", None) in producers:
            sources[m.layer_idx] = producers[m.layer_type]
        else:
            missing.append(m.layer_idx)
    if missing:
        raise ValueError(f"ring_generate: layers {missing} reuse keys/values that no layer of their type stores")
    return sources


_CACHE_NAMES = ("cache", "cache_params", "past_key_values")


def _cache_name(target) -> str:
    """The keyword the model's forward takes its cache by: ``cache`` (Transformers 5.24; ``past_key_values`` warns
    there), ``cache_params`` (5.17's Mamba models) or ``past_key_values``."""
    params = inspect.signature(type(target).forward).parameters
    return next((name for name in _CACHE_NAMES if name in params), "past_key_values")


class _Before:
    """Forward pre-hook during ``ring_generate``: checks the call across ranks; shards the prompt (prefill) or
    records the positions of the new tokens (decode)."""

    def __init__(self, state: _State, cache, name: str):
        self.state, self.cache, self.name = state, cache, name

    def __call__(self, module, args, kwargs):
        st = self.state
        ids = kwargs.get("input_ids", args[0] if args else None)
        present = [k for k in _CACHE_NAMES if k in kwargs]  # (generate() passes it by the model's name)
        key = next((k for k in present if kwargs[k] is not None), present[0] if present else self.name)
        given = kwargs.get(key)
        if given is None:  # the family's generate drops the cache to compute it anew (Phi-3's longrope switch)
            self._check_whole(ids, kwargs.get("attention_mask"))
            self.cache.restart()
            kwargs = {**kwargs, key: self.cache}
        elif given is not self.cache:
            raise ValueError("ring_generate: the model was called with another cache than its sharded one")
        if not isinstance(ids, torch.Tensor):
            raise ValueError("ring_generate: the model must be called with input_ids")
        if st.phase == "prefill":
            mask = kwargs.get("attention_mask")
            media = [_bits(t) for t in _media_tensors(kwargs)]  # ranks given other images would mix their features
            summary = [0, ids.shape[0], ids.shape[1], fingerprint(ids, mask, *media), st.settings]
            check_everywhere(
                None, summary, RingComm(st.group), ids.device, fields=_PREFILL_FIELDS, op="ring_generate (prompt)"
            )
            return (), self._prefill(module, kwargs, ids, mask, key)
        # a decode step: its tokens were compared on every rank when they were chosen (_same_tokens, the collective
        # of the step before), so nothing is gathered here
        start = self.cache.get_seq_length()  # every rank's tokens so far, in generate()'s coordinates
        st.q_pos = torch.arange(start, start + ids.shape[1]) + st.offset
        return args, {**kwargs, DECODE_KWARG: self.cache}

    @staticmethod
    def _check_whole(ids, mask) -> None:
        """A call without a cache must bring the whole sequence: ValueError (on every rank alike) otherwise."""
        if isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.shape[-1] != mask.shape[-1]:
            raise ValueError(
                f"ring_generate: generate() dropped the model's cache but passed {ids.shape[-1]} of the sequence's "
                f"{mask.shape[-1]} tokens, so nothing could compute their keys anew (Phi-3's longrope switch on "
                "Transformers before 5.23); upgrade Transformers, or keep prompt and new tokens on one side of "
                "original_max_position_embeddings"
            )

    def _prefill(self, module, kwargs: dict, ids: torch.Tensor, mask, cache_key: str) -> dict:
        st = self.state
        b, s = ids.shape
        multiple = required_multiple(st.layout, st.world)
        pad = -s % multiple
        if st.world > 1 and st.halo:  # hybrids: every chunk holds at least the convolutions' inputs before a token
            runs = 1 if st.layout == "contiguous" else 2
            short = st.world * runs * st.halo - (s + pad)
            pad += max(0, -(-short // multiple) * multiple)
        mask = torch.ones_like(ids) if mask is None else mask
        pos = kwargs.get("position_ids")
        media = multimodal(kwargs)
        cross = media and kwargs.get("cross_attention_mask") is not None  # images by cross-attention: text sharded
        if pos is None:  # as the model numbers a prompt given none (from its cache position: padding counted)
            pos = torch.arange(s, device=ids.device).expand(b, -1)
        elif pos.dim() == 3 and not media:  # multimodal RoPE ([3 or 4, batch, prompt]): one row for text prompts
            pos = pos[0]
        full = {
            "input_ids": torch.nn.functional.pad(ids, (pad, 0), value=0),
            "attention_mask": torch.nn.functional.pad(mask, (pad, 0), value=0),
            "position_ids": torch.nn.functional.pad(pos.expand(*pos.shape[:-2], b, -1), (pad, 0), value=0),
        }
        if media:  # images (or their features): the model takes the whole prompt
            positions_ = full.pop("position_ids")  # multimodal RoPE's too: the text model cuts them
            for key, value in kwargs.items():
                if key in (*TOKEN_TYPE_KEYS, *CROSS_KEYS) and isinstance(value, torch.Tensor):  # padding sees no image
                    full[key] = pad_tokens(value, pad, left=True)
                elif key not in full and key not in _PREFILL_OWN and value is not None:
                    full[key] = value  # the images and their per-image keys
            local = shard_batch(full, group=st.group, layout=st.layout, pad_to_multiple=False)
            # whole: the text model cuts them with the embeddings; with cross-attention, the text is sharded already
            cut = functools.partial(shard, dim=-1, rank=st.rank, world_size=st.world, layout=st.layout)
            local["position_ids"] = cut(positions_) if cross else positions_
        else:
            local = shard_batch(full, group=st.group, layout=st.layout, pad_to_multiple=False)
        st.offset, st.prompt = pad, s + pad
        st.local = positions(s + pad, rank=st.rank, world_size=st.world, layout=st.layout)
        # one document per row for the decode steps (the new tokens see every prompt token that is not padding)
        st.docs = torch.where(full["attention_mask"].cpu().bool(), 0, -1).to(torch.int32)
        # the logits of this rank's last token (the owner's is the prompt's last), as an index: an integer would
        # let Gemma 4 run its KV-shared layers on that token alone, and those layers see every rank's tokens here
        last = torch.tensor([st.local.numel() - 1])  # on the CPU: any device's hidden states take it
        # images merged on the whole prompt: the model's input_ids are whole, its hidden states a shard, and the text
        # model keeps the last row
        if media and not cross:
            from .patches._family import ShardEmbeddings

            last = 0  # (Gemma 4 slices by index only when the two lengths agree: all the shard's logits otherwise)
            text = next((m for m in module.modules() if any(isinstance(h, ShardEmbeddings) for h in
                                                            m._forward_pre_hooks.values())), None)  # fmt: skip
            if text is None:
                raise ValueError(f"ring_generate: {type(module).__name__} cuts no embeddings of a prompt with images")
            st.hooks.append(text.register_forward_hook(_KeepLast(st)))
        local.update({"use_cache": True, cache_key: kwargs[cache_key], "logits_to_keep": last})
        local["cache_position"] = st.local.to(ids.device)
        local[DECODE_KWARG] = self.cache
        for key in ("return_dict", "output_attentions", "output_hidden_states"):
            if key in kwargs:
                local[key] = kwargs[key]
        return local


class _KeepLast:
    """One-shot forward hook of the text model in a prefill with images: only the shard's last row of its hidden
    states goes on to the head (the rank owning the prompt's last token broadcasts its logits)."""

    def __init__(self, state: _State):
        self.state = state

    def __call__(self, module, args, output):
        while self.state.hooks:
            self.state.hooks.pop().remove()
        output.last_hidden_state = output.last_hidden_state[:, -1:]
        return output


class _After:
    """Forward hook during ``ring_generate``: after the prefill, every rank gets the last position's logits from
    the rank that holds it; after a decode step, the new tokens are counted."""

    def __init__(self, state: _State):
        self.state = state

    def __call__(self, module, args, kwargs, output):
        st = self.state
        if st.phase == "decode":
            st.generated += st.q_pos.numel()
            return output
        st.phase = "decode"
        if st.world > 1:
            last = st.prompt - 1
            owner = next(r for r in range(st.world) if last in positions(st.prompt, rank=r, world_size=st.world,
                                                                         layout=st.layout))  # fmt: skip
            logits = output.logits.contiguous()
            dist.broadcast(logits, src=global_rank(st.group, owner), group=st.group)
            output.logits = logits
        return output
