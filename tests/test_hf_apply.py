"""apply / revert, the patch registry, Transformers' conventions at world size 1, shard_batch, and every error path.

In-process, no process group (hf_ring then runs as one rank); the distributed parity tests are in
``test_hf_parity.py``.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from hf_ring.patches import REGISTRY, _lend, get_patch
from hf_ring.patches._lend import HandOver, LendKeywords, UnpackLent
from hf_ring.patches._own import OwnAttention
from hf_ring.patches.linear import ShardedCCA, ShardedMixer, ShardedPLE, ShardedResidualConv

import hf_ring
from hf_ring import hf_attention
from hf_ring.batch import MEDIA_KEYS
from tests.hf_models import (
    AUDIO_CLIPS,
    DYNAMIC,
    DYNAMIC_FULL_LAYERS,
    LONGROPE,
    VOCAB,
    in_transformers,
    make_batch,
    make_model,
    one_document,
    text_only,
    transformers_at_least,
    with_token_types,
)

FAMILIES = sorted({p.name for p in REGISTRY.values()})
MODEL_TYPES = sorted(REGISTRY)  # the families, and the model types that load a family's classes (generic.ALIASES)
# world size 1: ring attention vs SDPA on the same fp32 inputs; a different summation order only
ATOL = 2e-5


def _logits(model, **kw):
    with torch.no_grad():
        return model(**kw).logits


def _ids(seed=3, shape=(2, 21)):
    return torch.randint(1, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- registry invariants


DEDICATED = ["llama", "mistral", "qwen2", "qwen3"]


def test_registry_keyed_by_model_type_dedicated_modules_and_one_generic_patch():
    import importlib

    from hf_ring.patches import generic, multimodal

    assert FAMILIES == sorted(DEDICATED + list(generic.FAMILIES) + list(multimodal.WRAPPERS))
    for model_type, patch in REGISTRY.items():
        assert model_type in patch.model_types
        if patch.attention_class is None:  # a model without attention (Mamba2): its mixers only
            assert patch.linear_class is not None
        elif in_transformers(model_type):  # (families new in a later Transformers: their classes are not there)
            classes = patch.attention_type()  # (Inkling 2: its sliding and full attention classes)
            for cls in classes if isinstance(classes, tuple) else (classes,):
                assert cls.__name__.endswith(("Attention", "MLA"))  # LongCat's: LongcatFlashMLA
        if patch.name in generic.FAMILIES:  # one line each in the generic table, one shared check
            assert generic.PATCHES[model_type] is patch and patch.model_types[0] == patch.name
            assert set(patch.model_types[1:]) == {a for a, f in generic.ALIASES.items() if f == patch.name}
            assert patch.check_config is generic.CHECKS.get(model_type, generic.check)
            assert not patch.media
            continue
        if patch.name in multimodal.WRAPPERS:  # a vision-language model: its text config's family does the work
            assert multimodal.PATCHES[model_type] is patch and patch.media == multimodal.MEDIA
            assert patch.text_types == multimodal.WRAPPERS[model_type]
            # the text family's own patch; or, for a text model with no causal-LM class of its own, an inner one (and
            # for Phi-4-multimodal, whose top model is its text model: the wrapper's type, an inner patch)
            inner = {t: multimodal.INNER[t] for t in patch.text_types if t == model_type}
            assert all(multimodal.text_patch(t) is inner.get(t, REGISTRY.get(t, multimodal.INNER.get(t)))
                       for t in patch.text_types)  # fmt: skip
            # what a wrapper inherits, its text families agree on (and it has it); none lends its mixers keywords
            for field in multimodal.INHERITED:
                assert {getattr(multimodal.text_patch(t), field) for t in patch.text_types} == {getattr(patch, field)}
            assert not any(multimodal.text_patch(t).lend_mixer_kwargs for t in patch.text_types)
            continue
        mod = importlib.import_module(f"hf_ring.patches.{patch.name}")  # a dedicated module, Liger-style entry points
        assert mod.PATCH is patch
        assert callable(getattr(mod, f"apply_ring_attention_to_{patch.name}"))
        assert callable(getattr(mod, f"revert_ring_attention_from_{patch.name}"))
    patches = {id(p): p for p in REGISTRY.values() if not p.media}.values()  # (an alias: its family's patch)
    classes = [p.attention_class or p.linear_class for p in patches]
    assert len(set(classes)) == len(classes)  # no attention (or, without attention, mixer) class claimed twice


def test_generic_patch_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match=r"cohere2: layer types \['chunked_attention'\] are not supported"):
        hf_ring.apply_ring_attention(make_model("cohere2", layer_types=["chunked_attention", "full_attention"]))
    # MiniMax M3's sparse layers: an indexer head per key/value head (each takes its own head's blocks)
    if in_transformers("minimax_m3_vl_text"):
        for family in ("minimax_m3_vl_text", "minimax_m3_vl"):  # (the wrapper: its text config's check)
            with pytest.raises(ValueError, match="index_n_heads=1 indexer heads for 2 key/value heads"):
                hf_ring.apply_ring_attention(make_model(family, index_n_heads=1))
    # OPT: LayerDrop (each rank would draw the layers it skips); before 5.24, its decoder's all-ones mask; switched by
    # attn_implementation alone (measured: a left-padded batch's loss 3.2e-4 apart without the renumbering)
    if in_transformers("opt"):
        with pytest.raises(ValueError, match="config.layerdrop=0.1 skips layers at random"):
            hf_ring.apply_ring_attention(make_model("opt", layerdrop=0.1))
        from hf_ring.patches import generic

        assert generic.MASK_POSITIONS.keys() == set(hf_attention.NUMBERS_FROM_MASK)
        by_name = make_model("opt")
        by_name.set_attn_implementation("hf_ring")
        with pytest.raises(ValueError, match="numbers its positions from the attention mask"):
            by_name(**hf_ring.shard_batch(make_batch("padded", 40)[0]))
    else:
        with pytest.raises(ValueError, match="hf_ring supports OPT from Transformers 5.24"):
            hf_ring.apply_ring_attention(make_model("opt"))
    # BioGPT: LayerDrop as OPT's; the all-ones mask its model makes when given none is dropped (else refused as a
    # mask next to shard_batch's output); a caller's mask there still refused, with padding or without (one without
    # would pass for the model's own: its model refuses it first)
    from hf_ring.patches import generic

    assert generic.MAKES_A_MASK.keys() == set(hf_attention.MAKES_A_MASK)
    with pytest.raises(ValueError, match="config.layerdrop=0.1 skips layers at random"):
        hf_ring.apply_ring_attention(make_model("biogpt", layerdrop=0.1))
    bio, (batch, _) = hf_ring.apply_ring_attention(make_model("biogpt")), make_batch("padded", 40)
    local = hf_ring.shard_batch(batch)
    assert bio(**local).logits.shape[:2] == batch["input_ids"].shape
    for mask in (batch["attention_mask"], torch.ones_like(batch["attention_mask"])):
        with pytest.raises(ValueError, match="attention_mask cannot be passed to a ring-attention model"):
            bio(**local, attention_mask=mask)
    hf_ring.revert_ring_attention(bio)
    assert bio(**make_batch("padded", 40)[1]).logits.shape[:2] == batch["input_ids"].shape  # (the hook gone)
    # Gemma 4 as an encoder (measured: its two-sided sliding mask is not the ring's, loss apart by 9e-3)
    for family in ("gemma4_text", "gemma4"):
        with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
            hf_ring.apply_ring_attention(make_model(family, use_bidirectional_attention="all"))


@pytest.mark.skipif(not in_transformers("minimax_m3_vl_text"), reason="MiniMax M3 is not in this Transformers")
def test_minimax_m3_refuses_packed_rows_and_padded_prompts():
    """Its indexer counts blocks of keys from the row's first token and lets a query see the keys up to its position
    id: a packed row's later documents would pick among the earlier ones' blocks, and a padded prompt's blocks are
    not those of the row alone (``ring_generate``'s reference). Both refused by name; the dense layers alone take
    packed rows."""
    model = hf_ring.apply_ring_attention(make_model("minimax_m3_vl_text").eval())
    packed, _ = make_batch("packed", 40)
    with torch.no_grad(), pytest.raises(ValueError, match="packed documents would select among each other's blocks"):
        model(**hf_ring.shard_batch(packed))
    padded, _ = make_batch("padded", 40)
    prompt = {k: padded[k] for k in ("input_ids", "attention_mask")}
    with pytest.raises(ValueError, match="a padded prompt row selects other blocks than the row alone"):
        hf_ring.ring_generate(model, prompt, max_new_tokens=2)
    dense = make_model("minimax_m3_vl_text", layer_types=["full_attention"] * 2)
    with torch.no_grad():
        assert torch.isfinite(hf_ring.apply_ring_attention(dense)(**hf_ring.shard_batch(packed)).loss)


@pytest.mark.skipif(not in_transformers("glm5_next"), reason="GLM-5.3-Flash is not in this Transformers")
def test_glm5_next_refuses_packed_rows_and_striped_shards():
    """Its indexer cuts the row into pools from its first real token and lets a query see every earlier pool (no
    documents): a packed row's documents would pick among each other's pools; hf_ring runs its code on runs of
    consecutive queries, which a striped shard over several ranks is not. Each refused by name."""
    model = hf_ring.apply_ring_attention(make_model("glm5_next").eval())
    packed, _ = make_batch("packed", 40)
    with torch.no_grad(), pytest.raises(ValueError, match="packed documents would select among each other's pools"):
        model(**hf_ring.shard_batch(packed))
    with pytest.raises(ValueError, match="a striped shard does not hold"):
        hf_attention._check_pools(False, "striped", 2)
    hf_attention._check_pools(False, "striped", 1)  # (one rank: one run)
    hf_attention._check_pools(False, "contiguous", 2)


def test_inkling_hands_its_relative_bias_to_the_ring_and_reverts():
    """While patched, Inkling's relative-logits modules return the per-query table and its attention modules leave
    the log scaling to the ring (``patches._relative``); revert gives both back; switched by attn_implementation alone,
    the dense bias of a shard's own keys is refused by name."""
    if not in_transformers("inkling_text"):
        pytest.skip("inkling_text is not in this Transformers release")
    from hf_ring.patches import _relative

    model = make_model("inkling_text").eval()
    attention = [m for m in model.modules() if _relative.biased(m)]
    sliding = [m.is_sliding for m in attention]
    assert sliding == [True, False]  # (the test model: a sliding layer, then a full one with log scaling)
    hf_ring.apply_ring_attention(model)
    assert all(m.is_sliding for m in attention)
    tables = [m.rel_logits_proj.__dict__.get("forward") for m in attention]
    assert all(isinstance(t, _relative.Table) for t in tables)
    assert [getattr(m, hf_attention.DISTANCE_BIAS_ATTR).log_scaling for m in attention] == [None, (10, 0.5)]
    hf_ring.revert_ring_attention(model)
    assert [m.is_sliding for m in attention] == sliding
    assert all("forward" not in m.rel_logits_proj.__dict__ for m in attention)
    assert not any(hasattr(m, hf_attention.DISTANCE_BIAS_ATTR) for m in attention)
    model.set_attn_implementation("hf_ring")
    with torch.no_grad(), pytest.raises(ValueError, match=r"does not implement \['position_bias'\]"):
        model(**hf_ring.shard_batch(make_batch("padded", 40)[0]))
    # Inkling 2: its module computes the table (log-scaled by position_ids), which it returns while patched
    model = make_model("inkling2_text").eval()
    bias = [m.relative_position_bias for m in model.modules() if _relative.biased(m)]
    assert len(bias) == 3
    hf_ring.apply_ring_attention(model)
    assert all(isinstance(b.__dict__.get("forward"), _relative.Table2) for b in bias)
    hf_ring.revert_ring_attention(model)
    assert all("forward" not in b.__dict__ for b in bias)


def test_inkling_runs_the_pure_ring_and_refuses_ulysses(monkeypatch):
    """The Ulysses x Ring hybrid does not take a bias by distance or sinks per query: "auto" gives Inkling's families
    the pure ring (a Llama of as many heads gets Ulysses), an explicit ulysses_size is refused by name."""
    if not in_transformers("inkling2_text"):
        pytest.skip("inkling2_text is not in this Transformers release")
    from hf_ring import apply

    monkeypatch.setattr(apply, "group_rank_and_size", lambda group: (0, 4))  # (as on 4 ranks)
    assert apply._ulysses_size("auto", None, make_model("llama").config) > 1
    for family in ("inkling_text", "inkling2_text"):
        assert apply._ulysses_size("auto", None, make_model(family).config) == 1
        with pytest.raises(ValueError, match=f"{family}: ulysses_size=2 is not supported: its relative position bias"):
            hf_ring.apply_ring_attention(make_model(family), ulysses_size=2)


def _inkling_rows(rank, world):
    """Logits of a left-padded batch whose position_ids count from each row's first token (as Hugging Face's
    collators number padded rows): Inkling's log scaling counts the row's index whatever they say (strong scaling,
    from position 10)."""
    model = make_model("inkling_text", log_scaling_alpha=5.0).eval()
    ours, ref = make_batch("padded", 40, family="inkling_text")
    pos = (ref["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = model(**ref, position_ids=pos).logits
        hf_ring.apply_ring_attention(model)
        got = model(**hf_ring.shard_batch({**ours, "position_ids": pos})).logits
    shards = [torch.zeros_like(got) for _ in range(world)]
    torch.distributed.all_gather(shards, got)
    real = ref["attention_mask"].bool()
    padded = float((hf_ring.unshard(shards, dim=1)[:, :40] - want)[real].abs().max() / want[real].abs().max())
    # beside a packed row (its documents each scaled from their first token), a left-padded row of one document keeps
    # the row's index: the same logits as alone
    g = torch.Generator().manual_seed(1)
    ids, mask = torch.randint(3, 50, (2, 40), generator=g), torch.ones(2, 40, dtype=torch.long)
    mask[1, :12] = 0
    pos = torch.stack([torch.cat([torch.arange(20), torch.arange(20)]), (mask[1].cumsum(-1) - 1).clamp(min=0)])
    with torch.no_grad():
        both = model(**hf_ring.shard_batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos})).logits
        alone = model(
            **hf_ring.shard_batch({"input_ids": ids[1:], "attention_mask": mask[1:], "position_ids": pos[1:]})
        )
    keep = hf_ring.shard(mask[1:], dim=1, rank=rank, world_size=world)[0].bool()
    beside = float((both[1] - alone.logits[0])[keep].abs().max() / alone.logits[0][keep].abs().max())
    return max(padded, beside)


def test_inkling_scales_by_the_row_index_whatever_the_position_ids():
    if not in_transformers("inkling_text"):
        pytest.skip("inkling_text is not in this Transformers release")
    from .dist_utils import run_distributed

    assert max(run_distributed(_inkling_rows, 2, timeout=300)) <= 1e-5  # (measured 6e-8: fp32 rounding)


@pytest.mark.parametrize("family", [f for f in MODEL_TYPES if in_transformers(f)])
def test_every_family_applies_and_revert_restores_outputs_exactly(family):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    model = make_model(family).eval()
    original = model.config._attn_implementation
    ids = _ids()
    before = _logits(model, input_ids=ids)
    own = {id(c): c._attn_implementation for c in _sub_configs(model.config)}  # (DBRX's parts of its config: None)

    assert hf_ring.apply_ring_attention(model) is model
    text = model.config.get_text_config()  # a vision-language model: its vision tower keeps its own attention
    attention = get_patch(family).attention_class is not None  # (Mamba2 has none: its implementation stays)
    assert text._attn_implementation == ("hf_ring" if attention else original)
    assert all(c._attn_implementation == own[id(c)] for c in _sub_configs(model.config) if c is not text)
    assert AttentionInterface._global_mapping["hf_ring"] is hf_attention.ring_attention_forward
    assert AttentionMaskInterface._global_mapping["hf_ring"] is hf_attention.ring_mask_function
    modules = get_patch(family).attention_modules(model)
    linear = get_patch(family).linear_modules(model)  # hybrids: their Gated DeltaNet, convolution or Mamba2 layers
    local = get_patch(family).local_modules(model)  # Mllama's cross-attention layers: local, by the model's own
    assert all(getattr(m, hf_attention.LOCAL_ATTR) == original for m in local)
    # (Inkling 2: its attention residuals, two a layer, local; Inkling 2 Loop's and the one taking its messages)
    residuals = family in ("inkling2_text", "inkling2", "inkling2_loop_text")
    loop = family == "inkling2_loop_text"
    assert len(local) == (
        2 * text.num_hidden_layers + loop if residuals else len(getattr(text, "cross_attention_layers", None) or ())
    )
    types = list(getattr(text, "layer_types", None) or [])
    # (HRM-Text's num_hidden_layers counts its cache slots: two stacks of num_layers_per_stack, run in cycles)
    stacked = 2 * text.num_layers_per_stack if family == "hrm_text" else text.num_hidden_layers
    mixing = [t for t in types if t not in ("mlp", "moe")] or [None] * stacked  # (Nemotron-H: MLPs)
    ple = [m for m in linear if isinstance(m.__dict__.get("forward"), ShardedPLE)]  # (Qwen4-Exp's, beside a mixer)
    assert len(ple) == len(getattr(text, "ple_layer_ids", None) or ()) and all(_lends(model, m) for m in ple)
    cca = [m for m in linear if isinstance(m.__dict__.get("forward"), ShardedCCA)]  # (ZAYA's, inside each attention)
    assert len(cca) == (len(modules) if family == "zaya" else 0) and all(_lends(model, m) for m in cca)
    convs = [m for m in linear if isinstance(m.__dict__.get("forward"), ShardedResidualConv)]  # (Inkling's: 4 a layer)
    inkling = family in ("inkling_text", "inkling2_text", "inkling2", "inkling2_loop_text")
    assert len(convs) == (4 * len(modules) if inkling else 0) and all(_lends(model, m) for m in convs)
    both = 0 if cca or convs else types.count("hybrid")  # (Falcon-H1: attention and Mamba2 in one layer, "hybrid")
    layers = len(modules) + len(linear) - len(ple) - len(cca) - len(convs) + (0 if residuals else len(local))
    assert layers == len(mixing) + both
    assert all(isinstance(getattr(m, hf_attention.CONFIG_ATTR), hf_attention.RingConfig) for m in modules)
    assert all(isinstance(m.__dict__.get("forward"), ShardedMixer) for m in linear)
    if family == "jamba":  # its layers call their mixer without the batch's keywords: they lend theirs
        assert linear and all(_lends(model, m) for m in linear)
    if get_patch(family).lend_attention_kwargs:  # (Nemotron, StableLM) the same for their attention, which unpacks
        hf_ring.apply_ring_attention(model)  # again: the hooks replaced, not added
        assert modules and all(_lends(model, m) for m in modules)
        unpacking = [sum(isinstance(h, UnpackLent) for h in m._forward_pre_hooks.values()) for m in modules]
        assert unpacking == [1] * len(modules)
    if family in ("mamba", "falcon_mamba", "mamba2"):  # their mixers are not given the batch's keywords: the model
        assert sum(isinstance(h, LendKeywords) for h in model._forward_pre_hooks.values()) == 1  # lends its own
        unpacks = sum(isinstance(h, UnpackLent) for h in model.backbone._forward_pre_hooks.values())
        assert unpacks == (family == "mamba2")  # (Mamba2's backbone reads the mask, then passes its keywords on)
        hf_ring.apply_ring_attention(model)  # again: the hooks replaced, not added
        assert sum(isinstance(h, LendKeywords) for h in model._forward_pre_hooks.values()) == 1
        assert sum(isinstance(h, UnpackLent) for h in model.backbone._forward_pre_hooks.values()) == unpacks
    itself = get_patch(family).own_attention is not None  # (Falcon, GPT-Neo, BLOOM, MPT: own forward, hand-over)
    assert all(isinstance(m.__dict__.get("forward"), OwnAttention) == itself for m in modules)
    assert bool(_handing_over(model)) == itself
    ring = _logits(model, input_ids=ids)
    torch.testing.assert_close(ring, before, atol=ATOL, rtol=0)

    assert hf_ring.revert_ring_attention(model) is model
    assert not any("forward" in m.__dict__ for m in modules) and not _handing_over(model)
    assert all(c._attn_implementation == own[id(c)] for c in _sub_configs(model.config))
    assert not any(hasattr(m, hf_attention.CONFIG_ATTR) for m in modules)
    assert not any(hasattr(m, hf_attention.LOCAL_ATTR) for m in local)
    assert not any("forward" in m.__dict__ for m in linear)
    lending = (LendKeywords, UnpackLent)
    assert not any(isinstance(h, lending) for m in model.modules() for h in m._forward_pre_hooks.values())
    assert torch.equal(_logits(model, input_ids=ids), before)  # bit-identical

    if family not in DEDICATED:
        return
    # the Liger-style family entry points do the same
    mod = __import__(f"hf_ring.patches.{family}", fromlist=["x"])
    assert getattr(mod, f"apply_ring_attention_to_{family}")(model=model) is model
    assert model.config._attn_implementation == "hf_ring"
    getattr(mod, f"revert_ring_attention_from_{family}")(model)
    assert torch.equal(_logits(model, input_ids=ids), before)


def _handing_over(model) -> list:
    """The ``HandOver`` hooks of ``model`` (of a family whose attention computes attention itself)."""
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    return [h for h in hooks if isinstance(getattr(h, "__self__", h), HandOver)]


@pytest.mark.parametrize("family", ["falcon", "gpt_neo", "bloom", "mpt"])
def test_attention_computed_in_the_modules_own_forward_goes_through_the_ring(family):
    """Falcon's, GPT-Neo's, BLOOM's and MPT's attention modules compute attention themselves: while patched, their forward is
    hf_ring's (``patches._own``), and the model hands the batch's keywords to them through its causal mask, also to a
    forward that raises, leaving nothing behind; a deep copy's modules have forwards of their own."""
    import copy

    from hf_ring.ring_config import HANDED_OVER

    model = make_model(family).eval()
    batch, reference = make_batch("padded", 21)
    real = reference["attention_mask"].bool()
    with torch.no_grad():
        before = model(**reference).logits
    hf_ring.apply_ring_attention(model)
    assert len(_handing_over(model)) == 4  # two on the causal LM, two on its base model
    seen = []
    attention = get_patch(family).attention_modules(model)[0]
    attention.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["attention_mask"]), with_kwargs=True)
    with torch.no_grad():
        ring = model(**hf_ring.shard_batch(batch)).logits
    assert isinstance(seen[0], hf_attention.Lent) and "ring_document_ids" in seen[0].kwargs
    torch.testing.assert_close(ring[real], before[real], atol=ATOL, rtol=0)
    assert not HANDED_OVER.stack
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(**hf_ring.shard_batch(batch), output_attentions=True)
    assert not HANDED_OVER.stack

    class Interrupt(BaseException):  # (as Ctrl-C: Torch runs no closing hook for it)
        pass

    def interrupt(*args):
        raise Interrupt

    handle = get_patch(family).attention_modules(model)[-1].register_forward_pre_hook(interrupt)
    with pytest.raises(Interrupt):
        model(**hf_ring.shard_batch(batch))
    handle.remove()
    assert HANDED_OVER.stack  # left behind: the next call drops them, never inherits them
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    assert seen[-1].kwargs == {} and not HANDED_OVER.stack
    # its base model called on its own (a value head, an embedding) takes its own keywords and leaves none behind
    with torch.no_grad():
        inner = model.base_model(**{k: v for k, v in hf_ring.shard_batch(batch).items() if k != "labels"})
    assert not HANDED_OVER.stack
    torch.testing.assert_close(model.lm_head(inner.last_hidden_state)[real], before[real], atol=ATOL, rtol=0)
    llama = hf_ring.apply_ring_attention(make_model("llama").eval())  # (another patched model builds its own mask)
    with torch.no_grad():
        torch.testing.assert_close(_logits(llama, input_ids=_ids()), _logits(make_model("llama"), input_ids=_ids()))
    twin = copy.deepcopy(model)
    module = get_patch(family).attention_modules(twin)[0]
    assert module.forward.module is module
    with torch.no_grad():
        torch.testing.assert_close(twin(**hf_ring.shard_batch(batch)).logits, ring, atol=0, rtol=0)


