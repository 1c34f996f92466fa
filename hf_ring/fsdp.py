"""Gradient reduction for a model sharded with FSDP2 (``fully_shard``) across dp x cp ranks.

With context parallelism each rank's loss is its share of its CP group's loss, so the gradients of
the ranks of a CP group must be summed, and those of the data-parallel replicas averaged. FSDP2
shards over every rank of the mesh it is given and by default averages over all of them (divides by
dp x cp). ``set_cp_gradient_reduction`` makes its reduce-scatter sum over every rank and divide by
``dp_size`` afterwards: plain ``SUM`` collectives (no ``PREMUL_SUM``, which gloo lacks), one division.

The torch-native recipe (no Accelerate; see docs/accelerate.md)::

    mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
    hf_ring.apply_ring_attention(model, group=mesh.get_group("cp"))
    for layer in model.model.layers:
        fully_shard(layer)            # over every rank (the default world mesh)
    fully_shard(model)
    set_cp_gradient_reduction(model, dp_size=dp)
    loss = model(**hf_ring.shard_batch(batch, group=mesh.get_group("cp"))).loss
    loss.backward()                   # gradients: CP shares summed, DP replicas averaged
"""

from __future__ import annotations

import torch

__all__ = ["set_cp_gradient_reduction"]


def set_cp_gradient_reduction(model: torch.nn.Module, *, dp_size: int) -> torch.nn.Module:
    """Make every FSDP2 module in ``model`` sum gradients over its ranks and divide by ``dp_size`` (in place).

    Call it after ``fully_shard`` (Accelerate's ``prepare`` with ``fsdp_version: 2`` included) when the
    model is sharded over all dp x cp ranks and each rank back-propagates its CP share of the loss.
    Returns ``model``. ValueError if ``model`` holds no FSDP2 module or ``dp_size`` is not positive.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int (the number of data-parallel replicas), got {dp_size!r}")
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            f"{type(model).__name__} holds no FSDP2 module; call torch.distributed.fsdp.fully_shard on it first"
        )
    for m in modules:
        m.set_gradient_divide_factor(float(dp_size))
        m.set_force_sum_reduction_for_comms(True)
    return model
