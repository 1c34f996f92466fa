"""The attention function refuses keywords it does not implement, instead of dropping them (one process).

A model loaded with ``attn_implementation="hf_ring"`` (after ``hf_ring.register_attention()``) skips the
family check of ``apply_ring_attention``; its attention calls still must not lose an attention feature
silently: unknown ones raise, and Gemma2's logit softcapping (``softcap``) and gpt-oss's learned sinks
(``s_aux``) are honoured.
"""

from __future__ import annotations

import types

import pytest
import torch

import hf_ring
from hf_ring.hf_attention import ring_attention_forward

from .reference import reference_attention, rel_err


def _call(**kwargs):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 16), torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    module = types.SimpleNamespace(is_causal=True, config=None)
    out, _ = ring_attention_forward(module, q, k, v, None, scaling=0.25, **kwargs)
    return out, (q, k, v)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"sinks": torch.zeros(4)}, "sinks"),
        ({"position_bias": torch.zeros(1, 4, 12, 12)}, "position_bias"),
        ({"attention_chunk_size": 8}, "attention_chunk_size"),
    ],
)
def test_unimplemented_attention_keywords_raise(kwargs, name):
    with pytest.raises(ValueError, match=rf"does not implement \['{name}'\]"):
        _call(**kwargs)


def test_harmless_and_unset_keywords_pass():
    out, (q, k, v) = _call(
        softcap=None, s_aux=None, use_cache=False, cache_position=torch.arange(12), position_ids=torch.arange(12)[None],
        output_hidden_states=False, max_length_q=12, max_length_k=12,
        logits_to_keep=0,  # (GOT-OCR 2.0's and LLaVA-OneVision's heads pass it on to every layer)
    )  # fmt: skip
    ref = reference_attention(q.double(), k.double(), v.double(), scale=0.25).transpose(1, 2)
    assert rel_err(out, ref) <= 1e-5


def test_softcap_and_sinks_keywords_are_honoured():
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2))
    for kwargs in ({"softcap": 3.0}, {"s_aux": sinks}, {"softcap": 3.0, "s_aux": sinks}):
        out, (q, k, v) = _call(**kwargs)
        ref = reference_attention(
            q.double(), k.double(), v.double(), scale=0.25, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux")
        )
        assert rel_err(out, ref.transpose(1, 2)) <= 1e-5, kwargs


def test_registered_gemma2_with_softcapping_matches_eager():
    """register_attention + attn_implementation="hf_ring" on a softcapping model: the eager model's logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    hf_ring.register_attention()
    cfg = Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_logit_softcapping=5.0, sliding_window=8,
        max_position_embeddings=64, attention_dropout=0.0,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.set_attn_implementation("hf_ring")
        got = model(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-5