def test_falcon_built_with_alibi_and_a_forward_replaced_by_someone_else_are_refused():
    import types

    with pytest.raises(ValueError, match="built with ALiBi"):
        hf_ring.apply_ring_attention(make_model("falcon", alibi=True))
    model = make_model("gpt_neo")
    attention = get_patch("gpt_neo").attention_modules(model)[0]
    attention.forward = types.MethodType(type(attention).forward, attention)  # (as Accelerate's offloading hooks do)
    with pytest.raises(ValueError, match="its forward was replaced by something else"):
        hf_ring.apply_ring_attention(model)
    assert model.config._attn_implementation != "hf_ring"


def test_falcon_attention_dropout_in_training_is_refused_where_its_module_applies_it():
    """From Transformers 5.25 Falcon's module applies ``attention_dropout`` (a float there) in training: refused, as
    for every family; in eval mode none. (Before 5.25 its rotary path applied none, an ``nn.Dropout`` it never ran.)"""
    model = make_model("falcon")
    modules = get_patch("falcon").attention_modules(model)
    if isinstance(modules[0].attention_dropout, torch.nn.Module):
        pytest.skip("Transformers before 5.25: Falcon's rotary path applies no attention dropout")
    for m in modules:
        m.attention_dropout = 0.1
    hf_ring.apply_ring_attention(model)
    ids = _ids()
    model.train()
    with pytest.raises(ValueError, match="attention dropout 0.1 is not supported"):
        model(input_ids=ids)
    model.eval()
    assert torch.isfinite(model(input_ids=ids).logits).all()


def _lends(model, mixer) -> bool:
    """The decoder layer holding ``mixer`` has the hook that lends it the layer's keywords (``patches.linear``)."""
    layer = next(p for p in model.modules() if any(c is mixer for c in p.children()))
    return sum(isinstance(h, LendKeywords) for h in layer._forward_pre_hooks.values()) == 1


def _sub_configs(config) -> list:
    return [config] + [getattr(config, k) for k in config.sub_configs if getattr(config, k, None) is not None]


@pytest.mark.parametrize(
    "family",
    [
        "aria",
        "aya_vision",
        "cohere_compass",
        "cohere2_vision",
        "apertus1p5",
        "exaone4_5",
        "deepseek_vl",
        "deepseek_vl_hybrid",
        "chameleon",
        "emu3",
        "fuyu",
        "ernie4_5_vl_moe",
        "gemma3",
        "gemma3n",
        "gemma4",
        "gemma4_unified",
        "glm4v",
        "glm4v_moe",
        "glm46v",
        "glm46v-moe",
        "glmga",
        "glm_ocr",
        "got_ocr2",
        "granite4_vision",
        "granite_docling",
        "hunyuan_vl",
        "hy_v4_vl",
        "hyperclovax_vision_v2",
        "idefics2",
        "idefics3",
        "kimi_k25",
        "janus",
        "lfm2_vl",
        "lfm2_vl-text-only",  # (every wrapper takes images: a text-only one made by tests.hf_models.text_only)
        "lfm3_vl",
        "lighton_ocr",
        "llava_onevision1_5",
        "ovis2_5",
        "llama4",
        "llava",
        "llava_next",
        "llava_next_video",
        "llava_onevision",
        "minimax_m3_vl",
        "mistral3",
        "mistral_large4",
        "minicpmv4_6",
        "minicpmv4_7",
        "minicpm_ocr",
        "muse_spark",
        "muse_glimmer",
        "dots3_note",
        "molmo2",
        "mistral3-ministral3",
        "ovis2",
        "paddleocr_vl",
        "qianfan_ocr",
        "paligemma",
        "paligemma-gemma2",
        "inkling2",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_5",
        "qwen3_vl",
        "qwen3_vl_moe",
        "smolvlm",
        "step3p7",
        "fast_vlm",
        "perception_lm",
        "phi4_multimodal",  # text-only (its images merge inside its text model)
        "video_llava",
        "vipllava",
        "video_llama_3",
        "qwen2_audio",
        "voxtral",
        "moss_transcribe_diarize",
        "granite_speech",
        "granite_speech_plus",
        "nemotron_h_omni",
        "qwen2_5_omni_thinker",
        "qwen3_omni_moe_thinker",
        "cosmos3_omni",
        "cosmos3_edge",
    ],
)
def test_vision_language_models_run_text_only_batches_and_refuse_images(family):
    """The text model of a vision-language model is patched; images, video or image tokens raise before anything
    runs, naming what the batch carries (for the families that take images: images beside input_ids that were
    sharded); without them the model runs as before."""
    import contextlib

    made_text_only = family.endswith("-text-only")
    family = family.removesuffix("-text-only")
    if not in_transformers(family):
        pytest.skip(f"{family}: not run by this Transformers release (tests.hf_models SINCE, BROKEN)")
    with text_only(family) if made_text_only else contextlib.nullcontext():
        _text_only_batches_and_refused_images(family)


