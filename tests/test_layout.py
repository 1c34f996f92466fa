"""Layouts: which global positions each rank holds, and shard/unshard round trips."""

import pytest
import torch

import hf_ring
from hf_ring.layout import required_multiple
from tests.hf_models import transformers_at_least


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


@pytest.mark.parametrize("layout", hf_ring.LAYOUTS)
def test_positions_built_on_a_device_equal_the_cpu_ones(layout):
    for rank in range(3):
        cpu = hf_ring.positions(24, rank=rank, world_size=3, layout=layout)
        assert torch.equal(hf_ring.positions(24, rank=rank, world_size=3, layout=layout, device="cpu"), cpu)


def _visible(ids: torch.Tensor) -> torch.Tensor:
    """[rows, q, k]: k <= q, same id, neither padding (how the ring reads document ids)."""
    n = ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    same = ids[:, :, None] == ids[:, None, :]
    return causal & same & (ids[:, :, None] >= 0) & (ids[:, None, :] >= 0)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 30])
def test_chunked_documents_see_what_transformers_chunked_mask_lets_through(chunk):
    """Padded rows (left, right, none): Transformers' chunked overlay (chunks counted from the first token that is
    not left padding) and causality over the tokens that are not padding. Packed rows: chunks of each document's
    positions (Transformers 5.24 maps the indices through the restarting position ids)."""
    from transformers.masking_utils import chunked_causal_mask_function

    from hf_ring.layout import chunk_documents

    n = 20
    mask = torch.ones(4, n, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, 14:] = 0  # right padding
    mask[3, :2] = mask[3, 9:11] = 0  # left padding and a gap (Transformers counts chunks from the first token)
    lead = (mask.cumsum(-1) == 0).sum(-1)
    fn = chunked_causal_mask_function(chunk, lead)
    idx = torch.arange(n)
    want = torch.stack([fn(b, 0, idx[:, None], idx[None, :]) for b in range(4)])
    want &= mask.bool()[:, :, None] & mask.bool()[:, None, :]
    ids = chunk_documents(torch.where(mask.bool(), 0, -1), chunk, seq_len=n)
    assert ids.dtype == torch.int32 and torch.equal(_visible(ids), want)
    assert torch.equal(chunk_documents(None, chunk, seq_len=n), chunk_documents(torch.zeros(1, n), chunk, seq_len=n))

    pos = torch.cat([torch.arange(6), torch.arange(9), torch.arange(5)])  # three packed documents
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([6, 9, 5]))[None]
    packed = (pos[:, None] // chunk == pos[None, :] // chunk) & (docs[0, :, None] == docs[0, None, :])
    if transformers_at_least("5.24"):  # Transformers' own: its chunked mask read through the packed positions
        from transformers.masking_utils import remap_positions_for_packed_sequence

        fn = remap_positions_for_packed_sequence(chunked_causal_mask_function(chunk, lead[:1] * 0), pos[None])
        packed = torch.tensor([[bool(fn(0, 0, q, k)) for k in range(n)] for q in range(n)])
        packed &= docs[0, :, None] == docs[0, None, :]
    assert torch.equal(_visible(chunk_documents(docs, chunk, seq_len=n))[0], packed & torch.ones(n, n).tril().bool())


@pytest.mark.parametrize("chunk", [0, -2, 2.0, True])
def test_a_chunk_that_is_not_a_positive_integer_is_refused(chunk):
    from hf_ring.layout import chunk_documents

    with pytest.raises(ValueError, match="positive integer"):
        chunk_documents(None, chunk, seq_len=8)
