"""``hf_ring.check_exactness``: its verdict on correct and on broken runs, and the model it leaves as it found it.

The numbers it reports are the suite's own measure (``tests/test_properties.py``); here: that it passes what is exact,
fails what is not (a ring output off by 0.1%), and restores the model (attention, mode, dtypes, gradients).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.hf_models import in_transformers, make_batch, make_model


def _state(model) -> dict:
    """What the check must leave as it was: each parameter's tensor (values and dtype) and gradient object."""
    return {n: (p.detach().clone(), p.grad) for n, p in model.named_parameters()}


def _same_state(model, before: dict) -> bool:
    return all(
        p.dtype == before[n][0].dtype and torch.equal(p.detach(), before[n][0]) and p.grad is before[n][1]
        for n, p in model.named_parameters()
    )


def _worker(rank: int, world_size: int) -> dict:
    import hf_ring
    from hf_ring import exactness, hf_attention
    from hf_ring.ring_config import CONFIG_ATTR

    def error(fn) -> str:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    def prepared(dtype=torch.float32):
        """A model in training mode but for one frozen layer, with gradients the caller had: all put back."""
        model = make_model("llama", dtype=dtype)
        model.train()
        model.model.layers[0].mlp.eval()
        for p in model.parameters():
            p.grad = torch.full_like(p, 7.0)
        return model, (_state(model), {m: m.training for m in model.modules()})

    def restored(model, before) -> bool:
        patched = any(hasattr(m, CONFIG_ATTR) for m in model.modules())
        modes = all(m.training == before[1][m] for m in model.modules())
        return _same_state(model, before[0]) and modes and not patched

    out = {}
    for kind in ("plain", "padded", "packed"):
        model, before = prepared()
        report = hf_ring.check_exactness(model, make_batch(kind, 45)[0])
        out[kind] = {"report": report, "restored": restored(model, before)}
    model, before = prepared(torch.bfloat16)
    out["bf16"] = {"report": hf_ring.check_exactness(model, make_batch("plain", 45)[0])}
    out["bf16"]["restored"] = restored(model, before)
    model, before = prepared(torch.float64)
    out["float64"] = {"report": hf_ring.check_exactness(model, make_batch("plain", 45)[0])}
    out["float64"]["restored"] = restored(model, before)
    out["moe"] = {"report": hf_ring.check_exactness(make_model("gpt_oss"), make_batch("packed", 40)[0])}
    vl_batch = make_batch("images-padded", 40, family="qwen2_vl")[0]
    out["images"] = {"report": hf_ring.check_exactness(make_model("qwen2_vl", images=True), vl_batch)}
    out["ulysses"] = {
        "report": hf_ring.check_exactness(make_model("llama"), make_batch("padded", 45)[0], ulysses_size=2)
    }
    if in_transformers("deepseek_v4"):  # (40 tokens padded by its chunk multiple; its indexers get no gradient)
        v4_batch = make_batch("plain", 40, family="deepseek_v4")[0]
        out["v4"] = {"report": hf_ring.check_exactness(make_model("deepseek_v4"), v4_batch)}

    # a model already patched: its settings, and patched afterwards with the very same configuration
    patched = make_model("llama")
    hf_ring.apply_ring_attention(patched, layout="contiguous")
    cfg = next(getattr(m, CONFIG_ATTR) for m in patched.modules() if hasattr(m, CONFIG_ATTR))
    report = hf_ring.check_exactness(patched, make_batch("padded", 45)[0])
    again = [getattr(m, CONFIG_ATTR, None) for m in patched.modules() if hasattr(m, CONFIG_ATTR)]
    out["patched"] = {"report": report, "restored": bool(again) and all(c is cfg for c in again)}

    # a broken ring must fail: its output 0.1% off in fp32, 1% in bf16
    true_ring = hf_attention.ring_attention
    for name, dtype, scale in (("broken", torch.float32, 1.001), ("broken-bf16", torch.bfloat16, 1.01)):
        hf_attention.ring_attention = lambda *a, scale=scale, **k: true_ring(*a, **k) * scale
        try:
            report = hf_ring.check_exactness(make_model("llama", dtype=dtype), make_batch("plain", 45)[0])
            out[name] = {"report": report}
        finally:
            hf_attention.ring_attention = true_ring

    # one rank fails in the unmodified model's run: every rank raises, the model restored, the group goes on
    true_reference = exactness._reference
    if rank == 1:
        exactness._reference = lambda *a, **k: (_ for _ in ()).throw(ValueError("boom"))
    model, before = prepared()
    try:
        out["one_fails"] = error(lambda: hf_ring.check_exactness(model, make_batch("plain", 45)[0]))
    finally:
        exactness._reference = true_reference
    out["one_fails_restored"] = restored(model, before)
    # one rank's model refuses the wider dtype: no rank uses a yardstick, and the report says which rank
    true_cast = exactness._cast
    if rank == 1:
        exactness._cast = lambda *a: (_ for _ in ()).throw(RuntimeError("no float64 here"))
    try:
        out["one_refuses"] = hf_ring.check_exactness(make_model("llama"), make_batch("plain", 45)[0])
    finally:
        exactness._cast = true_cast

    batch = make_batch("plain", 45, seed=1 + rank)[0]  # (each rank its own batch)
    out["different"] = error(lambda: hf_ring.check_exactness(make_model("llama"), batch))
    different = make_model("llama")
    with torch.no_grad():
        different.model.norm.weight.add_(rank)  # (rank 1's copy differs)
    out["different_weights"] = error(lambda: hf_ring.check_exactness(different, make_batch("plain", 45)[0]))
    other = make_model("llama", **({"intermediate_size": 40} if rank else {}))  # (rank 1's model is another)
    out["different_model"] = error(lambda: hf_ring.check_exactness(other, make_batch("plain", 45)[0]))
    out["no_labels"] = error(lambda: hf_ring.check_exactness(make_model("llama"), {"input_ids": batch["input_ids"]}))
    one = make_batch("plain", 45)[0]  # rank 1 alone passes no labels: it raises its error, rank 0 names it
    one = {"input_ids": one["input_ids"]} if rank == 1 else one
    out["one_without_labels"] = error(lambda: hf_ring.check_exactness(make_model("llama"), one))
    out["settings"] = error(lambda: hf_ring.check_exactness(patched, make_batch("plain", 45)[0], layout="zigzag"))
    out["after"] = hf_ring.check_exactness(make_model("llama"), make_batch("plain", 45)[0]).ok  # the group goes on
    return out


