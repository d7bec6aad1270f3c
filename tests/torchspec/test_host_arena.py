"""The KV host tier's memory: blocks made once (page-locked on CUDA) and lent again, and a request's K/V through
them intact. Pinning a buffer per move cost W3's offload run 52 s of host time (H100), hence the arena."""

from __future__ import annotations

import torch

from torchspec.host_arena import HostArena
from torchspec.kv_cache import KVPool, LayerSpec
from torchspec.kv_offload import HostKVStore

BLOCK = 64


def test_blocks_given_back_are_lent_again_without_growing():
    arena = HostArena(pin=False, limit_bytes=10**6, block_bytes=BLOCK, first_slab_bytes=4 * BLOCK)
    first = arena.take(3 * BLOCK + 1)  # four blocks, the last one partly
    assert len(first) == 4 and all(block.numel() == BLOCK for block in first)
    assert arena.reserved_bytes == 4 * BLOCK and arena.free_blocks == 0
    arena.give(first)
    again = arena.take(2 * BLOCK)
    assert arena.reserved_bytes == 4 * BLOCK, "blocks given back were not lent again"
    pointers = {block.data_ptr() for block in first}
    assert {block.data_ptr() for block in again} <= pointers


def test_the_arena_doubles_and_stops_at_its_limit_unless_one_request_needs_more():
    arena = HostArena(pin=False, limit_bytes=12 * BLOCK, block_bytes=BLOCK, first_slab_bytes=2 * BLOCK)
    held = [arena.take(BLOCK)]
    assert arena.reserved_bytes == 2 * BLOCK  # the first slab
    held.append(arena.take(2 * BLOCK))
    assert arena.reserved_bytes == 4 * BLOCK  # doubled
    held.append(arena.take(2 * BLOCK))
    assert arena.reserved_bytes == 8 * BLOCK
    held.append(arena.take(4 * BLOCK))
    assert arena.reserved_bytes == 12 * BLOCK, "grew past its limit"  # 8 more would double: 4 reach the limit
    held.append(arena.take(5 * BLOCK))
    assert arena.reserved_bytes == 14 * BLOCK  # past the limit only by what this request lacked (3 blocks were free)
    assert len({block.data_ptr() for blocks in held for block in blocks}) == 14


def test_a_request_comes_back_from_the_blocks_as_it_left():
    """Rows of every pool tensor (K, V, a layer's key sketch) gathered from scattered slots, through blocks far
    smaller than the request (many copies, the last block partly filled), into other slots."""
    layers = [LayerSpec(i, 4, 2, 8, 0.35, None) for i in range(2)]
    pool = KVPool(layers, 64, torch.float32, torch.device("cpu"), sketched={1})
    generator = torch.Generator().manual_seed(0)
    for rows in pool.slot_tensors():
        rows.copy_(torch.randint(0, 200, rows.shape, generator=generator).to(rows.dtype))
    before = [rows.clone() for rows in pool.slot_tensors()]
    store = HostKVStore(pool, capacity_tokens=64, block_bytes=BLOCK * 3)
    source, target = [5, 17, 2, 40, 33, 8, 61], [9, 10, 11, 50, 51, 52, 0]
    store.offload(7, source)
    for rows in pool.slot_tensors():  # the slots are reused while the request is away
        rows[source] = 0
    store.restore(7, target)
    for old, rows in zip(before, pool.slot_tensors(), strict=True):
        torch.testing.assert_close(rows[target], old[source], rtol=0, atol=0)
    store.offload(8, [])  # a sample waiting for its prompt's K/V leaves with nothing computed
    store.restore(8, [])
    assert store.num_requests == 0
    assert store.settle().host_reserved_bytes > 0


def test_what_the_host_tier_promises_a_step_its_offloads_find():
    """The scheduler asks ``refusal`` before it sends requests out: after a yes, the step's offloads take blocks
    without growing the arena (a growth then could fail after the request's slots were given away)."""
    layers = [LayerSpec(i, 4, 2, 8, 0.35, None) for i in range(2)]
    pool = KVPool(layers, 64, torch.float32, torch.device("cpu"), sketched={1})
    # A host tier of one token: the arena grows by just what it is short of (no slab to spare).
    store = HostKVStore(pool, capacity_tokens=1, block_bytes=BLOCK * 3)
    assert store.refusal([7, 3, 11]) is None
    reserved = store.settle().host_reserved_bytes
    for request, count in enumerate((7, 3, 11)):
        store.offload(request, list(range(count)))
    assert store.settle().host_reserved_bytes == reserved
