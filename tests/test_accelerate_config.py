"""RingAttentionPlugin configuration and errors, in one process (the launched runs: test_accelerate_cp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from tests.train_utils import REPO, collate, full_loss_sum, max_param_rel_err, rel_err, tiny_llama, token_dataset

# ---- single-process tests ------------------------------------------------------------------------


def _fake_accelerator(num_processes=1, process_index=0, distributed_type="NO", parallelism_config=None, fsdp=None):
    return types.SimpleNamespace(
        num_processes=num_processes,
        process_index=process_index,
        device=torch.device("cpu"),
        distributed_type=distributed_type,
        parallelism_config=parallelism_config,
        state=types.SimpleNamespace(fsdp_plugin=fsdp),
    )


def test_environment_fills_unset_arguments(monkeypatch):
    from hf_ring.accelerate import RingAttentionPlugin

    monkeypatch.setenv("HF_RING_CP_SIZE", "4")
    monkeypatch.setenv("HF_RING_LAYOUT", "striped")
    monkeypatch.setenv("HF_RING_BACKEND", "torch")
    p = RingAttentionPlugin()
    assert (p.cp_size, p.layout, p.backend) == (4, "striped", "torch")
    p = RingAttentionPlugin(cp_size=2, layout="zigzag", backend="auto")  # explicit arguments win
    assert (p.cp_size, p.layout, p.backend) == (2, "zigzag", "auto")
    monkeypatch.delenv("HF_RING_CP_SIZE")
    assert RingAttentionPlugin().validate(8) == 8  # unset: one CP group over every process
    assert RingAttentionPlugin().ulysses_size == 1  # unset: the pure ring
    assert RingAttentionPlugin().timeout is None  # unset: the process group's own timeout
    monkeypatch.setenv("HF_RING_TIMEOUT", "90")
    assert RingAttentionPlugin().timeout == 90.0 and RingAttentionPlugin(timeout=5).timeout == 5
    monkeypatch.setenv("HF_RING_ULYSSES_SIZE", "auto")
    assert RingAttentionPlugin().ulysses_size == "auto"
    monkeypatch.setenv("HF_RING_ULYSSES_SIZE", "2")
    assert RingAttentionPlugin().ulysses_size == 2 and RingAttentionPlugin(ulysses_size=4).ulysses_size == 4


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"cp_size": 0}, {}, "at least 1"),
        ({"layout": "spiral"}, {}, "unknown layout"),
        ({"backend": "cuda-magic"}, {}, "unknown backend"),
        ({}, {"HF_RING_CP_SIZE": "two"}, "not an integer"),
        ({}, {"HF_RING_ULYSSES_SIZE": "many"}, "HF_RING_ULYSSES_SIZE='many' is not an integer or 'auto'"),
        ({"ulysses_size": 0}, {}, "ulysses_size must be a positive int or 'auto'"),
        ({"cp_size": 4, "ulysses_size": 3}, {}, "ulysses_size=3 does not divide cp_size=4"),
        ({"timeout": -1}, {}, "timeout must be a positive number of seconds"),
        ({}, {"HF_RING_TIMEOUT": "soon"}, "HF_RING_TIMEOUT='soon' is not a number of seconds"),
    ],
)
def test_bad_configuration_is_refused_at_construction(monkeypatch, kwargs, env, match):
    from hf_ring.accelerate import RingAttentionPlugin

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        RingAttentionPlugin(**kwargs)


def test_cp_size_must_divide_world_size():
    from hf_ring.accelerate import RingAttentionPlugin

    with pytest.raises(ValueError, match="cp_size=3 does not divide the number of processes 4"):
        RingAttentionPlugin(cp_size=3).validate(4)
    with pytest.raises(ValueError, match="does not divide"):
        RingAttentionPlugin(cp_size=2).setup(_fake_accelerator(num_processes=1))
    assert RingAttentionPlugin(cp_size=2).validate(8) == 2


def test_groups_before_setup_raise():
    from hf_ring.accelerate import RingAttentionPlugin

    p = RingAttentionPlugin(cp_size=1)
    for name in ("cp_group", "dp_group", "device_mesh", "dp_size", "cp_rank"):
        with pytest.raises(RuntimeError, match="call plugin.prepare"):
            getattr(p, name)
    with pytest.raises(RuntimeError, match="call plugin.prepare"):
        p.reduce_loss(torch.tensor(1.0))


def test_multi_process_without_process_group_raises():
    from hf_ring.accelerate import RingAttentionPlugin

    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        RingAttentionPlugin(cp_size=2).setup(_fake_accelerator(num_processes=2))


@pytest.mark.parametrize("kind", ["MEGATRON_LM", "XLA"])
def test_unsupported_distributed_types_raise(kind):
    from hf_ring.accelerate import RingAttentionPlugin

    with pytest.raises(NotImplementedError, match=f"not distributed_type={kind}"):
        RingAttentionPlugin(cp_size=1).prepare(_fake_accelerator(distributed_type=kind), tiny_llama())


def test_device_placement_with_deepspeed_is_refused():
    from hf_ring.accelerate import RingAttentionPlugin

    with pytest.raises(ValueError, match="device_placement cannot be customised with DeepSpeed"):
        RingAttentionPlugin(cp_size=1).prepare(
            _fake_accelerator(distributed_type="DEEPSPEED"), tiny_llama(), device_placement=[True]
        )


def test_fsdp1_is_refused_naming_fsdp_version_2():
    from hf_ring.accelerate import RingAttentionPlugin

    fsdp1 = types.SimpleNamespace(fsdp_version=1)
    with pytest.raises(NotImplementedError, match="set fsdp_version: 2"):
        RingAttentionPlugin(cp_size=1).prepare(_fake_accelerator(distributed_type="FSDP", fsdp=fsdp1), tiny_llama())


def test_accelerate_parallelism_config_gives_the_cp_size_or_a_clear_error():
    from accelerate.parallelism_config import ParallelismConfig

    from hf_ring.accelerate import RingAttentionPlugin

    fsdp2 = dict(distributed_type="FSDP", fsdp=types.SimpleNamespace(fsdp_version=2))

    def acc(world=4, **sizes):
        return _fake_accelerator(num_processes=world, parallelism_config=ParallelismConfig(**sizes), **fsdp2)

    assert RingAttentionPlugin().check(acc(dp_shard_size=2, cp_size=2)) == 2
    assert RingAttentionPlugin(cp_size=2).check(acc(dp_shard_size=2, cp_size=2)) == 2
    assert RingAttentionPlugin().check(acc(dp_shard_size=4)) == 1  # FSDP2 over 4 replicas, no CP
    with pytest.raises(ValueError, match=r"RingAttentionPlugin\(cp_size=4\) disagrees .* cp_size=2"):
        RingAttentionPlugin(cp_size=4).check(acc(dp_shard_size=2, cp_size=2))
    with pytest.raises(ValueError, match="set tp_size and sp_size to 1"):
        RingAttentionPlugin().check(acc(dp_shard_size=2, tp_size=2))
    with pytest.raises(ValueError, match="HSDP with context parallelism"):
        RingAttentionPlugin().check(acc(world=8, dp_replicate_size=2, dp_shard_size=2, cp_size=2))
    ddp = _fake_accelerator(
        num_processes=2, distributed_type="MULTI_CPU", parallelism_config=ParallelismConfig(cp_size=2)
    )
    with pytest.raises(ValueError, match=r"needs FSDP2 \(fsdp_version: 2\)"):
        RingAttentionPlugin().check(ddp)


def test_unsupported_models_are_refused_before_any_collective():
    from transformers import XGLMConfig, XGLMForCausalLM

    from hf_ring.accelerate import RingAttentionPlugin

    xglm = XGLMForCausalLM(XGLMConfig(num_layers=1, attention_heads=2, d_model=16, ffn_dim=32, vocab_size=32))
    with pytest.raises(ValueError, match="no ring-attention patch for model type 'xglm'"):
        RingAttentionPlugin(cp_size=1).prepare(_fake_accelerator(), xglm)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        RingAttentionPlugin(cp_size=1).prepare(_fake_accelerator(), torch.nn.Linear(2, 2))


def test_single_process_prepare_matches_plain_model():
    """cp_size=1 on one process: the plugin path gives the plain model's loss and gradients."""
    from accelerate import Accelerator

    from hf_ring.accelerate import RingAttentionPlugin

    data = token_dataset(4, 21)
    ref = tiny_llama()
    s, n = full_loss_sum(ref, collate(data[:2]))
    (s / n).backward()

    model = tiny_llama()
    plugin = RingAttentionPlugin(cp_size=1)
    accelerator = Accelerator(cpu=True)
    try:
        _check_single_process(accelerator, plugin, model, data, s / n, ref)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


