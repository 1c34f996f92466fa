"""Attention modules that compute attention themselves, made to call hf_ring's attention function.

Falcon, GPT-Neo, BLOOM and MPT do not dispatch through Transformers' ``AttentionInterface``: their attention modules multiply
queries by keys in their own ``forward``. While such a model is patched, ``OwnAttention`` replaces the ``forward`` of
each of its attention modules (an instance attribute; ``revert`` removes it) by the family's function below: the
module's own projections, head split, rotary embedding and cache update, then one call of
``hf_attention.ring_attention_forward`` with the family's scale and window, then its output projection. Everything
but the attention itself is the module's own weights and Transformers' own helpers.

Their decoder layers are called without the batch's keywords (document ids, shard, ring_generate's cache): the
model hands them over through its causal mask (``patches._lend.HandOver``), and each function here unpacks them.

- Falcon (``falcon``: Falcon 7B / 40B / 180B, Falcon 2; rotary positions): its three query / key / value layouts
  (``new_decoder_architecture``: grouped keys and values; ``multi_query``: one key / value head; neither: one per
  query head). Keys and values keep their own heads (Transformers broadcasts them to every query head first; the
  ring sends only the key / value heads). Its rotary path applies no attention dropout before Transformers 5.25,
  and neither does this one; 5.25's applies ``attention_dropout`` in training, which is refused there (as for every
  family).
  ALiBi (a model built with ``config.alibi``, the Falcon-RW models) is refused by ``check``. From Transformers 5.25
  its module calls the attention interface itself, but not for a registered function, and its layers still pass no
  keywords: the same forward takes the calls of either release (5.25's pass no ``alibi``), with the module's
  ``scaling`` where it has one.
- GPT-Neo (``gpt_neo``): unscaled scores (scale 1), its local layers a window of ``config.window_size`` keys
  (``q - W < k <= q``, Transformers' sliding-window rule), attention dropout as configured (refused in training
  when not 0, as for every family).
- BLOOM (``bloom``) and MPT (``mpt``): ALiBi, as the ring's ``alibi_slopes`` (``-slope * (q_pos - k_pos)``, the same
  softmax as their ``slope * k_pos`` and ``slope * (k_pos - L + 1)``), the slopes Transformers' own. BLOOM's output
  projection in ``pretraining_tp`` slices when its config asks; MPT's ``clip_qkv`` and ``softmax_scale``.
"""

from __future__ import annotations

import functools

import torch

from ..batch_checks import without_all_true
from ..hf_attention import ring_attention_forward
from ..ring_config import CONFIG_ATTR, Lent
from ._hooks import remove_forward

__all__ = ["FORWARDS", "OwnAttention", "check", "install", "remove"]


def _unpacked(m, attention_mask, kwargs: dict, output_attentions: bool = False) -> tuple:
    """The mask and the keywords of the call, with those the model handed over through the mask (and
    ``output_attentions``, asked for by the call or by the model's, which the attention function refuses). A mask
    without padding is dropped (Transformers 5.17's BLOOM makes an all-ones one when given none, which the attention
    function would refuse beside shard_batch's document ids): one host read per forward."""
    if isinstance(attention_mask, Lent):
        attention_mask, kwargs = attention_mask.mask, {**attention_mask.kwargs, **kwargs}
    if output_attentions or kwargs.pop("output_attentions", None):  # (else the model's config says, as elsewhere)
        kwargs["output_attentions"] = True
    plans = getattr(getattr(m, CONFIG_ATTR, None), "plans", None)
    return without_all_true(attention_mask, plans), kwargs


def _falcon_heads(m, fused: torch.Tensor) -> tuple:
    """Falcon's fused projection split into q [b, s, heads, d] and k, v [b, s, kv_heads, d] (not broadcast)."""
    b, s, _ = fused.shape
    d = m.head_dim
    if m.new_decoder_architecture:
        kv = m.num_kv_heads
        qkv = fused.view(b, s, kv, m.num_heads // kv + 2, d)  # per key / value head: its queries, its key, its value
        return qkv[:, :, :, :-2].reshape(b, s, m.num_heads, d), qkv[:, :, :, -2], qkv[:, :, :, -1]
    if m.multi_query:
        qkv = fused.view(b, s, m.num_heads + 2, d)
        return qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    qkv = fused.view(b, s, m.num_heads, 3, d)
    return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]