def _text_only_batches_and_refused_images(family):
    from hf_ring.patches._family import TextOnly

    model = make_model(family).eval()
    ids = _ids()
    before = _logits(model, input_ids=ids)
    hf_ring.apply_ring_attention(model)
    pixels = torch.zeros(1, 3, 28, 28)
    if get_patch(model.config.model_type).images:
        sharded = hf_attention.ShardInfo(layout="zigzag", world_size=1, rank=0, seq_len=ids.shape[1])
        inner = getattr(model, "model", None)  # (Llama 4's wrapper has none: its vision tower and causal LM only)
        if inner is not None and inner.config is not model.config:  # (5.17's Qwen2.5-Omni thinker: its text model)
            inner = None
        for call in (model, inner) if inner is not None else (model,):  # the outer model, the inner one on its own
            with pytest.raises(ValueError, match="carries pixel_values but its input_ids were sharded"):
                call(input_ids=ids, pixel_values=pixels, **{hf_attention.SHARD_INFO_KWARG: sharded})
        if family == "gemma4":  # audio too: beside input_ids that were sharded, refused
            with pytest.raises(ValueError, match="carries input_features but its input_ids were sharded"):
                model(input_ids=ids, input_features=torch.zeros(1, 20, 128), **{hf_attention.SHARD_INFO_KWARG: sharded})
        if family in AUDIO_CLIPS:  # an audio-language model: its clips (Muse Spark's waveforms), beside sharded ids
            with pytest.raises(ValueError, match="carries input_(features|values) but its input_ids were sharded"):
                model(
                    input_ids=ids, **AUDIO_CLIPS[family](torch.Generator()), **{hf_attention.SHARD_INFO_KWARG: sharded}
                )
        if family == "apertus1p5":  # its audio (input_values) too
            with pytest.raises(ValueError, match="carries input_values but its input_ids were sharded"):
                model(input_ids=ids, input_values=torch.zeros(1, 1, 64), **{hf_attention.SHARD_INFO_KWARG: sharded})
        torch.testing.assert_close(_logits(model, input_ids=ids), before, atol=ATOL, rtol=0)
        hf_ring.revert_ring_attention(model)
        assert not any(isinstance(h, TextOnly) for m in model.modules() for h in m._forward_pre_hooks.values())
        return
    key = "image_pixel_values" if family == "phi4_multimodal" else "pixel_values"  # (Phi-4-multimodal's name)
    for call in (
        lambda: model(input_ids=ids, **{key: pixels}),
        lambda: model(
            ids, *[None] * (list(inspect.signature(type(model).forward).parameters).index(key) - 2), pixels
        ),  # positional (Qwen-VL takes attention_mask, ... before pixel_values)
        lambda: model.model(input_ids=ids, **{key: pixels}),  # the inner model, called on its own
    ):
        with pytest.raises(ValueError, match=f"carries {key}: images, video or audio are not supported"):
            call()
    # an empty mm_encoder_outputs (Transformers 5.23's generate passes one; 5.17 has no such argument) carries nothing
    if "mm_encoder_outputs" in inspect.signature(type(model).forward).parameters:
        torch.testing.assert_close(_logits(model, input_ids=ids, mm_encoder_outputs={}), before, atol=ATOL, rtol=0)
    if family in ("gemma3", "gemma4"):
        key = "token_type_ids" if family == "gemma3" else "mm_token_type_ids"
        types = torch.zeros_like(ids)
        torch.testing.assert_close(_logits(model, input_ids=ids, **{key: types}), before, atol=ATOL, rtol=0)
        types[:, 2:6] = 1
        with pytest.raises(ValueError, match=f"{key} marking image tokens"):
            model(input_ids=ids, **{key: types})
    if family == "gemma4":  # audio
        with pytest.raises(ValueError, match="carries input_features"):
            model(input_ids=ids, input_features=torch.zeros(1, 20, 128))
    torch.testing.assert_close(_logits(model, input_ids=ids), before, atol=ATOL, rtol=0)
    hf_ring.revert_ring_attention(model)
    model(input_ids=ids, pixel_values=None)  # the hooks are gone with the patch
    assert not any(isinstance(h, TextOnly) for m in model.modules() for h in m._forward_pre_hooks.values())


@pytest.mark.parametrize(
    "family, kind",
    [
        ("llava", "images"),
        ("llava_next", "images"),
        ("llava_next_video", "images"),
        ("llava_next_video", "video"),  # pooled frames
        ("llava_onevision", "images-padded"),  # row 0's images untiled (batch_num_images), row 1's tiled
        ("llava_onevision", "video"),  # pooled frames
        ("vipllava", "images-padded"),  # features of several vision layers
        ("video_llava", "images"),  # pixel_values_images
        ("video_llava", "video"),  # its video tower
        ("perception_lm", "images-padded"),  # tiles pooled 2 x 2
        ("perception_lm", "video"),
        ("fast_vlm", "images-padded"),  # a convolutional tower's feature map
        ("qwen2_vl", "images-padded"),
        ("qwen2_5_vl", "video"),
        ("qwen3_vl", "images"),
        ("qwen3_vl_moe", "images-padded"),
        ("qwen3_5", "images"),
        ("qwen3_5_moe", "images-padded"),
        ("internvl", "images"),
        ("mistral3", "images-padded"),
        ("idefics3", "images"),
        ("smolvlm", "images-padded"),
        ("gemma3", "images-padded"),  # image tokens see each other both ways (ring_block_ids)
        ("gemma4", "images"),  # causal over images (use_bidirectional_attention=None, the smaller checkpoints)
        ("gemma4-audio", "audio"),
        ("gemma3n", "images-padded"),  # a convolutional tower in place of its timm one
        ("gemma3n", "audio"),  # its conformer; a shorter clip padded to its placeholders by the model
        ("gemma4_unified", "images-padded"),  # patches projected without a tower, both ways within each image
        ("cohere_compass", "images"),  # Qwen3-VL's tower, deepstack features, multimodal RoPE on sliding layers
        ("hyperclovax_vision_v2", "images-padded"),  # Qwen2.5-VL's tower, HyperCLOVA X text (1-D RoPE)
        ("lfm2_vl", "images-padded"),  # short-convolution layers
        ("aya_vision", "images-padded"),  # Cohere2 text: parallel attention and MLP, sliding and full layers
        ("cohere2_vision", "images"),
        ("idefics2", "images-padded"),  # perceiver latents
        ("lighton_ocr", "images"),
        ("llava_onevision1_5", "images-padded"),  # a RICE-ViT tower by image grid (a class token per image)
        ("ovis2_5", "images"),  # visual tokens and indicator tokens, a windowed tower layer
        ("got_ocr2", "images-padded"),
        ("ovis2", "images"),  # visual indicator tokens
        ("qianfan_ocr", "images-padded"),
        ("exaone4_5", "images"),  # sliding and full layers (EXAONE 4 text)
        ("minimax_m3_vl", "images-padded"),  # partial rotary, experts (MiniMax M3 text, dense attention layers)
        ("mistral_large4", "images-padded"),  # DeepSeek sparse attention over image tokens (Mistral Large 4 text)
        ("hy_v4_vl", "images"),  # DeepSeek sparse attention, multimodal RoPE (HunYuan V4 VL text)
        ("granite_docling", "images-padded"),  # tiles (a padding one), deepstack features, a density router
        ("lfm3_vl", "images-padded"),  # short convolutions, sliding and full layers (LFM3 text)
        ("apertus1p5", "images-padded"),  # images as discrete codes embedded by the text model
        ("apertus1p5", "audio"),  # audio too (input_values: waveforms, their codes embedded)
        ("kimi_k25", "images-padded"),  # latent attention (DeepSeek-V3 text)
        ("llama4", "images-padded"),  # chunked attention, a layer without RoPE (temperature tuning), causal LM inside
        ("minicpmv4_6", "images"),  # Gated DeltaNet layers
        ("minicpm_ocr", "images-padded"),  # MiniCPM-V 4.6's architecture
        ("minicpmv4_7", "images-padded"),  # and multimodal positions on a canvas
        ("muse_spark", "images"),  # gated attention, sliding layers, experts
        ("muse_glimmer", "images-padded"),  # gated attention, sliding layers, a full one without RoPE
        ("dots3_note", "images-padded"),  # sparse attention beside sliding layers
        ("qwen4_exp", "images-padded"),  # blocks of keys picked per query, per-layer n-gram embeddings of the ids
        ("glm5_next", "images-padded"),  # pools of keys picked per query, KDA layers, hyper-connections
        ("video_llama_3", "video"),
        ("deepseek_vl", "images-padded"),
        ("janus", "images"),
        ("deepseek_vl_hybrid", "images"),
        ("paligemma", "images-padded"),  # the prefix (token_type_ids 0) sees itself both ways
        ("paligemma-gemma2", "images"),
        ("glm4v", "images-padded"),  # multimodal RoPE on half of each head
        ("glm4v_moe", "images"),  # experts
        ("glm46v", "images-padded"),
        ("glm46v-moe", "images"),  # its text model GLM-4.5V's (AutoModel)
        ("glmga", "images-padded"),  # GLM-4.6V's classes under a config of its own
        ("glm_ocr", "images-padded"),
        ("hunyuan_vl", "images-padded"),  # 4-axis multimodal RoPE, padding numbered 0
        ("granite4_vision", "images-padded"),  # deepstack features added before text layers, LLaVA-NeXT tiles
        ("paddleocr_vl", "images-padded"),  # Qwen2-VL's multimodal RoPE, a NaViT tower
        ("qwen2_audio", "audio"),  # a padded clip (feature_attention_mask); its head's own loss replaced
        ("voxtral", "audio"),  # a Llama text model
        ("moss_transcribe_diarize", "audio"),  # a Qwen3 text model; a shorter clip (its frame mask)
        ("granite_speech", "audio"),  # a conformer, window Q-Former; tokens of a shorter clip dropped (a mask)
        ("granite_speech_plus", "audio"),  # its projector reads an intermediate encoder layer too
        ("nemotron_h_omni", "audio"),  # Mamba2 layers; the text model inside its causal LM cuts
        ("qwen2_5_omni_thinker", "images-padded"),  # Qwen2.5-VL's multimodal RoPE, no token types
        ("qwen2_5_omni_thinker", "video"),  # the seconds per temporal patch
        ("qwen2_5_omni_thinker", "audio"),  # a clip shorter than the others (feature_attention_mask)
        ("qwen3_omni_moe_thinker", "images-padded"),  # deepstack features, experts
        ("qwen3_omni_moe_thinker", "video"),
        ("qwen3_omni_moe_thinker", "audio"),
        ("cosmos3_omni", "images-padded"),  # Qwen3-VL's architecture (deepstack), a model type of its own
        ("cosmos3_edge", "images-padded"),  # interleaved multimodal RoPE, a SigLIP2 tower
        ("aria", "images-padded"),  # a cross-attention projector, MoE text (Aria)
        ("molmo2", "images-padded"),  # image tokens attending both ways (one block per row), pooled patches
        ("emu3", "images-padded"),  # images as VQ codes embedded by the text model
        ("chameleon", "images-padded"),  # images as VQ codes, merged by the text model in its own forward
        ("fuyu", "images-padded"),  # patches projected linearly (image_patches, its processor's name)
        ("ernie4_5_vl_moe", "images-padded"),  # experts by token type (moe_mm_token_type_ids), 3-D multimodal RoPE
        ("step3p7", "images-padded"),  # sliding and full layers of their own head counts, head-wise gates
    ],
)
def test_vision_language_models_take_image_batches_whole_at_one_rank(family, kind):
    """A batch with images or video: shard_batch keeps input_ids whole and passes the media keys on, the text
    model's hook cuts the merged embeddings (at one rank: all of them); the logits of every real token equal the
    unpatched model's, and revert removes the hook."""
    from hf_ring.patches._family import ShardEmbeddings

    if family == "lfm2_vl" and not transformers_at_least("5.23"):
        pytest.skip("Transformers 5.17's LFM2 layers drop the batch's keywords: padded batches are refused")
    if not in_transformers(family):
        pytest.skip(f"{family}: not run by this Transformers release (tests.hf_models SINCE, BROKEN)")
    model = make_model(family, images=True).eval()
    batch, _ = make_batch(kind, 40, family=family)
    before = _logits(model, **batch)
    hf_ring.apply_ring_attention(model)
    local = hf_ring.shard_batch(batch)
    assert local[hf_attention.SHARD_INFO_KWARG].whole_inputs and "position_ids" not in local
    media = next(k for k in MEDIA_KEYS if k in batch)
    assert torch.equal(local["input_ids"], batch["input_ids"]) and local[media] is batch[media]
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    torch.testing.assert_close(_logits(model, **local)[real], before[real], atol=ATOL, rtol=0)
    assert sum(isinstance(h, ShardEmbeddings) for m in model.modules() for h in m._forward_pre_hooks.values()) == 1
    hf_ring.revert_ring_attention(model)
    assert not any(isinstance(h, ShardEmbeddings) for m in model.modules() for h in m._forward_pre_hooks.values())