def _check_single_process(accelerator, plugin, model, data, ref_loss, ref):
    dl = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)
    model, dl = plugin.prepare(accelerator, model, dl)
    assert plugin.device_mesh is None and plugin.cp_group is None and plugin.dp_size == 1
    batch = next(iter(dl))
    assert "shift_labels" in batch and batch["input_ids"].shape == (2, 21)
    loss = model(**batch).loss
    accelerator.backward(loss)
    assert rel_err(loss, ref_loss) < 1e-6
    assert plugin.reduce_loss(loss).item() == pytest.approx(loss.item())
    grads = {k: p.grad for k, p in model.named_parameters()}
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    assert max_param_rel_err(grads, ref_grads) < 1e-5
    assert accelerator.unwrap_model(model) is model


def test_setup_is_a_frozen_value_and_the_plugin_is_never_rewritten():
    import dataclasses

    from accelerate import Accelerator

    from hf_ring.accelerate import RingAttentionPlugin, RingSetup

    plugin = RingAttentionPlugin()  # cp_size None: every process in one CP group
    accelerator = Accelerator(cpu=True)
    try:
        ring = plugin.setup(accelerator)
        assert isinstance(ring, RingSetup) and plugin.setup(accelerator) is ring and plugin.ring is ring
        assert (ring.world_size, ring.cp_size, ring.dp_size, ring.cp_rank, ring.dp_rank) == (1, 1, 1, 0, 0)
        assert plugin.cp_size is None  # the resolved size lives in the setup, not in the configuration
        with pytest.raises(dataclasses.FrozenInstanceError):
            ring.cp_size = 2
        with pytest.raises(dataclasses.FrozenInstanceError):
            plugin.cp_size = 2
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