def test_check_exactness_passes_exact_runs_fails_a_broken_one_and_restores_the_model():
    results = run_distributed(_worker, 2, timeout=300)
    for rank, r in enumerate(results):
        for kind in ("plain", "padded", "packed", "bf16", "float64", "patched", "images", "ulysses"):
            report = r[kind]["report"]
            assert report.ok and report.ranks == 2 and report.model_grad_error is not None, (kind, str(report))
            assert report.reference_dtype == (torch.float32 if kind == "bf16" else torch.float64), kind
            assert report.grad_error <= report.grad_bound and "OK" in str(report), str(report)
            assert r[kind].get("restored", True), kind
        assert r["patched"]["report"].layout == "contiguous"
        assert r["plain"]["report"].grad_bound < 2e-4  # (fp32: twice the model's own error, 1e-7, plus 1e-4)
        # Transformers' grouped expert products refuse float64: no yardstick, said so
        for moe in [r["moe"]["report"]] + ([r["v4"]["report"]] if "v4" in r else []):
            assert moe.ok and moe.reference_dtype is None and moe.model_grad_error is None, str(moe)
            assert "refused float64 on rank(s) [0, 1]" in moe.note, moe.note
        broken = r["broken"]["report"]
        assert not broken.ok and broken.grad_error > 10 * broken.grad_bound and "FAILED" in str(broken), str(broken)
        broken = r["broken-bf16"]["report"]
        assert broken.loss_error > broken.loss_bound and broken.grad_error > 10 * broken.grad_bound, str(broken)
        want = "ValueError: boom" if rank == 1 else "rank(s) [1] of the group failed"
        assert want in r["one_fails"] and r["one_fails_restored"], r["one_fails"]
        refused = r["one_refuses"]
        assert refused.ok and refused.reference_dtype is None and "rank(s) [1]" in refused.note, str(refused)
        assert "(RuntimeError: no float64 here)" in refused.note, refused.note  # rank 1's reason on every rank
        assert "different batches" in r["different"], r["different"]
        assert "different weights (1 parameter(s), first model.norm.weight)" in r["different_weights"]
        assert "models of different parameters" in r["different_model"], r["different_model"]
        assert "with labels" in r["no_labels"], r["no_labels"]
        want = "with labels" if rank == 1 else "rank(s) [1] of the group refused their input"
        assert want in r["one_without_labels"], r["one_without_labels"]
        assert "leave layout unset" in r["settings"], r["settings"]
        assert r["after"]
    for kind in ("plain", "moe", "one_refuses"):  # the same report on every rank (its note too)
        mine, peer = (r[kind]["report"] if isinstance(r[kind], dict) else r[kind] for r in results)
        assert mine == peer, (kind, mine.note, peer.note)