def test_molmo2_refuses_image_token_types_of_a_sharded_batch():
    """Molmo2's image tokens see each other both ways across the whole sequence: token types marking them in a batch
    whose input_ids were sharded (no pixels) are refused, before anything runs; all-zero ones (its processor's for
    text, which its forward requires in training) change nothing."""
    if not in_transformers("molmo2"):
        pytest.skip("molmo2: not in this Transformers release")
    model = make_model("molmo2", images=True).eval()
    ids = _ids()
    types = torch.zeros_like(ids)
    before = _logits(model, input_ids=ids, mm_token_type_ids=types)
    hf_ring.apply_ring_attention(model)
    torch.testing.assert_close(_logits(model, input_ids=ids, mm_token_type_ids=types), before, atol=ATOL, rtol=0)
    types[:, 2:6] = 1
    sharded = hf_attention.ShardInfo(layout="zigzag", world_size=2, rank=0, seq_len=2 * ids.shape[1])
    with pytest.raises(ValueError, match="molmo2: mm_token_type_ids marking image tokens in a batch without images"):
        model(input_ids=ids, mm_token_type_ids=types, **{hf_attention.SHARD_INFO_KWARG: sharded})
    hf_ring.revert_ring_attention(model)


def test_step3p7_refuses_bidirectional_attention_and_takes_every_layers_heads_for_ulysses():
    """Step 3.7's text model attending both ways (use_bidirectional_attention) is refused; its layers' query head
    counts differ (2 sliding, 4 full), so Ulysses' divisor is their gcd (Transformers refuses a global count)."""
    from hf_ring.apply import _query_heads

    model = make_model("step3p7", images=True)
    assert _query_heads(model.config.get_text_config()) == 2
    with pytest.raises(ValueError, match="ulysses_size=4 does not divide the model's 2 query heads"):
        hf_ring.apply_ring_attention(model, ulysses_size=4)
    model.config.get_text_config().use_bidirectional_attention = True
    with pytest.raises(ValueError, match="step3p5: use_bidirectional_attention=True"):
        hf_ring.apply_ring_attention(model)


def test_paligemma_attends_causally_with_its_prefix_and_refuses_what_the_ring_would_mask_otherwise():
    """PaliGemma's text attention says is_causal=False (use_bidirectional_attention): patched, it attends causally
    (its own mask), the prefix both ways; revert restores the flag. Refused on every rank alike: token types of a
    sharded text batch (the prefix spans the whole sequence), and on PaliGemma 2's sliding layers a prefix longer
    than the window (Transformers ignores the window there); and a model switched by name only (no apply), whose
    modules still say is_causal=False."""
    model = make_model("paligemma-gemma2", images=True).eval()
    flags = [m.is_causal for m in get_patch("paligemma").attention_modules(model)]
    assert flags and not any(flags)
    batch, _ = make_batch("images", 40, family="paligemma-gemma2")
    before = _logits(model, **batch)
    hf_ring.apply_ring_attention(model)
    assert all(m.is_causal for m in get_patch("paligemma").attention_modules(model))
    torch.testing.assert_close(_logits(model, **hf_ring.shard_batch(batch)), before, atol=ATOL, rtol=0)
    types = batch["token_type_ids"].clone()
    types[0, :20] = 0  # a prefix of 20 tokens, the window 16
    with pytest.raises(ValueError, match="prefix \\(token_type_ids 0\\) of 20 tokens is longer than the sliding"):
        model(**hf_ring.shard_batch({**batch, "token_type_ids": types}))
    ids = batch["input_ids"].masked_fill(batch["input_ids"] >= VOCAB, 5)[:, :20]  # rank 0's text, cut by hand
    half = {hf_attention.SHARD_INFO_KWARG: hf_attention.ShardInfo(layout="zigzag", world_size=2, rank=0, seq_len=40)}
    with pytest.raises(ValueError, match="token_type_ids of a batch without images, its input_ids sharded"):
        model(input_ids=ids, token_type_ids=types[:, :20], **half)
    hf_ring.revert_ring_attention(model)
    assert not any(m.is_causal for m in get_patch("paligemma").attention_modules(model))
    torch.testing.assert_close(_logits(model, **batch), before, atol=0, rtol=0)
    # switched by name only, its modules still say is_causal=False: refused, not run both ways over every token
    model.set_attn_implementation({"text_config": "hf_ring"})
    with pytest.raises(ValueError, match="says is_causal=False .* while its model masks it causally"):
        model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], token_type_ids=batch["token_type_ids"])


def test_gemma4_unified_sees_each_image_both_ways_on_every_layer_and_refuses_an_image_longer_than_the_window():
    """Gemma 4 Unified's forward lets an image's tokens see each other both ways on its full-attention layers too (Gemma
    4's stay causal there): the logits equal the unmodified model's, and differ from it with Gemma 4's blocks (the
    control). An image longer than the sliding window is refused (Transformers lets its tokens see each other beyond
    the window); with use_bidirectional_attention=None the images are causal, whatever their length."""
    from hf_ring.patches import multimodal

    if not in_transformers("gemma4_unified"):
        pytest.skip("gemma4_unified is not in this Transformers release")
    model = make_model("gemma4_unified", images=True).eval()
    batch, _ = make_batch("images", 40, family="gemma4_unified")
    before = _logits(model, **batch)
    hf_ring.apply_ring_attention(model)
    torch.testing.assert_close(_logits(model, **hf_ring.shard_batch(batch)), before, atol=ATOL, rtol=0)
    gemma4 = multimodal._gemma4_blocks(model.config, batch)
    assert gemma4.sliding_only and multimodal.BLOCKS["gemma4_unified"](model.config, batch).sliding_only is False
    with torch.no_grad():
        sliding_only = model(**hf_ring.shard_batch(batch), ring_block_ids=gemma4).logits
    assert float((sliding_only - before).abs().max()) > 1e-2
    hf_ring.revert_ring_attention(model)
    for window, refused in ((15, True), (16, False)):  # (images of 16 tokens)
        narrow = make_model("gemma4_unified", images=True, sliding_window=window).eval()
        hf_ring.apply_ring_attention(narrow)
        if refused:
            with pytest.raises(ValueError, match="an image or video of 16 tokens is longer than the sliding window"):
                narrow(**hf_ring.shard_batch(batch))
        else:
            narrow(**hf_ring.shard_batch(batch))
    causal = make_model("gemma4_unified", images=True, sliding_window=6, use_bidirectional_attention=None).eval()
    before = _logits(causal, **batch)
    hf_ring.apply_ring_attention(causal)
    torch.testing.assert_close(_logits(causal, **hf_ring.shard_batch(batch)), before, atol=ATOL, rtol=0)