def _falcon(
    m,
    hidden_states: torch.Tensor,
    alibi=None,  # (Transformers 5.25's layers pass none: its model adds ALiBi to the mask)
    attention_mask=None,
    position_ids=None,
    layer_past=None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings=None,
    **kwargs,
):
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    if alibi is not None:  # (refused at apply: a model built with alibi=True after it)
        raise ValueError("hf_ring does not support Falcon with ALiBi (config.alibi=True)")
    mask, kwargs = _unpacked(m, attention_mask, kwargs, output_attentions)
    b, s, _ = hidden_states.shape
    q, k, v = (t.transpose(1, 2) for t in _falcon_heads(m, m.query_key_value(hidden_states)))
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if layer_past is not None:
        k, v = layer_past.update(k, v, m.layer_idx)
    # 5.25's module applies its attention dropout in training (a float there; refused by the attention function);
    # 5.17's rotary path none (an nn.Dropout there)
    p = m.attention_dropout
    dropout = p if isinstance(p, (int, float)) and m.training else 0.0
    out, _ = ring_attention_forward(
        m, q, k, v, mask, scaling=getattr(m, "scaling", m.inv_norm_factor), dropout=dropout, position_ids=position_ids,
        use_cache=use_cache, **kwargs,
    )  # fmt: skip
    return m.dense(out.reshape(b, s, -1)), None


def _gpt_neo(m, hidden_states: torch.Tensor, attention_mask=None, layer_past=None, use_cache: bool = False,
             output_attentions: bool = False, **kwargs):  # fmt: skip
    mask, kwargs = _unpacked(m, attention_mask, kwargs, output_attentions)
    b, s, _ = hidden_states.shape
    q, k, v = (m._split_heads(p(hidden_states), m.num_heads, m.head_dim) for p in (m.q_proj, m.k_proj, m.v_proj))
    if layer_past is not None:
        k, v = layer_past.update(k, v, m.layer_id)
    window = m.config.window_size if m.attention_type == "local" else None
    out, _ = ring_attention_forward(
        m, q, k, v, mask, scaling=1.0, dropout=m.attn_dropout.p if m.training else 0.0, sliding_window=window,
        use_cache=use_cache, **kwargs,
    )  # fmt: skip
    return m.resid_dropout(m.out_proj(out.reshape(b, s, -1))), None


def _bloom_slopes(m, device) -> torch.Tensor:
    """BLOOM's ALiBi slopes, [heads] fp32, from Transformers' own bias of two positions (``slope * k_pos``)."""
    return _slopes_of("bloom", m.num_heads, device)


def _slopes_of(family: str, heads: int, device) -> torch.Tensor:
    """The family's ALiBi slopes for ``heads`` heads on ``device``: computed once (``_computed``), but anew while a
    compiler traces (its tensors may be fake: never kept)."""
    if torch.compiler.is_compiling():
        return _computed.__wrapped__(family, heads, device)
    return _computed(family, heads, device)


@functools.cache
def _computed(family: str, heads: int, device) -> torch.Tensor:
    """The slopes, a fixed tensor read only: an ordinary one, even when first asked for under
    ``torch.inference_mode``, so that the ring may save it for the backward."""
    with torch.inference_mode(False), torch.no_grad():
        if family == "bloom":
            from transformers.models.bloom.modeling_bloom import build_alibi_tensor

            return build_alibi_tensor(torch.ones(1, 2, device=device), heads, torch.float32)[:, 0, 1].contiguous()
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        return -build_mpt_alibi_tensor(heads, 2, device=device)[:, 0, 0].float()  # (its model's default bias max)