def test_check_exactness_on_one_process():
    import hf_ring

    report = hf_ring.check_exactness(make_model("mistral"), make_batch("padded", 45)[0], reference_dtype=None)
    assert report.ok and report.ranks == 1 and report.reference_dtype is None and report.loss_error < 1e-5, str(report)
    with pytest.raises(ValueError, match="reference_dtype must be"):
        hf_ring.check_exactness(make_model("mistral"), make_batch("plain", 45)[0], reference_dtype=torch.int64)
    with pytest.raises(ValueError, match="float32 is not wider than the model's float32"):  # (no yardstick)
        hf_ring.check_exactness(make_model("mistral"), make_batch("plain", 45)[0], reference_dtype=torch.float32)


def test_a_nan_gradient_fails_the_check():
    """hf_ring's gradient of one parameter NaN (not the first one compared), the loss and the others exact: FAILED,
    that parameter named, its error infinite."""
    import math

    import hf_ring
    from hf_ring import exactness

    true_ring = exactness._ring

    def nan_in_norm(model, *args):
        hook = model.model.norm.weight.register_hook(lambda g: g * float("nan"))
        try:
            return true_ring(model, *args)
        finally:
            hook.remove()

    exactness._ring = nan_in_norm
    try:
        report = hf_ring.check_exactness(make_model("llama"), make_batch("plain", 45)[0])
    finally:
        exactness._ring = true_ring
    assert not report.ok and report.worst == "model.norm.weight" and math.isinf(report.grad_error), str(report)
    assert report.loss_error < 1e-5 and "FAILED" in str(report), str(report)


def test_a_model_loaded_with_hf_ring_attention_is_checked_against_sdpa_and_given_back_as_loaded():
    """A model switched to ``attn_implementation="hf_ring"`` but not patched: the unmodified model's runs use
    Transformers' own attention (SDPA), not hf_ring's; afterwards the model is ``"hf_ring"`` again, unpatched."""
    import hf_ring
    from hf_ring import exactness
    from hf_ring.ring_config import CONFIG_ATTR

    hf_ring.register_attention()
    model = make_model("llama")
    model.set_attn_implementation("hf_ring")
    seen = []
    true_reference = exactness._reference

    def spy(model, *args):
        seen.append(model.config._attn_implementation)
        return true_reference(model, *args)

    exactness._reference = spy
    try:
        report = hf_ring.check_exactness(model, make_batch("padded", 45)[0])
    finally:
        exactness._reference = true_reference
    assert report.ok and seen == ["sdpa", "sdpa"], (seen, str(report))
    assert model.config._attn_implementation == "hf_ring"
    assert not any(hasattr(m, CONFIG_ATTR) for m in model.modules())