def test_granite_docling_refuses_its_density_router_loss_over_several_ranks():
    """Granite Docling adds its density router's loss (of the whole batch's images) to the language-model loss when
    given router_labels: at one rank the loss is the unmodified model's, router loss included; over several ranks
    each would count it again, so the call is refused before anything runs (ShardInfo of 2 ranks); the chunked loss,
    which computes the language-model loss only, refuses them too."""
    if not in_transformers("granite_docling"):
        pytest.skip("granite_docling is not in this Transformers release")
    model = make_model("granite_docling", images=True).eval()
    batch, _ = make_batch("images", 40, family="granite_docling")
    router = torch.tensor([1.0, 0.0])
    with torch.no_grad():
        before = model(**batch, router_labels=router).loss
        assert float((before - model(**batch).loss).abs()) > 1e-3  # (the router's loss counts)
        hf_ring.apply_ring_attention(model)
        torch.testing.assert_close(model(**hf_ring.shard_batch(batch), router_labels=router).loss, before)
    info = hf_attention.ShardInfo(layout="zigzag", world_size=2, rank=0, seq_len=40, whole_inputs=True)
    with pytest.raises(ValueError, match="router_labels add a loss of the whole batch's images"):
        model(**batch, **{hf_attention.SHARD_INFO_KWARG: info}, router_labels=router)
    hf_ring.apply_chunked_loss(model)  # (which computes the language-model loss only: refused, not dropped)
    with pytest.raises(ValueError, match="router_labels add granite_docling's own loss .* chunked loss does not"):
        model(**batch, router_labels=router)
    hf_ring.revert_chunked_loss(model)
    hf_ring.revert_ring_attention(model)
    assert not any(type(h).__name__ == "RefuseExtraLoss" for h in model._forward_pre_hooks.values())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_mllama_takes_images_by_cross_attention_beside_sharded_text(implementation):
    """Llama 3.2 Vision: a batch with a cross_attention_mask is sharded as text (positions, the mask's rows with it)
    and its images go whole to every rank; its cross-attention modules attend locally by the implementation the
    model had (SDPA for eager), its self-attention through the ring; the logits equal the unpatched model's, text
    alone too. A batch with images but no cross_attention_mask (kept whole by shard_batch) is refused; revert gives
    the model back bit for bit."""
    from hf_ring.patches._family import ShardEmbeddings

    from hf_ring.batch import shard_for

    model = make_model("mllama", images=True).eval()
    model.set_attn_implementation({"text_config": implementation})
    batch, _ = make_batch("images-padded", 40, family="mllama")
    before = _logits(model, **batch)
    text_before = _logits(model, input_ids=batch["input_ids"])
    hf_ring.apply_ring_attention(model)
    patch = get_patch("mllama")
    crosses, selves = patch.local_modules(model), patch.attention_modules(model)
    assert len(crosses) == 1 and len(selves) == 2
    assert all(getattr(m, hf_attention.LOCAL_ATTR) == implementation for m in crosses)
    assert not any(hasattr(m, hf_attention.CONFIG_ATTR) for m in crosses)
    assert all(hasattr(m, hf_attention.CONFIG_ATTR) for m in selves)
    assert not any(isinstance(h, ShardEmbeddings) for m in model.modules() for h in m._forward_pre_hooks.values())
    local = hf_ring.shard_batch(batch)
    assert not local[hf_attention.SHARD_INFO_KWARG].whole_inputs and "position_ids" in local
    assert all(local[k] is batch[k] for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"))
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(_logits(model, **local)[real], before[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(_logits(model, input_ids=batch["input_ids"]), text_before, atol=ATOL, rtol=0)
    # rank 1 of 2: the cross-attention mask's rows are those of its tokens (the zig-zag chunks 1 and 2 of 4)
    half = shard_for(batch, 1, 2)
    assert torch.equal(half["cross_attention_mask"], batch["cross_attention_mask"][:, 10:30])
    assert torch.equal(half["input_ids"], batch["input_ids"][:, 10:30])
    assert half["pixel_values"] is batch["pixel_values"]
    whole = {k: v for k, v in batch.items() if k != "cross_attention_mask"}
    with pytest.raises(ValueError, match="without a cross_attention_mask, so shard_batch kept its input_ids whole"):
        model(**hf_ring.shard_batch(whole))
    prompt = {k: v for k, v in whole.items() if k != "labels"}
    with pytest.raises(ValueError, match="carries images without a cross_attention_mask"):
        hf_ring.ring_generate(model, prompt, max_new_tokens=2)
    with pytest.raises(ValueError, match="cross_attention_mask must be \\[batch, seq_len, ...\\]"):
        hf_ring.shard_batch({**batch, "cross_attention_mask": batch["cross_attention_mask"][:, :39]})
    hf_ring.revert_ring_attention(model)
    assert not any(hasattr(m, hf_attention.LOCAL_ATTR) for m in crosses)
    torch.testing.assert_close(_logits(model, **batch), before, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_audio", "granite_speech"])
def test_a_head_with_a_loss_of_its_own_leaves_trls_fused_head_alone(family):
    """Qwen2-Audio's and Granite Speech's heads compute a loss of their own, which hf_ring replaces under shard_batch
    by the causal-LM loss of shift_labels; a call through TRL's fused LM head (RingSFTTrainer's) scores shift_labels
    itself: the same log-probabilities patched as unpatched."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from hf_ring.batch import shard_for

    model = make_model(family, images=True).eval()
    trl_utils.add_fused_lm_head(model)
    batch, _ = make_batch("audio", 40, family=family)
    local = {k: v for k, v in shard_for(batch, 0, 1).items() if k not in ("labels", "num_items_in_batch")}
    with torch.no_grad():
        before = model(**local, fused_lm_head=True).log_probs
        hf_ring.apply_ring_attention(model)
        after = model(**local, fused_lm_head=True).log_probs
    torch.testing.assert_close(after, before, atol=ATOL, rtol=0)


def test_shard_batch_with_images_refuses_packing_and_misshaped_token_types():
    batch, _ = make_batch("images", 40, family="qwen2_vl")
    for extra, match in (
        ({"position_ids": torch.arange(40)[None]}, "takes no \\['position_ids'\\]"),
        ({"cu_seq_lens_q": torch.tensor([0, 20, 40])}, "packed documents with images are not supported"),
        ({"mm_token_type_ids": torch.zeros(2, 39, dtype=torch.long)}, "mm_token_type_ids must have the shape"),
        ({"pixel_values": [torch.zeros(3, 28, 28)]}, "pixel_values must be a tensor"),
        ({"completion_mask": torch.ones(2, 40, dtype=torch.long)}, "how to shard \\['completion_mask'\\]"),
    ):
        with pytest.raises(ValueError, match=match):
            hf_ring.shard_batch({**batch, **extra})
    # per-image keys shaped like input_ids in their first two dimensions (LFM2-VL: one image per row, rows of as
    # many tokens as an image's patches) pass on whole, as Transformers' processors make them
    ids = torch.randint(3, 90, (2, 16))
    per_image = {"pixel_values": torch.randn(2, 16, 768), "pixel_attention_mask": torch.ones(2, 16, dtype=torch.bool)}
    local = hf_ring.shard_batch({"input_ids": ids, **per_image})
    assert all(local[k] is v for k, v in per_image.items()) and torch.equal(local["input_ids"], ids)


def test_vision_language_model_with_another_text_family_is_refused():
    model = make_model("mistral3")
    model.config.text_config.model_type = "qwen2"
    with pytest.raises(
        ValueError, match=r"mistral3: hf_ring supports its text model of types \['mistral', 'ministral3'\], not 'qwen2'"
    ):
        hf_ring.apply_ring_attention(model)
    assert model.config.text_config._attn_implementation != "hf_ring"


def test_llama4_temperature_tuning_moves_into_the_ring_and_back():
    """Llama 4's layer without RoPE scales its queries by their index: the ring does it (by the whole row's index)
    while the model is patched, applying twice changes nothing, and revert gives the module its own scaling back."""
    model = make_model("llama4_text").eval()
    attn = [layer.self_attn for layer in model.model.layers]
    assert [m.attn_temperature_tuning and not m.use_rope for m in attn] == [False, False, True, False]
    for _ in range(2):
        hf_ring.apply_ring_attention(model)
        held = [getattr(m, hf_attention.TEMPERATURE_ATTR, None) for m in attn]
        assert held[2] == hf_attention.QueryTemperature(4.0, 0.5) and held.count(None) == 3
        assert not attn[2].attn_temperature_tuning
    hf_ring.revert_ring_attention(model)
    assert attn[2].attn_temperature_tuning and not any(hasattr(m, hf_attention.TEMPERATURE_ATTR) for m in attn)


def test_apply_twice_keeps_the_original_for_revert():
    model = make_model("llama").eval()
    model.set_attn_implementation("eager")
    before = _logits(model, input_ids=_ids())
    hf_ring.apply_ring_attention(model)
    hf_ring.apply_ring_attention(model, layout="striped", backend="torch")
    cfg = getattr(get_patch("llama").attention_modules(model)[0], hf_attention.CONFIG_ATTR)
    assert (cfg.layout, cfg.backend) == ("striped", "torch")
    hf_ring.revert_ring_attention(model)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(_logits(model, input_ids=_ids()), before)


@pytest.mark.parametrize("register", ["register_attention", "family_entry_point"])
def test_registration_alone_enables_attn_implementation_hf_ring(register):
    from hf_ring.patches import apply_ring_attention_to_qwen2
    from transformers import AutoModelForCausalLM

    if register == "register_attention":
        assert hf_ring.register_attention() is None
    else:
        assert apply_ring_attention_to_qwen2() is None
    ref = make_model("qwen2").eval()
    model = AutoModelForCausalLM.from_config(ref.config, attn_implementation="hf_ring").eval()
    model.load_state_dict(ref.state_dict())
    for m in model.modules():  # make_model's non-default scaling
        if hasattr(m, "scaling"):
            m.scaling = get_patch("qwen2").attention_modules(ref)[0].scaling
    assert model.config._attn_implementation == "hf_ring"
    torch.testing.assert_close(_logits(model, input_ids=_ids()), _logits(ref, input_ids=_ids()), atol=ATOL, rtol=0)
    # loaded as "hf_ring", the model has no other implementation to restore: revert falls back to sdpa
    hf_ring.apply_ring_attention(model)
    hf_ring.revert_ring_attention(model)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(_logits(model, input_ids=_ids()), _logits(ref, input_ids=_ids()), atol=1e-6, rtol=0)


def test_peft_model_is_patched_through_its_base_model():
    from peft import LoraConfig, get_peft_model

    model = make_model("mistral")
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.eval()
    before = _logits(peft_model, input_ids=_ids())
    assert hf_ring.apply_ring_attention(peft_model) is peft_model
    assert model.config._attn_implementation == "hf_ring"
    torch.testing.assert_close(_logits(peft_model, input_ids=_ids()), before, atol=ATOL, rtol=0)
    assert hf_ring.revert_ring_attention(peft_model) is peft_model
    assert torch.equal(_logits(peft_model, input_ids=_ids()), before)


# --------------------------------------------------------------------------- Transformers conventions, one rank


def _compare_with_unmodified(family, **kw):
    model = make_model(family).eval()
    ref = _logits(model, **kw)
    hf_ring.apply_ring_attention(model)
    try:
        return _logits(model, **kw), ref
    finally:
        hf_ring.revert_ring_attention(model)


@pytest.mark.parametrize("family", ["qwen3", "llama4_text", "gpt_bigcode", "dory"])
@pytest.mark.parametrize("positional", [False, True])
def test_packed_position_ids_without_shard_batch_match_unmodified_model(family, positional):
    """Qwen3's layers pass position_ids to the attention; Llama 4's, StarCoder 1's and Dory's do not, and the
    attention reads the model's (``ring_position_ids``), also when given positionally. Llama 4: 5.17 counts the
    chunks of a packed row by the row index."""
    if not in_transformers(family) or (family == "llama4_text" and not transformers_at_least("5.24")):
        pytest.skip("not in this Transformers release, or (Llama 4 on 5.17) chunks a packed row by its index")
    batch, _ = make_batch("packed", 40)
    ids, pos = batch["input_ids"], batch["position_ids"]
    if positional:  # input_ids, ..., position_ids given by position (None between them)
        import inspect

        model = make_model(family).eval()
        ref = _logits(model, input_ids=ids, position_ids=pos)
        names = list(inspect.signature(type(model).forward).parameters)[1:]
        args = [ids, *[None] * (names.index("position_ids") - 1), pos]
        hf_ring.apply_ring_attention(model)
        with torch.no_grad():
            ring = model(*args).logits
    else:
        ring, ref = _compare_with_unmodified(family, input_ids=ids, position_ids=pos)
    torch.testing.assert_close(ring, ref, atol=ATOL, rtol=0)


def test_padding_mask_without_shard_batch_matches_unmodified_model_on_real_tokens():
    batch, _ = make_batch("padded", 40)
    mask = batch["attention_mask"]
    ring, ref = _compare_with_unmodified("mistral", input_ids=batch["input_ids"], attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ring[real], ref[real], atol=ATOL, rtol=0)


def test_flash_attention_packing_kwargs_are_honoured():
    from transformers import DataCollatorWithFlattening

    feats = [{"input_ids": _ids(seed=s, shape=(n,)).tolist()} for s, n in ((1, 9), (2, 17), (3, 6))]
    flat = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True, return_seq_idx=True)(feats)
    ids, pos = flat["input_ids"], flat["position_ids"]
    model = make_model("llama").eval()
    ref = _logits(model, input_ids=ids, position_ids=pos)
    hf_ring.apply_ring_attention(model)
    # positions alone would look like one document: the packing must come from cu_seq_lens / seq_idx
    plain = torch.arange(ids.shape[1])[None]
    cu = {k: flat[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    out_cu = _logits(model, input_ids=ids, position_ids=pos, **cu)
    out_idx = _logits(model, input_ids=ids, position_ids=pos, seq_idx=flat["seq_idx"])
    with torch.no_grad():
        cross = model(input_ids=ids, position_ids=plain).logits  # one long document: differs
    hf_ring.revert_ring_attention(model)
    torch.testing.assert_close(out_cu, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(out_idx, ref, atol=ATOL, rtol=0)
    assert not torch.allclose(cross, ref, atol=1e-3)


def test_one_rank_packing_kwargs_and_padding_mask_are_combined():
    from transformers import DataCollatorWithFlattening

    feats = [{"input_ids": _ids(seed=s, shape=(n,)).tolist()} for s, n in ((1, 9), (2, 17), (3, 6))]
    flat = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True, return_seq_idx=True)(feats)
    ids, pos = flat["input_ids"], flat["position_ids"]
    mask = torch.ones_like(ids)
    mask[0, 9:13] = 0  # the second document is left-padded
    model = make_model("llama").eval()
    hf_ring.apply_ring_attention(model)
    # reference: shard_batch (one rank) turns restarting positions + mask into document ids
    want = _logits(model, **hf_ring.shard_batch({"input_ids": ids, "position_ids": pos, "attention_mask": mask}))
    cu = {k: flat[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k")}
    by_cu = _logits(model, input_ids=ids, position_ids=pos, attention_mask=mask, **cu)
    by_idx = _logits(model, input_ids=ids, position_ids=pos, attention_mask=mask, seq_idx=flat["seq_idx"])
    no_mask = _logits(model, input_ids=ids, position_ids=pos, **cu)  # the pads are attended to
    hf_ring.revert_ring_attention(model)
    real = mask.bool()
    torch.testing.assert_close(by_cu[real], want[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(by_idx[real], want[real], atol=ATOL, rtol=0)
    assert not torch.allclose(no_mask[real], want[real], atol=1e-3)


def test_shard_batch_one_rank_loss_matches_unmodified_model():
    batch, ref_batch = make_batch("padded", 37)
    model = make_model("qwen2")
    ref = model(**ref_batch).loss
    hf_ring.apply_ring_attention(model)
    local = hf_ring.shard_batch(batch)
    loss = model(**local).loss
    hf_ring.revert_ring_attention(model)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(hf_ring.reduce_loss(loss), loss.detach())


# --------------------------------------------------------------------------- shard_batch, one rank


def test_shard_batch_shifts_labels_counts_targets_and_marks_documents():
    ids = torch.arange(1, 9)[None]
    labels = torch.tensor([[-100, 2, 3, -100, 5, 6, 7, 8]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    local = hf_ring.shard_batch({"input_ids": ids, "labels": labels, "position_ids": pos})
    assert torch.equal(local["shift_labels"], torch.tensor([[2, 3, -100, 5, 6, 7, 8, -100]]))
    assert int(local["num_items_in_batch"]) == 6
    assert torch.equal(local["ring_document_ids"], torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]], dtype=torch.int32))
    assert torch.equal(local["position_ids"], pos)

    plain = hf_ring.shard_batch({"input_ids": ids})
    assert set(plain) == {"input_ids", "position_ids", "use_cache", "ring_document_ids", "ring_shard_info"}
    assert plain["ring_document_ids"] is None
    # (numbered: shard_batch gave the positions, which OPT's patch may renumber from the mask; not when the batch did)
    assert plain["ring_shard_info"] == hf_attention.ShardInfo(
        layout="zigzag", world_size=1, rank=0, seq_len=8, numbered=True
    )
    assert not local["ring_shard_info"].numbered
    assert torch.equal(plain["position_ids"], torch.arange(8)[None])

    # cu_seq_lens alone (no position_ids) gives the same documents and per-document positions
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    from_cu = hf_ring.shard_batch({"input_ids": ids, "labels": labels, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    assert torch.equal(from_cu["position_ids"], pos)
    assert torch.equal(from_cu["ring_document_ids"], local["ring_document_ids"])
    assert "cu_seq_lens_q" not in from_cu

    # a target is dropped when the predicting or the predicted token is padding
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0]])
    padded = hf_ring.shard_batch({"input_ids": ids, "labels": ids.clone(), "attention_mask": mask})
    assert torch.equal(padded["shift_labels"], torch.tensor([[-100, 3, 4, 5, 6, -100, -100, -100]]))
    assert torch.equal(padded["ring_document_ids"], torch.tensor([[-1, 0, 0, 0, 0, 0, -1, -1]], dtype=torch.int32))
    assert "attention_mask" not in padded


# --------------------------------------------------------------------------- error paths


class _Wrapper(torch.nn.Module):  # what DDP / FSDP / accelerator.prepare hand back: the model as .module
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_apply_errors():
    from hf_ring.patches import apply_ring_attention_to_mistral, revert_ring_attention_from_llama
    from transformers import XGLMConfig, XGLMForCausalLM

    with pytest.raises(TypeError, match="PreTrainedModel or a peft PeftModel"):
        hf_ring.apply_ring_attention(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="_Wrapper.*apply before wrapping, or pass model.module"):
        hf_ring.apply_ring_attention(_Wrapper(make_model("llama")))
    xglm = XGLMForCausalLM(XGLMConfig(num_layers=1, d_model=16, attention_heads=2, ffn_dim=32, vocab_size=VOCAB))
    with pytest.raises(
        ValueError, match="model type 'xglm'; supported model types: afmoe, apertus, .*, starcoder2, .*vaultgemma"
    ):
        hf_ring.apply_ring_attention(xglm)
    with pytest.raises(ValueError, match="model type 'xglm'"):
        hf_ring.revert_ring_attention(xglm)
    llama = make_model("llama")
    with pytest.raises(ValueError, match="covers model types \\['mistral'\\], not 'llama'"):
        apply_ring_attention_to_mistral(model=llama)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        revert_ring_attention_from_llama(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no ring attention to revert"):
        hf_ring.revert_ring_attention(llama)
    with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
        hf_ring.apply_ring_attention(llama, layout="diagonal")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        hf_ring.apply_ring_attention(llama, backend="cuda")
    with pytest.raises(ValueError, match="not initialised"):
        hf_ring.apply_ring_attention(llama, group=object())
    assert llama.config._attn_implementation != "hf_ring"  # nothing was switched by a failed call
    hf_ring.apply_ring_attention(llama)
    hf_ring.revert_ring_attention(llama)
    with pytest.raises(ValueError, match="reverted already"):
        hf_ring.revert_ring_attention(llama)


def test_family_patch_errors(monkeypatch):
    from hf_ring.patches import FamilyPatch

    llama = make_model("llama")
    wrong = FamilyPatch("llama", ("llama",), "transformers.models.mistral.modeling_mistral.MistralAttention")
    with pytest.raises(ValueError, match="found no MistralAttention module in LlamaForCausalLM"):
        wrong.apply(llama, hf_attention.RingConfig())
    monkeypatch.setattr(llama, "set_attn_implementation", lambda *args, **kwargs: None)  # ignores the switch
    with pytest.raises(ValueError, match="did not accept attn_implementation='hf_ring'"):
        hf_ring.apply_ring_attention(llama)
    assert llama.config._attn_implementation != "hf_ring"
    assert not any(hasattr(m, hf_attention.CONFIG_ATTR) for m in llama.modules())


def test_the_router_loss_function_is_hf_rings_only_inside_a_patched_models_forward():
    """While a model is patched its family's load-balancing function is hf_ring's within its forward (the parity
    cases check its loss of the whole sequence): an unpatched model of the same family, or the model reverted, still
    gets its own loss; a deep copy of a patched model keeps its scope hooks, revert removes them; a
    function computing another formula is not taken (a family with one is refused)."""
    import copy

    import transformers.models.mixtral.modeling_mixtral as modeling
    from hf_ring.patches import _router

    own = getattr(modeling.load_balancing_loss_func, "original", modeling.load_balancing_loss_func)  # (patched before)
    patched = make_model("mixtral", output_router_logits=True, router_aux_loss_coef=1.0)
    other = make_model("mixtral", seed=1, output_router_logits=True, router_aux_loss_coef=1.0)
    ids = _ids(shape=(2, 40))
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0  # (right padding: no target is predicted from padding)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = [m(input_ids=ids, attention_mask=mask, labels=labels).loss for m in (patched, other)]
        hf_ring.apply_ring_attention(patched)
        hf_ring.apply_ring_attention(patched)  # again: one replacement, undone by one revert
        assert modeling.load_balancing_loss_func.original is own
        assert torch.equal(other(input_ids=ids, attention_mask=mask, labels=labels).loss, ref[1])
        local = hf_ring.shard_batch({"input_ids": ids, "attention_mask": mask, "labels": labels})
        for m in (patched, copy.deepcopy(patched)):
            assert abs(float(m(**local).loss - ref[0])) <= 1e-5
            hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
            assert sum(isinstance(getattr(h, "__self__", None), _router._Scoper) for h in hooks) == 2
            hf_ring.revert_ring_attention(m)
            hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
            assert not any(isinstance(getattr(h, "__self__", None), _router._Scoper) for h in hooks)
            assert torch.equal(m(input_ids=ids, attention_mask=mask, labels=labels).loss, ref[0])
    assert not _router._agrees(lambda gate_logits, num_experts=None, top_k=2, attention_mask=None: 0.5)


@pytest.mark.parametrize(
    "family, attr, value, match",
    [
        ("mistral", "sliding_window", 0, "sliding_window must be None or a positive integer"),
        ("qwen2", "layer_types", ["full_attention", "chunked_attention", "full_attention"], "chunked_attention"),
        ("qwen3", "sliding_window", None, "sliding_attention layers but config.sliding_window is None"),
        ("qwen2_moe", "layer_types", ["sliding_attention", "full_attention"], "does not pass its window"),
        ("deepseek_v3", "output_router_logits", True, "computes none, or another"),
        ("olmoe", "sliding_window", 8, "given to the attention but not to the model's mask"),
        ("bamba", "z_loss_coefficient", 1e-4, "z-loss"),
        ("gpt2", "add_cross_attention", True, "add_cross_attention=True"),
        ("nemotron_h", "layer_types", ["linear_attention", "sliding_attention", "moe"], "sliding_attention"),
        ("llama4_text", "attention_chunk_size", 0, "positive config.attention_chunk_size"),
        ("llama4_text", "layer_types", ["sliding_attention"] * 4, r"\['sliding_attention'\] are not supported"),
        ("gpt_neo", "attention_layers", ["global", "sparse"], r"attention layer types \['sparse'\]"),
        ("gpt_neo", "window_size", 0, "window_size must be a positive integer"),
    ],
)
def test_unsupported_config_errors(family, attr, value, match):
    model = make_model(family)
    setattr(model.config, attr, value)
    with pytest.raises(ValueError, match=match):
        hf_ring.apply_ring_attention(model)
    assert model.config._attn_implementation != "hf_ring"


@pytest.mark.parametrize("family, rope", [("phi3", LONGROPE), ("llama", DYNAMIC), ("gemma3_text", DYNAMIC_FULL_LAYERS)])
def test_position_dependent_rope_is_wrapped_while_patched(family, rope):
    """dynamic / longrope rotary modules get a forward that takes the CP group's largest position (one rank here:
    the same numbers as the unmodified model); revert removes it; deep copies keep their own module's."""
    import copy
    import pickle

    from hf_ring.patches import _rope

    model = make_model(family, **rope)
    ids = _ids(shape=(2, 40))
    want = model(input_ids=ids).logits
    hf_ring.apply_ring_attention(model)
    wrapped = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), _rope.UnshardedPositions)]
    assert len(wrapped) == 1 and wrapped[0].forward.module is wrapped[0]
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    twin = copy.deepcopy(model)
    twin_rotary = [m for m in twin.modules() if isinstance(m.__dict__.get("forward"), _rope.UnshardedPositions)]
    assert len(twin_rotary) == 1 and twin_rotary[0].forward.module is twin_rotary[0]
    torch.testing.assert_close(twin(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    loaded = pickle.loads(pickle.dumps(model))
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    hf_ring.revert_ring_attention(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)


def test_position_dependent_rope_without_transformers_decorator_is_refused(monkeypatch):
    """A rotary module that picks its frequencies some other way cannot be given the whole sequence's largest
    position: refused, nothing switched."""
    from transformers.models.llama import modeling_llama

    model = make_model("llama", **DYNAMIC)
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", lambda self, x, position_ids: None)
    with pytest.raises(ValueError, match="rope_type='dynamic' picks its frequencies"):
        hf_ring.apply_ring_attention(model)
    assert model.config._attn_implementation != "hf_ring"


def test_a_layer_called_without_the_batchs_documents_raises_and_an_interrupted_forward_leaves_no_trace():
    """Nemotron's decoder layers drop the model's keywords; without the hooks by which they lend them to their
    attention, padding (document ids) or packing keywords given to the model never reach its attention, which
    raises; a forward interrupted before any layer (KeyboardInterrupt skips the model's closing hook) does not make
    the next, plain one raise."""
    from transformers import DataCollatorWithFlattening

    model = hf_ring.apply_ring_attention(make_model("nemotron"))
    _lend.remove(model)
    padded = hf_ring.shard_batch(
        {"input_ids": _ids(shape=(2, 16)), "attention_mask": torch.tensor([[0] * 3 + [1] * 13, [1] * 16])}
    )
    with pytest.raises(ValueError, match="NemotronAttention was called without them"):
        model(**padded)
    feats = [{"input_ids": _ids(shape=(1, n))[0].tolist()} for n in (5, 11)]
    packed = dict(DataCollatorWithFlattening(return_tensors="pt")(feats))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="NemotronAttention was called without them"):
        model(input_ids=packed["input_ids"], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11, max_length_k=11)

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.model.embed_tokens.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(**padded)
    handle.remove()
    assert torch.isfinite(model(input_ids=_ids(shape=(2, 16))).logits).all()


def test_forward_errors():
    model = make_model("llama")
    model.set_attn_implementation("eager")
    model.config.output_attentions = True  # Transformers allows this for eager only; apply keeps it
    hf_ring.apply_ring_attention(model)
    ids = _ids()
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(input_ids=ids)
    model.config.output_attentions = False
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(input_ids=ids, output_attentions=True)
    for m in get_patch("llama").attention_modules(model):
        m.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention dropout 0.1 is not supported"):
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids)  # no dropout in eval mode
    out = model(input_ids=ids, use_cache=True)  # prefill: as many keys as queries
    with pytest.raises(ValueError, match="KV cache of its own is not supported.*hf_ring.ring_generate"):
        model(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    mask4d = torch.zeros(2, 1, ids.shape[1], ids.shape[1])
    with pytest.raises(ValueError, match="no 4-D or block attention mask"):
        model(input_ids=ids, attention_mask=mask4d)
    with pytest.raises(ValueError, match="cu_seq_lens_q == cu_seq_lens_k"):
        model(input_ids=ids[:1], cu_seq_lens_q=torch.tensor([0, 21]), cu_seq_lens_k=torch.tensor([0, 20, 21]))
    with pytest.raises(ValueError, match="cu_seq_lens_q == cu_seq_lens_k"):
        model(input_ids=ids[:1], cu_seq_lens_q=[0, 21], cu_seq_lens_k=[0, 21])
    with pytest.raises(ValueError, match="seq_idx must give the document"):
        model(input_ids=ids[:1], seq_idx=torch.zeros(1, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_idx must give the document"):
        model(input_ids=ids[:1], seq_idx=[[0] * 21])
    local = hf_ring.shard_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids).tril(12)})  # padded
    with pytest.raises(ValueError, match="attention_mask cannot be passed"):
        model(**local, attention_mask=torch.ones_like(ids))
    # shard_batch's ShardInfo must fit the model's settings (one rank: layouts are still compared)
    with pytest.raises(ValueError, match="layout='striped' but the model's ring attention uses layout='zigzag'"):
        model(**hf_ring.shard_batch({"input_ids": ids}, layout="striped"))
    cut = {
        k: v[:, :-1] if k in ("input_ids", "position_ids") else v
        for k, v in hf_ring.shard_batch({"input_ids": ids}).items()
    }
    with pytest.raises(ValueError, match="shard has 20 tokens but shard_batch cut 21 tokens"):
        model(**cut)
    with pytest.raises(ValueError, match="must be the ShardInfo"):
        model(input_ids=ids, ring_shard_info=("zigzag", 1, 0, 21))
    hf_ring.revert_ring_attention(model)