def test_shard_collate_pickles_for_spawned_workers():
    """The sharding collate function goes to ``spawn`` / ``forkserver`` workers (no process group there): pickled,
    it gives rank 1 of 2 its zig-zag chunks (1 and 2 of 4) of the batch padded from 30 to 32 tokens."""
    import pickle

    from hf_ring.accelerate import _ShardCollate

    features = token_dataset(2, 30)
    local = pickle.loads(pickle.dumps(_ShardCollate(collate, 1, 2, "zigzag", True)))(features)
    ids = torch.nn.functional.pad(collate(features)["input_ids"], (0, 2))
    assert torch.equal(local["input_ids"], torch.cat([ids[:, 8:16], ids[:, 16:24]], 1))
    assert torch.equal(local["position_ids"][0], torch.arange(8, 24))
    assert local["ring_shard_info"].rank == 1 and local["ring_shard_info"].world_size == 2


def test_batches_are_padded_by_the_chunk_multiple_of_the_prepared_model():
    """DeepSeek-V4's compressed layers need chunks of a multiple of their compress rates (3 and 6 in the test model):
    the plugin learns it from the model it prepares, and its collate function pads by it, also when it was made
    before and when pickled; a chunk_multiple given to the plugin stands. ``shard_for`` pads by it with more than
    one rank only, and says so when it may not pad."""
    import pickle

    from accelerate import Accelerator

    from hf_ring.accelerate import RingAttentionPlugin, _ShardCollate
    from hf_ring.batch import shard_for
    from tests.hf_models import in_transformers, make_model

    if not in_transformers("deepseek_v4"):
        pytest.skip("DeepSeek-V4 needs a later Transformers")
    import hf_ring

    features = token_dataset(2, 40)
    assert hf_ring.chunk_multiple(tiny_llama()) == 1
    accelerator = Accelerator(cpu=True)
    try:
        for given, want in ((None, 6), (4, 4)):
            plugin = RingAttentionPlugin(cp_size=1, chunk_multiple=given)
            ring = plugin.setup(accelerator)
            early = _ShardCollate(collate, 1, 2, "zigzag", True, ring.chunks)  # (made before the model)
            assert early.chunks.value == (given or 1)
            plugin.prepare(accelerator, make_model("deepseek_v4"))
            assert ring.chunks.value == want and hf_ring.chunk_multiple(make_model("deepseek_v4")) == 6
            local = pickle.loads(pickle.dumps(early))(features)
            padded = -40 % (4 * want) + 40  # zig-zag over 2 ranks: 4 chunks
            ids = torch.nn.functional.pad(collate(features)["input_ids"], (0, padded - 40))
            q = padded // 4
            assert torch.equal(local["input_ids"], torch.cat([ids[:, q : 2 * q], ids[:, 2 * q : 3 * q]], 1))
            assert local["ring_shard_info"].seq_len == padded
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    batch = collate(features)
    assert shard_for(batch, 0, 1, chunk_multiple=6)["input_ids"].shape[1] == 40  # (one rank: nothing meets a rank)
    with pytest.raises(ValueError, match=r"with chunks of a multiple of 6 tokens, needs a multiple of 24.*=24"):
        shard_for(batch, 0, 2, pad_to_multiple=False, chunk_multiple=6)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="chunk_multiple must be a positive int"):
            shard_for(batch, 0, 2, chunk_multiple=bad)
        with pytest.raises(ValueError, match="chunk_multiple must be a positive int or None"):
            RingAttentionPlugin(chunk_multiple=bad)