def test_the_plugin_checks_with_its_settings_and_its_chunked_loss():
    """``RingAttentionPlugin.check_exactness`` (one process): the plugin's layout, and the chunked loss on during the
    check (the loss the plugin will train) and off afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hf_ring import loss
    from hf_ring.accelerate import RingAttentionPlugin

    model = make_model("llama")
    seen = []
    chunked = loss.apply_chunked_loss

    def spy(target, **kwargs):
        seen.append(kwargs)
        return chunked(target, **kwargs)

    loss.apply_chunked_loss = spy
    try:
        plugin = RingAttentionPlugin(cp_size=1, layout="contiguous", loss_chunk_size=16)
        report = plugin.check_exactness(Accelerator(cpu=True), model, make_batch("packed", 45)[0])
    finally:
        loss.apply_chunked_loss = chunked
        AcceleratorState._reset_state(reset_partial_state=True)
    assert report.ok and report.layout == "contiguous" and report.ranks == 1, str(report)
    assert seen == [{"chunk_size": 16, "backend": "torch"}] and not loss.is_chunked(model)


def test_the_trainer_checks_its_model_on_its_first_batch(tmp_path):
    """``RingAttentionTrainer.check_exactness()`` (one process): the collator's batch of the first examples, the
    model as the trainer patched it (its chunked loss too), and the model still patched and trainable afterwards."""
    from accelerate.state import AcceleratorState

    from hf_ring.accelerate import RingAttentionPlugin
    from hf_ring.loss import is_chunked
    from hf_ring.ring_config import CONFIG_ATTR
    from hf_ring.trainer import RingAttentionTrainer
    from tests.train_utils import collate, tiny_llama, token_dataset, trainer_args

    model = tiny_llama()
    try:
        trainer = RingAttentionTrainer(model=model, args=trainer_args(tmp_path, "check"),
                                       train_dataset=token_dataset(4, 21), data_collator=collate,
                                       ring_plugin=RingAttentionPlugin(cp_size=1))  # fmt: skip
        report = trainer.check_exactness()
        assert report.ok and report.ranks == 1 and report.reference_dtype == torch.float64, str(report)
        assert is_chunked(model) and any(hasattr(m, CONFIG_ATTR) for m in model.modules())
        trainer.train()  # (the check left it trainable)

        class Stream(torch.utils.data.IterableDataset):  # (with a length: still read by iterating)
            def __iter__(self):
                return iter(token_dataset(4, 21, seed=2))

            def __len__(self):
                return 4

        trainer = RingAttentionTrainer(model=tiny_llama(), args=trainer_args(tmp_path, "stream"),
                                       train_dataset=Stream(), data_collator=collate,
                                       ring_plugin=RingAttentionPlugin(cp_size=1))  # fmt: skip
        assert trainer.check_exactness().ok
        trainer.model.model.norm.weight.ds_id = 0  # (as DeepSpeed ZeRO-3 marks a partitioned parameter)
        with pytest.raises(ValueError, match="partitioned by DeepSpeed ZeRO"):
            trainer.check_exactness()
        del trainer.model.model.norm.weight.ds_id
        trainer.shards_batches = False  # (the preference and online trainers: their loss is not the LM loss)
        with pytest.raises(ValueError, match="log-probabilities"):
            trainer.check_exactness()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_the_command_line_check_on_two_processes(tmp_path):
    """``torchrun -m hf_ring.check`` on a saved tiny Llama: LoRA on packed random tokens, over 2 CPU processes (its
    adapters seeded alike on both: unseeded, each process draws its own); the report printed once, exit status 0. A
    batch without a target to check (``--seq-len 1``) ends with its error and a non-zero status."""
    import os
    import subprocess
    import sys

    from tests.train_utils import REPO, tiny_llama

    tiny_llama().save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip

    def run(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "hf_ring.check", "--model", str(tmp_path / "model"), *args]  # fmt: skip
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)

    ok = run("--seq-len", "64", "--batch-size", "2", "--packed", "--lora")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("hf_ring exactness check: OK") == 1 and "2 rank(s)" in ok.stdout, ok.stdout
    assert "lora_" in ok.stdout  # (only the adapters take gradients: the worst one is an adapter's)
    bad = run("--seq-len", "1")
    assert bad.returncode != 0 and "no target to check" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_a_cast_that_fails_half_way_gives_back_what_it_cast():
    """The yardstick's cast, failing at the third parameter (as out of memory would): every parameter back in its
    own tensor and dtype."""
    from hf_ring import exactness

    model = make_model("llama")
    before = _state(model)
    count = {"n": 0}
    true_to = torch.Tensor.to

    def failing_to(self, *args, **kwargs):
        if args and args[0] is torch.float64:
            count["n"] += 1
            if count["n"] == 3:
                raise torch.OutOfMemoryError("out of memory (a stand-in)")
        return true_to(self, *args, **kwargs)

    torch.Tensor.to = failing_to
    try:
        with pytest.raises(torch.OutOfMemoryError), exactness._cast(model, torch.float64):
            pass
    finally:
        torch.Tensor.to = true_to
    assert count["n"] == 3 and _same_state(model, before)