def test_ring_config_copies_share_the_group_and_pickling_drops_it_with_a_warning():
    import copy
    import pickle
    import warnings

    cfg = hf_attention.RingConfig(layout="striped", backend="torch")
    assert copy.deepcopy(cfg) is cfg and copy.copy(cfg) is cfg
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no group, nothing dropped, no warning
        assert pickle.loads(pickle.dumps(cfg)) == cfg
    model = hf_ring.apply_ring_attention(make_model("llama"), layout="striped")
    twin = copy.deepcopy(model)  # e.g. TRL's create_reference_model; with a group: test_hf_parity's spawn
    mine, its = (getattr(get_patch("llama").attention_modules(m)[0], hf_attention.CONFIG_ATTR) for m in (model, twin))
    assert its is mine


def test_ring_config_pickles_keep_the_hybrid_flag_and_load_from_the_names_they_were_written_under():
    """A hybrid model's config keeps ``mixers`` through pickling (its refusal of position-only packing); a pickle
    written when ``RingConfig`` and ``_Dropped`` lived in ``hf_ring.hf_attention`` (a dropped group) still loads."""
    import pickle
    import warnings

    from hf_ring import ring_config

    assert pickle.loads(pickle.dumps(hf_attention.RingConfig(mixers=True))).mixers
    dropped = ring_config.RingConfig(layout="striped")
    dropped = pickle.loads(pickle.dumps(dropped))
    old = {cls: cls.__module__ for cls in (ring_config.RingConfig, ring_config._Dropped)}
    try:
        for cls in old:  # written as the previous release wrote them
            cls.__module__ = "hf_ring.hf_attention"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = pickle.dumps(dataclasses.replace(dropped, group=ring_config._Dropped.GROUP))
    finally:
        for cls, module in old.items():
            cls.__module__ = module
    assert b"hf_ring.hf_attention" in data and b"_Dropped" in data
    loaded = pickle.loads(data)
    assert loaded.layout == "striped" and hf_attention.lost_group(loaded)