_WITHOUT_OPTIONAL = """
import sys
for name in ("deepspeed", "trl", "liger_kernel", "datasets", "flash_attn"):
    sys.modules[name] = None  # as if not installed: importlib.util.find_spec gives None, import raises
import torch
from accelerate import Accelerator
from hf_ring.accelerate import RingAttentionPlugin
from tests.train_utils import collate, full_loss_sum, tiny_llama, token_dataset

data = token_dataset(4, 21)
ref = tiny_llama()
s, n = full_loss_sum(ref, collate(data[:2]))
model = tiny_llama()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
dl = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=collate)
accelerator = Accelerator(cpu=True)
model, opt, sched, dl = RingAttentionPlugin(cp_size=1).prepare(accelerator, model, opt, sched, dl)
loss = model(**next(iter(dl))).loss
accelerator.backward(loss)
opt.step(); sched.step()
print("LOSS", loss.item(), (s / n).item(), "LR", opt.param_groups[0]["lr"])
"""


def test_plugin_works_without_the_optional_packages():
    """DeepSpeed, TRL, Liger-Kernel, datasets and flash-attn are optional (the GPU image has none of them):
    prepare with a model, optimizer, scheduler and loader, then one step, with each hidden."""
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OPTIONAL],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LOSS"))
    _, loss, ref_loss, _, lr = line.split()
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    assert float(lr) == pytest.approx(0.05)  # the scheduler stepped once, as in a plain run