def _bloom(m, hidden_states: torch.Tensor, residual: torch.Tensor, alibi, attention_mask, layer_past=None,
           use_cache: bool = False, output_attentions: bool = False, **kwargs):  # fmt: skip
    from transformers.models.bloom.modeling_bloom import dropout_add

    mask, kwargs = _unpacked(m, attention_mask, kwargs, output_attentions)
    b, s, _ = hidden_states.shape
    q, k, v = m._reshape(m.query_key_value(hidden_states))
    if layer_past is not None:
        k, v = layer_past.update(k, v, m.layer_idx)
    out, _ = ring_attention_forward(
        m, q, k, v, mask, scaling=m.inv_norm_factor, dropout=m.attention_dropout.p if m.training else 0.0,
        alibi_slopes=_bloom_slopes(m, q.device), use_cache=use_cache, **kwargs,
    )  # fmt: skip
    context = out.reshape(b, s, -1)
    if m.pretraining_tp > 1 and m.slow_but_exact:  # (its output projection in slices, as the module does)
        width = m.hidden_size / m.pretraining_tp
        projected = torch.zeros_like(context)
        for i in range(m.pretraining_tp):
            cols = slice(int(i * width), int((i + 1) * width))
            projected = projected + torch.nn.functional.linear(context[:, :, cols], m.dense.weight[:, cols])
        projected = projected + m.dense.bias
    else:
        projected = m.dense(context)
    return dropout_add(projected, residual, m.hidden_dropout, m.training), None


def _mpt_slopes(m, device) -> torch.Tensor:
    """MPT's ALiBi slopes, [heads] fp32, from Transformers' own bias of two positions (``slope * (k - 1)``), with the
    bias maximum its model passes (the default: Transformers' MPT does not read ``attn_config.alibi_bias_max``)."""
    return _slopes_of("mpt", m.n_heads, device)


def _mpt(m, hidden_states: torch.Tensor, position_bias, cache=None, attention_mask=None, **kwargs):
    mask, kwargs = _unpacked(m, attention_mask, kwargs)
    if cache is None:  # (Transformers 5.17 names it past_key_values)
        cache = kwargs.pop("past_key_values", None)
    b, s, _ = hidden_states.shape
    qkv = m.Wqkv(hidden_states)
    if m.clip_qkv:
        qkv = qkv.clamp(min=-m.clip_qkv, max=m.clip_qkv)
    q, k, v = (t.reshape(b, s, m.n_heads, m.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(k, v, m.layer_idx)
    out, _ = ring_attention_forward(
        m, q, k, v, mask, scaling=m.softmax_scale, dropout=m.attn_dropout_p if m.training else 0.0,
        alibi_slopes=_mpt_slopes(m, q.device), **kwargs,
    )  # fmt: skip
    return m.out_proj(out.reshape(b, s, -1)), None


FORWARDS = {"falcon": _falcon, "gpt_neo": _gpt_neo, "bloom": _bloom, "mpt": _mpt}
"""Model type -> the attention forward of its modules under hf_ring."""


class OwnAttention:
    """``forward`` of an attention module of a family in ``FORWARDS`` while its model is patched."""

    def __init__(self, module: torch.nn.Module, family: str):
        self.module, self.family = module, family

    def __call__(self, *args, **kwargs):
        return FORWARDS[self.family](self.module, *args, **kwargs)


def check(model: torch.nn.Module, modules: list, family: str) -> None:
    """ValueError for what the family's forward here does not implement, before anything is patched: a Falcon model
    built with ALiBi (its model's ``use_alibi``, fixed when built); a module whose ``forward`` something else replaced
    (Accelerate's offloading hooks: they would be dropped)."""
    if family == "falcon" and any(getattr(m, "use_alibi", False) for m in model.modules()):
        raise ValueError(
            "falcon: this model was built with ALiBi (config.alibi=True, the Falcon-RW models), which hf_ring does not "
            "support for Falcon; Falcon models with rotary positions (alibi=False: Falcon 7B, 40B, 180B, Falcon 2) are "
            "supported"
        )
    other = [m for m in modules if "forward" in m.__dict__ and not isinstance(m.__dict__["forward"], OwnAttention)]
    if other:
        raise ValueError(
            f"{type(other[0]).__name__}: its forward was replaced by something else (Accelerate's offloading hooks, "
            "from device_map or cpu_offload?), which hf_ring's would drop; load the model on one device"
        )


def install(modules: list, family: str) -> None:
    for m in modules:
        m.forward = OwnAttention(m, family)


def remove(model: torch.nn.Module) -> None:
    for m in model.modules():
        remove_forward(m, OwnAttention)