@pytest.mark.parametrize(
    "batch, kwargs, exc, match",
    [
        ([1, 2], {}, TypeError, "dict of tensors"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "pixel_values": 1}, {}, ValueError, "pixel_values"),
        ({"labels": torch.ones(1, 4, dtype=torch.long)}, {}, ValueError, "needs input_ids"),
        ({"input_ids": torch.ones(4, dtype=torch.long)}, {}, ValueError, "needs input_ids"),
        ({"input_ids": torch.ones(1, 0, dtype=torch.long)}, {}, ValueError, "empty"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 3)}, {}, ValueError, "labels must"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}, {}, ValueError,
         "attention_mask must"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.long), "position_ids": torch.ones(3, 4)}, {}, ValueError,
         "position_ids must"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.ones(1, 5)}, {}, ValueError,
         "position_ids must"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 3])}, {}, ValueError,
         "rise from 0 to seq_len 4"),
        ({"input_ids": torch.ones(2, 4, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 4])}, {}, ValueError,
         "batch of one packed row"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "seq_idx": torch.zeros(1, 4)}, {}, ValueError,
         "also needs position_ids"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": [[0, 1, 2, 3]]}, {}, ValueError,
         "position_ids must be a tensor"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long), "cu_seq_lens_q": [0, 4]}, {}, ValueError,
         "cu_seq_lens_q must be an integer tensor"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long)}, {"layout": "diagonal"}, ValueError, "unknown layout"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long)}, {"group": object()}, ValueError, "not initialised"),
    ],
)  # fmt: skip
def test_shard_batch_errors(batch, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        hf_ring.shard_batch(batch, **kwargs)


@pytest.mark.parametrize("model_type", [t for t in sorted(REGISTRY) if in_transformers(t)])
def test_plugin_prepares_every_supported_family(model_type):
    """plugin.prepare (one process) takes every family of the registry; its DataLoader's shards give the
    unmodified model's loss (the multi-rank parity of each family is in test_hf_parity.py)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hf_ring.accelerate import RingAttentionPlugin
    from tests.train_utils import collate

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(1, VOCAB, (2, 21), generator=g)]
    data = [with_token_types(model_type, d) for d in data]  # (Molmo2 requires its token types in training)
    ref = make_model(model_type)
    with torch.no_grad():
        want = ref(**collate(data)).loss
    accelerator = Accelerator(cpu=True)
    try:
        model, dl = RingAttentionPlugin(cp_size=1).prepare(
            accelerator, make_model(model_type), torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)
        )
        switched = model.config.get_text_config()._attn_implementation == "hf_ring"
        assert switched or get_patch(model_type).attention_class is None  # (Mamba2: its mixers only)
        with torch.no_grad():
            got = model(**next(iter(dl))).loss
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert float((got - want).abs() / want.abs()) < 1e-5


def test_ulysses_size_is_checked_before_any_collective_and_auto_follows_its_rule():
    from hf_ring.comm import auto_ulysses_size

    model = make_model("llama")  # 4 query heads, one process
    with pytest.raises(ValueError, match="ulysses_size=3 does not divide the model's 4 query heads"):
        hf_ring.apply_ring_attention(model, ulysses_size=3)
    with pytest.raises(ValueError, match="ulysses_size=2 does not divide the context-parallel group's 1 ranks"):
        hf_ring.apply_ring_attention(model, ulysses_size=2)
    with pytest.raises(ValueError, match="ulysses_size must be None, 'auto' or a positive int"):
        hf_ring.apply_ring_attention(model, ulysses_size="two")
    hf_ring.apply_ring_attention(model, ulysses_size="auto")  # one rank: U = 1, the pure ring
    assert all(m.hf_ring_config.ulysses is None for m in model.modules() if hasattr(m, "hf_ring_config"))
    hf_ring.revert_ring_attention(model)
    # the largest U dividing the CP size and the query heads, inside one node
    assert auto_ulysses_size(8, 32, local_world_size=8) == 8
    assert auto_ulysses_size(8, 12, local_world_size=8) == 4  # 12 heads: 8 does not divide them
    assert auto_ulysses_size(16, 32, local_world_size=8) == 8  # 8 GPUs per node: never across nodes
    assert auto_ulysses_size(4, 28, local_world_size=8) == 4
    assert auto_ulysses_size(6, 9, local_world_size=6) == 3
    assert auto_ulysses_size(4, 5, local_world_size=4) == 1  # no common divisor: the pure ring


def test_shard_batch_shards_a_text_batchs_token_types_as_input_ids():
    """A vision-language processor's text-only batch carries its token types (all zeros): sharded (and padded) as
    input_ids, so the model gets them with its shard; the logits of Qwen2-VL on such a batch are the unpatched ones."""
    model = make_model("qwen2_vl", images=True).eval()
    batch, _ = make_batch("plain", 45)
    batch["mm_token_type_ids"] = torch.zeros_like(batch["input_ids"])
    before = _logits(model, **batch)
    hf_ring.apply_ring_attention(model)
    local = hf_ring.shard_batch(batch)
    assert local["mm_token_type_ids"].shape == local["input_ids"].shape
    torch.testing.assert_close(_logits(model, **local)[:, :45], before, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="mm_token_type_ids must have the shape of input_ids"):
        hf_ring.shard_batch({**batch, "mm_token_type_ids": batch["mm_token_type_ids"][:, 1:]})


def test_a_config_with_sub_configs_of_its_own_switches_without_a_warning():
    """DBRX's config holds attention and FFN sub-configs that are parts of it, not sub-models: switching to hf_ring
    (and back) leaves them as they were, without Transformers' warning about a sub-config without a sub-model."""
    import logging

    model = make_model("dbrx")
    seen = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = seen.append
    log = logging.getLogger("transformers.modeling_utils")
    log.addHandler(handler)
    try:
        hf_ring.apply_ring_attention(model)
        hf_ring.revert_ring_attention(model)
    finally:
        log.removeHandler(handler)
    assert not [r.getMessage() for r in seen if "sub-config" in r.getMessage()]
    assert (
        model.config.attn_config._attn_implementation is None and model.config.ffn_config._attn_implementation is None
    )


def _padded_and_plain() -> tuple:
    """``(padded, plain, keep)``: one-rank model inputs of a padded batch with its padding mask and without it, and
    the mask of its real tokens."""
    batch, _ = make_batch("padded", 40)
    padded = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    return padded, {"input_ids": batch["input_ids"]}, padded["attention_mask"].bool()


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4_unified_text", "gemma3n_text"])
def test_one_rank_through_kv_shared_layers_with_a_padding_mask_or_a_count_of_logits(family):
    """One process: Gemma 4's text model (5.24) cuts its inputs to the kept rows before its KV-shared layers when
    ``logits_to_keep`` is a count, indexing its masks as 4-D (hf_ring's is a 2-D padding mask here: an IndexError
    unpatched, measured) and leaving fewer queries than keys (which the ring refused). Patched, it computes every
    row: the real tokens' logits, with a padding mask or not and with ``logits_to_keep=1`` (generate's prefill), are
    the unmodified model's (fp32: the ring's order of summation, ~1e-7). Gemma 3n has no such cut (a control)."""
    if not in_transformers(family):
        pytest.skip(f"{family} is not in this Transformers release")
    from hf_ring.patches import _shared_kv

    model = make_model(family).eval()
    padded, plain, keep = _padded_and_plain()
    last = keep[:, -1]  # (rows whose last token is padding: nothing to compare)
    calls = [(padded, 0), (padded, 1), (plain, 1)]
    with torch.no_grad():
        ref = [model(**inputs, logits_to_keep=n).logits for inputs, n in calls]
        hf_ring.apply_ring_attention(model)
        cuts = [m for m in model.modules() if hasattr(type(m), _shared_kv.ATTR)]
        assert all(_shared_kv.ATTR in vars(m) for m in cuts)
        got = [model(**inputs, logits_to_keep=n).logits for inputs, n in calls]
    rows = [keep, last[:, None], torch.ones_like(last)[:, None]]
    for r, g, k in zip(ref, got, rows, strict=True):
        assert g.shape == r.shape and float((g - r)[k].norm() / r[k].norm()) <= 1e-5
    hf_ring.revert_ring_attention(model)
    assert not any(_shared_kv.ATTR in vars(m) for m in model.modules())


@pytest.mark.parametrize(
    "family", ["deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "mistral_large4", "hy_v4_vl", "dots3_note_text"]
)
def test_sparse_attention_takes_its_indexers_top_k_in_the_attention_function_and_reverts(family, monkeypatch):
    """DeepSeek sparse attention at one rank: each indexer's call is deferred to hf_ring's attention function
    (``patches._sparse``), which takes the top-k over the whole sequence (``hf_ring.sparse.select``). The logits
    are the unmodified model's (SDPA's mask) with a padding mask or not, and with the indexer's scores in chunks
    of one query (``CHUNK_BYTES``); a layer reusing an earlier layer's top-k (GLM-MoE-DSA's, HunYuan V4's and
    Mistral Large 4's "shared") has it computed once. Mistral Large 4's indexer takes no query latent and scales
    its queries by their positions, each chunk's own. The selection matters: every key visible changes the logits (a control).
    Revert restores the indexers and the masks. Top-k indices that are not hf_ring's deferred call (a rank's own)
    are refused."""
    from hf_ring.patches._sparse import DeferIndexer, WrapMask

    from hf_ring import sparse

    if not in_transformers(family):
        pytest.skip(f"{family} is not in this Transformers release")
    model = make_model(family).eval()
    padded, plain, keep = _padded_and_plain()
    with torch.no_grad():
        ref = [model(**inputs).logits for inputs in (plain, padded)]
    layers = model.get_decoder().layers
    indexers = [m.self_attn.indexer for m in layers if m.self_attn.indexer is not None]
    # (GLM-MoE-DSA's and HunYuan V4's layer 1 reuses layer 0's top-k; Mistral Large 4's layer 2 layer 1's)
    # (Dots3 Note's layer 1 is a sliding-window layer without one)
    assert len(indexers) == {
        "glm_moe_dsa": 1,
        "hy_v4": 1,
        "hy_v4_vl": 1,
        "mistral_large4": 3,
        "dots3_note_text": 1,
    }.get(family, 2)
    hf_ring.apply_ring_attention(model)
    hf_ring.apply_ring_attention(model)  # again: nothing doubled
    assert all(isinstance(vars(i).get("forward"), DeferIndexer) for i in indexers)
    hooks = [sum(isinstance(h, WrapMask) for h in m.self_attn._forward_pre_hooks.values()) for m in layers]
    assert hooks == [1] * len(layers)
    runs = []
    real_run = sparse.IndexerCall.run
    monkeypatch.setattr(sparse.IndexerCall, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    with torch.no_grad():
        got = [model(**inputs).logits for inputs in (plain, padded)]
        assert len(runs) == 2 * 2 * len(indexers)  # per indexer: its keys, then its one chunk of queries
        monkeypatch.setattr(sparse, "CHUNK_BYTES", 1)  # one query per chunk
        chunked = model(**plain).logits
    for r, g, k in zip(ref, got, (torch.ones_like(keep), keep), strict=True):
        assert float((g - r)[k].norm() / r[k].norm()) <= 1e-5
    assert float((chunked - ref[0]).norm() / ref[0].norm()) <= 1e-5
    hf_ring.revert_ring_attention(model)
    assert not any(isinstance(vars(m).get("forward"), DeferIndexer) for m in model.modules())
    assert not any(isinstance(h, WrapMask) for m in model.modules() for h in m._forward_pre_hooks.values())
    with torch.no_grad():
        assert torch.equal(model(**plain).logits, ref[0])
        for i in indexers:
            i.index_topk = 1000
        assert float((model(**plain).logits - ref[0]).norm() / ref[0].norm()) > 1e-2
        for i in indexers:
            i.index_topk = model.config.get_text_config().index_topk
    q = torch.randn(1, 2, 8, 8)  # indices from an indexer hf_ring did not defer: its own rank's top-k, refused
    attention = layers[0].self_attn
    with pytest.raises(ValueError, match="apply_ring_attention"):
        hf_attention.ring_attention_forward(attention, q, q, q, None, indices=torch.zeros(1, 8, 2, dtype=torch.int32))


def test_qwen4_exp_picks_the_blocks_its_own_indexer_picks_and_reverts(monkeypatch):
    """Qwen4-Exp's QSA indexer at one rank: each query's keys (the best 2 of its document's complete blocks of 4
    visible tokens, and the incomplete block it stands in) are the set the unmodified indexer gives, with a padding
    mask (left and right), packed documents (restarting positions; attention layers only, as a packed batch reaches
    Gated DeltaNet layers only with cu_seq_lens) or neither, and with its scores in chunks of one query; the logits
    are the unmodified model's. The selection matters: every block picked changes the logits (a control). Revert
    restores the indexer, the per-layer embedding and the hooks."""
    from hf_ring.patches._lend import LendKeywords
    from hf_ring.patches._sparse import DeferIndexer
    from hf_ring.patches.linear import ShardedPLE

    from hf_ring import sparse

    if not in_transformers("qwen4_exp_text"):
        pytest.skip("Qwen4-Exp is not in this Transformers release")
    model = make_model("qwen4_exp_text").eval()
    attention_only = make_model("qwen4_exp_text", layer_types=["indexed_attention"] * 2, ple_layer_ids=[]).eval()
    padded, plain, keep = _padded_and_plain()
    packed = {
        "input_ids": plain["input_ids"][:1],
        "position_ids": torch.cat([torch.arange(n) for n in (9, 17, 14)])[None],
    }
    indexer = model.model.layers[1].self_attn.indexer
    calls = ((model, plain), (model, padded), (attention_only, packed))
    theirs, ours, ref, got = _selections(calls, monkeypatch)
    assert isinstance(vars(indexer).get("forward"), DeferIndexer)
    assert isinstance(vars(model.model.layers[0].ple).get("forward"), ShardedPLE)
    with torch.no_grad():
        monkeypatch.setattr(sparse, "CHUNK_BYTES", 1)  # one query per chunk
        chunked = model(**plain).logits
    rows = (torch.ones_like(keep), keep, torch.ones_like(keep[:1]))
    for r, g, k in zip(ref, got, rows, strict=True):
        assert float((g - r)[k].norm() / r[k].norm()) <= 1e-5
    assert float((chunked - ref[0]).norm() / ref[0].norm()) <= 1e-5
    assert len(theirs) == len(ours) == 4  # (the packed batch through two indexers)
    for want, picked, k in zip(theirs, ours, (*rows, rows[-1]), strict=True):  # the same keys, for every real query
        assert torch.equal(_chosen(picked)[k], want[k])
        assert int(want[k].sum(-1).max()) == 2 * 4 + 3  # (the budget reached: the selection bites)
    hf_ring.revert_ring_attention(model)
    assert not any(isinstance(vars(m).get("forward"), (DeferIndexer, ShardedPLE)) for m in model.modules())
    assert not any(isinstance(h, LendKeywords) for m in model.modules() for h in m._forward_pre_hooks.values())
    with torch.no_grad():
        assert torch.equal(model(**plain).logits, ref[0])
        indexer.token_budget, indexer.block_topk = 40, 10  # (every block: measured 9.7e-3 apart)
        assert float((model(**plain).logits - ref[0]).norm() / ref[0].norm()) > 1e-3


def _selections(calls: tuple, monkeypatch) -> tuple:
    """``(the unpatched indexers' masks, hf_ring's selections, logits before, logits after)`` of Qwen4-Exp's indexed
    layers over ``calls`` (pairs of a model and its inputs), the models then patched."""
    from hf_ring import sparse

    models = list({id(m): m for m, _ in calls}.values())
    theirs, ours = [], []
    indexers = [getattr(getattr(layer, "self_attn", None), "indexer", None) for m in models for layer in m.model.layers]
    hooks = [i.register_forward_hook(lambda m, a, out: theirs.append(out[:, 0])) for i in indexers if i is not None]
    with torch.no_grad():
        ref = [m(**x).logits for m, x in calls]
    for h in hooks:
        h.remove()
    for m in models:
        hf_ring.apply_ring_attention(m)
    real = sparse._select_blocks
    monkeypatch.setattr(sparse, "_select_blocks", lambda *a, **k: ours.append(real(*a, **k)) or ours[-1])
    with torch.no_grad():
        got = [m(**x).logits for m, x in calls]
    monkeypatch.setattr(sparse, "_select_blocks", real)
    return theirs, ours, ref, got


def _chosen(picked: torch.Tensor) -> torch.Tensor:
    """hf_ring's selection (global positions, -1 none) as the indexer's mask: ``[batch, queries, keys]`` bool."""
    chosen = torch.zeros(*picked.shape[:2], picked.shape[1] + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(picked >= 0, picked, picked.shape[1]).long(), True)
    return chosen[..., :-1]


def test_qwen4_exp_breaks_ties_between_blocks_as_its_own_indexer_does(monkeypatch):
    """With 2 indexer heads many blocks score exactly 0 (the ReLU of both), and where fewer than the budget score
    above it, ``torch.topk`` picks among the tied ones by the row it is given: hf_ring gives each query's top-k its own
    candidates, as the model does (one top-k over every block of the row, the others hidden, picked other blocks:
    logits 3.6e-2 apart, measured). The same keys as the model's indexer for every real query, and its logits."""
    if not in_transformers("qwen4_exp_text"):
        pytest.skip("Qwen4-Exp is not in this Transformers release")
    padded, plain, keep = _padded_and_plain()
    for seed in range(3):
        model = make_model("qwen4_exp_text", seed=seed, indexer_n_heads=2).eval()
        theirs, ours, ref, got = _selections(((model, plain), (model, padded)), monkeypatch)
        for want, picked, r, g, k in zip(theirs, ours, ref, got, (torch.ones_like(keep), keep), strict=True):
            assert torch.equal(_chosen(picked)[k], want[k]), seed
            assert float((g - r)[k].norm() / r[k].norm()) <= 1e-5, seed


def test_glm5_next_picks_the_pools_its_own_indexer_picks_and_reverts(monkeypatch):
    """GLM-5.3-Flash's pooled indexer at one rank: each real query's keys (the best 2 of the complete pools of 4
    tokens counted from the row's first real token, and the query's own incomplete pool) are the set the unmodified
    indexer gives, with a padding mask (left and right) or without, and with its scores in chunks of one query (runs
    of one position: the model's code told where each chunk ends); the last layer reuses the second's picks. The
    logits are the unmodified model's, and the selection bites: every pool picked changes the logits (a control).
    Revert restores the indexers and the mask builders."""
    from hf_ring.patches._sparse import CarryCall, DeferIndexer

    from hf_ring import sparse

    if not in_transformers("glm5_next"):
        pytest.skip("GLM-5.3-Flash is not in this Transformers release")
    model = make_model("glm5_next").eval()
    padded, plain, keep = _padded_and_plain()
    layers = model.model.language_model.layers
    theirs, ours = [], []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, a, k, out: theirs.append(out), with_kwargs=True)
             for layer in layers if getattr(layer.self_attn, "indexer", None) is not None]  # fmt: skip
    with torch.no_grad():
        ref = [model(**x).logits for x in (plain, padded)]
    for h in hooks:
        h.remove()
    hf_ring.apply_ring_attention(model)
    assert isinstance(vars(layers[1].self_attn.indexer).get("forward"), DeferIndexer)
    assert isinstance(vars(layers[2].self_attn).get("build_attention_mask_from_topk"), CarryCall)
    real = sparse._select_pools
    monkeypatch.setattr(sparse, "_select_pools", lambda *a, **k: ours.append(real(*a, **k)) or ours[-1])
    with torch.no_grad():
        got = [model(**x).logits for x in (plain, padded)]
        monkeypatch.setattr(sparse, "CHUNK_BYTES", 1)  # one query per chunk
        chunked = model(**plain).logits
    rows = (torch.ones_like(keep), keep)
    for r, g, k in zip(ref, got, rows, strict=True):
        assert float((g - r)[k].norm() / r[k].norm()) <= 1e-5
    assert float((chunked - ref[0]).norm() / ref[0].norm()) <= 1e-5
    assert len(theirs) == 2 and len(ours) == 3  # (one indexer layer per forward: the third reuses the second's picks)
    for want, picked, k in zip(theirs, ours[:2], rows, strict=True):  # the same keys, for every real query
        assert torch.equal(_chosen(picked)[k], _chosen(want)[k])
        assert int(_chosen(want)[k].sum(-1).max()) == 2 * 4 + 3  # (the budget reached: the selection bites)
    assert torch.equal(ours[2], ours[0])  # (the chunked forward's)
    hf_ring.revert_ring_attention(model)
    assert not any(isinstance(vars(m).get("forward"), DeferIndexer) for m in model.modules())
    assert not any("build_attention_mask_from_topk" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**plain).logits, ref[0])
        layers[1].self_attn.indexer.index_topk = 40  # (every pool)
        assert float((model(**plain).logits - ref[0]).norm() / ref[0].norm()) > 1e-3


