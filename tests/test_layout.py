"""Layouts: which global positions each rank holds, and shard/unshard round trips."""

import pytest
import torch

import hf_ring
from hf_ring.layout import required_multiple


@pytest.mark.parametrize("layout", hf_ring.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_positions_partition_the_sequence(layout, world):
    s = 24 * world
    every = torch.cat([hf_ring.positions(s, rank=r, world_size=world, layout=layout) for r in range(world)])
    assert torch.equal(every.sort().values, torch.arange(s))
    assert {hf_ring.positions(s, rank=r, world_size=world, layout=layout).numel() for r in range(world)} == {s // world}


def test_zigzag_rank_holds_chunks_r_and_2n_minus_1_minus_r():
    # S = 16, N = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
    assert hf_ring.positions(16, rank=0, world_size=2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert hf_ring.positions(16, rank=1, world_size=2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_striped_and_contiguous():
    assert hf_ring.positions(12, rank=1, world_size=3, layout="striped").tolist() == [1, 4, 7, 10]
    assert hf_ring.positions(12, rank=1, world_size=3, layout="contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", hf_ring.LAYOUTS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_unshard_round_trip(layout, dim):
    x = torch.randn(8, 24, 8)
    world = 4 if x.shape[dim] % required_multiple(layout, 4) == 0 else 2
    parts = [hf_ring.shard(x, dim=dim, rank=r, world_size=world, layout=layout) for r in range(world)]
    assert torch.equal(hf_ring.unshard(parts, dim=dim, layout=layout), x)


def test_shard_takes_the_positions():
    x = torch.arange(16)
    part = hf_ring.shard(x, dim=0, rank=1, world_size=2)
    assert torch.equal(part, hf_ring.positions(16, rank=1, world_size=2))


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="not a multiple of 8.*pad it to 16"):
        hf_ring.positions(10, rank=0, world_size=4)
    with pytest.raises(ValueError, match="multiple of 3"):
        hf_ring.positions(10, rank=0, world_size=3, layout="striped")
    with pytest.raises(ValueError, match="unknown layout"):
        hf_ring.positions(8, rank=0, world_size=2, layout="spiral")
    with pytest.raises(ValueError, match="rank 2 is not in a group"):
        hf_ring.positions(8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="disagree"):
        hf_ring.unshard([torch.zeros(4), torch.zeros(6)], dim=0)


def test_one_rank_is_identity_for_any_length():
    assert torch.equal(hf_ring.positions(7, rank=0, world_size=1), torch.arange(7))