def test_hrm_text_refuses_prefix_token_types_and_runs_causally():
    """HRM-Text's ``token_type_ids`` under ``config.prefix_lm`` make the instruction tokens attend both ways, which hf_ring
    does not implement for it: refused by name before anything runs (by the keyword's presence, the same on every
    rank), also for a batch of type 0 only; without them, or with ``prefix_lm=False`` (the model ignores them), the
    logits are the unmodified model's. Unrefused, the ring would silently run them causally (a control: the
    unmodified model's logits move with them). Revert removes the refusal."""
    from hf_ring.patches._family import Refuse

    if not in_transformers("hrm_text"):
        pytest.skip("HRM-Text is not in this Transformers release")
    model = make_model("hrm_text").eval()
    padded, plain, keep = _padded_and_plain()
    types = torch.zeros_like(plain["input_ids"])
    types[:, :12] = 1
    with torch.no_grad():
        ref = model(**padded).logits
        prefix = model(**padded, token_type_ids=types).logits
    assert float((prefix - ref)[keep].norm() / ref[keep].norm()) > 1e-3
    hf_ring.apply_ring_attention(model)
    assert sum(isinstance(h, Refuse) for h in model.model._forward_pre_hooks.values()) == 1
    with torch.no_grad():
        for given in (types, torch.zeros_like(types)):
            with pytest.raises(ValueError, match="token_type_ids with config.prefix_lm=True"):
                model(**padded, token_type_ids=given)
        assert float((model(**padded).logits - ref)[keep].norm() / ref[keep].norm()) <= 1e-5
        model.config.prefix_lm = False
        assert float((model(**padded, token_type_ids=types).logits - ref)[keep].norm() / ref[keep].norm()) <= 1e-5
    hf_ring.revert_ring_attention(model)
    assert not any(isinstance(h, Refuse) for m in model.modules() for h in m._forward_pre_hooks.values())


def test_kolibri1_1_picks_the_keys_its_own_indexer_picks_and_reverts(monkeypatch):
    """Kolibri 1.1's indexed layers at one rank: layer 1 picks each query's pool (the best 4 blocks of 4 keys by their
    averages), every indexed layer keeps the best 4 keys of the pool beside 2 sink and 4 local ones; layer 2 reads
    layer 1's keys and values, layer 3 has its own keys and layer 1's pool. Each layer's keys per real query are the
    set the unmodified indexer gives, with a padding mask (left and right), packed documents (restarting positions)
    or neither, and with the pools and scores in chunks of one query (a later layer's pool computed again from its
    source's queries and keys); the logits are the unmodified model's. Both budgets bite (controls: a larger pool, a
    larger top-k, each changes the logits). Revert restores the indexers and the masks."""
    from hf_ring.patches._sparse import DeferMaskIndexer, WrapMask

    from hf_ring import sparse

    if not in_transformers("kolibri1_1"):
        pytest.skip("Kolibri 1.1 is not in this Transformers release")
    model = make_model("kolibri1_1").eval()
    padded, plain, keep = _padded_and_plain()
    packed = {
        "input_ids": plain["input_ids"][:1],
        "position_ids": torch.cat([torch.arange(n) for n in (9, 17, 14)])[None],
    }
    inputs = (plain, padded, packed)
    rows = (torch.ones_like(keep), keep, torch.ones_like(keep[:1]))
    layers = model.model.layers
    indexers = [layer.self_attn.indexer for layer in layers[1:]]
    assert layers[0].self_attn.indexer is None and [i.is_pool_source for i in indexers] == [True, False, False]
    theirs, ours = [], []
    hooks = [i.register_forward_hook(lambda m, a, out: theirs.append(out[0][:, 0])) for i in indexers]
    with torch.no_grad():
        ref = [model(**x).logits for x in inputs]
    for h in hooks:
        h.remove()
    hf_ring.apply_ring_attention(model)
    hf_ring.apply_ring_attention(model)  # again: nothing doubled
    assert all(isinstance(vars(i).get("forward"), DeferMaskIndexer) for i in indexers)
    assert [sum(isinstance(h, WrapMask) for h in m.self_attn._forward_pre_hooks.values()) for m in layers] == [1] * 4
    real = sparse._select_by_mask
    monkeypatch.setattr(sparse, "_select_by_mask", lambda *a, **k: ours.append(real(*a, **k)) or ours[-1])
    with torch.no_grad():
        got = [model(**x).logits for x in inputs]
        monkeypatch.setattr(sparse, "CHUNK_BYTES", 1)  # one query per chunk
        chunked = [model(**x).logits for x in inputs]
    assert len(theirs) == 9 and len(ours) == 18
    for i, (want, picked) in enumerate(zip(theirs, ours[:9], strict=True)):  # the same keys, for every real query
        k = rows[i // 3]
        assert torch.equal(_chosen(picked)[k], want[k]), i
        if i // 3 < 2:  # (one document of 40: the budget of 10 reached)
            assert int(want[k].sum(-1).max()) == 4 + 4 + 2, i
    assert all(torch.equal(a, b) for a, b in zip(ours[9:], ours[:9], strict=True))
    for r, g, c, k in zip(ref, got, chunked, rows, strict=True):
        assert float((g - r)[k].norm() / r[k].norm()) <= 1e-5
        assert float((c - r)[k].norm() / r[k].norm()) <= 1e-5
    hf_ring.revert_ring_attention(model)
    assert not any(isinstance(vars(m).get("forward"), DeferMaskIndexer) for m in model.modules())
    assert not any(isinstance(h, WrapMask) for m in model.modules() for h in m._forward_pre_hooks.values())
    with torch.no_grad():
        assert torch.equal(model(**plain).logits, ref[0])
        indexers[0].pool_size = 64  # (every visible key a candidate)
        assert float((model(**plain).logits - ref[0]).norm() / ref[0].norm()) > 1e-3
        indexers[0].pool_size = 16
        for i in indexers:
            i.topk = 64  # (every key of the pool)
        assert float((model(**plain).logits - ref[0]).norm() / ref[0].norm()) > 1e-3


def test_cosmos3_edge_sees_one_document_where_transformers_5_17_reads_its_image_positions_as_packing():
    """Transformers 5.17's Cosmos3 Edge, given no attention mask and no cache (``use_cache=False``, as under gradient
    checkpointing), reads the jumps of its multimodal positions at an image as packed documents; with a cache or a
    mask, and on 5.24, it sees one document. hf_ring, given a batch by ``shard_batch`` (no mask), computes the one
    document at one rank: the parity cases compare it with the model given an all-ones mask there (``one_document``)."""
    if not in_transformers("cosmos3_edge"):
        pytest.skip("Cosmos3 Edge is not in this Transformers release")
    model = make_model("cosmos3_edge", images=True).eval()
    _, batch = make_batch("images", 40, family="cosmos3_edge")
    assert "attention_mask" not in batch
    with torch.no_grad():
        bare = model(**batch, use_cache=False).loss
        cached = model(**batch, use_cache=True).loss
        masked = model(**{**batch, "attention_mask": torch.ones_like(batch["input_ids"])}, use_cache=False).loss
        reference = model(**one_document(model, batch), use_cache=False).loss
        hf_ring.apply_ring_attention(model)
        ours = model(**hf_ring.shard_batch(batch)).loss  # (no mask; use_cache=False)
    assert abs(float(masked - cached)) <= 1e-6 and abs(float(reference - cached)) <= 1e-6
    assert abs(float(ours - cached)) <= 1e-5
    if transformers_at_least("5.24"):
        assert abs(float(bare - cached)) <= 1e-6
    else:  # (measured 7.1e-3 apart)
        assert abs(float(bare - cached)) > 1e-3


def test_a_selection_of_keys_is_checked_before_any_communication():
    q = torch.randn(1, 2, 8, 8)
    kv = torch.randn(1, 1, 8, 8)
    good = torch.zeros(1, 8, 3, dtype=torch.long)
    bad = (
        torch.zeros(1, 7, 3, dtype=torch.long), torch.zeros(1, 8, 3), torch.zeros(8, 3, dtype=torch.long),
        torch.zeros(1, 2, 8, 3, dtype=torch.long),  # a list per query head: one per key/value head is taken
        hf_ring.Selection(good, 0), hf_ring.Selection(good, True), hf_ring.Selection(good.float(), 4),
        hf_ring.Selection(good, 4, -1),
    )  # fmt: skip
    for selected in bad:
        with pytest.raises(ValueError, match="selected must be an integer tensor"):
            hf_ring.ring_attention(q, kv, kv, selected=selected)
        with pytest.raises(ValueError, match="selected must be an integer tensor"):  # (checked with the other inputs)
            hf_ring.decode_attention(q, kv, kv, q_pos=torch.arange(8), k_pos=torch.arange(8), selected=selected)
    for selected in (good, good[:, None], hf_ring.Selection(good[:, None], 4)):  # (one rank: no communication)
        assert hf_ring.ring_attention(q, kv, kv, selected=selected).shape == q.shape


def test_ddp_is_told_up_front_that_indexers_and_image_tokenizers_get_no_gradient():
    """Transformers runs DeepSeek sparse attention's indexers without gradients, and Chameleon's VQ-VAE gives discrete
    codes, so DDP would fail at the second step on their trainable weights: refused before training, unless they are
    frozen (or LoRA leaves them frozen) or DDP looks for unused parameters; other families have none."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from hf_ring.engines import check_ddp_reaches_every_parameter, without_gradient

    def ddp(find_unused):
        return SimpleNamespace(
            distributed_type="MULTI_CPU", ddp_handler=SimpleNamespace(find_unused_parameters=find_unused)
        )

    model = make_model("deepseek_v32")
    idle = without_gradient(model)
    assert idle and all(".indexer." in n for n in idle)
    assert len(idle) == sum(".indexer." in n for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match=r"indexers .* get no gradient.*find_unused_parameters=True"):
        check_ddp_reaches_every_parameter(ddp(False), model)
    check_ddp_reaches_every_parameter(ddp(True), model)
    lora = get_peft_model(make_model("deepseek_v32"), LoraConfig(r=4, target_modules=["o_proj"]))
    assert without_gradient(lora) == []
    check_ddp_reaches_every_parameter(ddp(False), lora)
    for m in model.modules():
        if getattr(m, "indexer", None) is not None:
            m.indexer.requires_grad_(False)
    check_ddp_reaches_every_parameter(ddp(False), model)
    assert without_gradient(make_model("deepseek_v3")) == []
    if in_transformers("mistral_large4"):  # a vision-language model's text model (its patch inherits the indexers)
        vlm = make_model("mistral_large4")
        idle = without_gradient(vlm)
        assert idle and len(idle) == sum(".indexer." in n for n, _ in vlm.named_parameters())
        with pytest.raises(ValueError, match=r"indexers .* get no gradient"):
            check_ddp_reaches_every_parameter(ddp(False), vlm)
    # Chameleon's VQ-VAE turns images into discrete codes: no gradient reaches it, whatever the batch (checked by a
    # backward with images: every other parameter has one)
    cham = make_model("chameleon", images=True)
    idle = without_gradient(cham)
    assert idle and set(idle) == {n for n, _ in cham.named_parameters() if n.startswith("model.vqmodel.")}
    cham(**make_batch("images", 40, family="chameleon")[1]).loss.backward()
    assert {n for n, p in cham.named_parameters() if p.grad is None} == set(idle)
    with pytest.raises(
        ValueError, match=r"image tokenizer .* get no gradient .*\(model\.model\.vqmodel\.requires_grad_\(False\)\)"
    ):
        check_ddp_reaches_every_parameter(ddp(False), cham)
    cham.model.vqmodel.requires_grad_(False)
    assert without_gradient(cham) == []
    emu3 = make_model("emu3", images=True)  # (Emu3's VQ-VAE the same: its codes embedded by its text model)
    assert set(without_gradient(emu3)) == {n for n, _ in emu3.named_parameters() if n.startswith("model.vqmodel.")}
    with pytest.raises(ValueError, match=r"image tokenizer .* get no gradient"):
        check_ddp_reaches_every_parameter(ddp(False), emu3)
