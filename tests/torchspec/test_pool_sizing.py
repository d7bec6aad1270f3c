"""The automatic KV pool: sized from free memory, with no cap from the model's context length on a GPU."""

from __future__ import annotations

import pytest
import torch

from torchspec.config import SpecConfig
from torchspec.kv_cache import (
    KVPool,
    LayerSpec,
    SlotAllocator,
    auto_capacity_tokens,
    bytes_per_token,
    reclaim_device_memory,
    step_list_bytes,
    step_workspace_bytes,
)

# SmolLM2-135M: 30 layers of 3 KV heads x 64 (23,040 bytes per token in bf16).
SMOLLM2 = [LayerSpec(i, 9, 3, 64, 0.125, None) for i in range(30)]
GIB = 1 << 30


def test_gpu_pool_takes_most_free_memory_without_a_context_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """W1's shape on an H200 (~139 GiB free after the weights): the pool holds far more than the 256 x 8,192
    tokens the old cap allowed, so requests of prompt + 8,192 tokens all run in one wave."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (139 * GIB, 141 * GIB))
    workspace = step_workspace_bytes(max_step_tokens=2304, max_batch_size=256, k=8, vocab_size=49152)
    ceiling = 256 * 8192
    tokens = auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), workspace, ceiling)
    assert tokens > ceiling
    assert tokens * bytes_per_token(SMOLLM2, torch.bfloat16) == pytest.approx(0.9 * (139 * GIB - workspace), rel=1e-4)
    assert tokens >= 256 * (160 + 8192 + 8)  # W1: every request's worst case at once


def test_the_allocator_cache_is_emptied_before_free_memory_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second engine in the same process finds the first pool's memory cached by PyTorch's allocator: the cache
    goes back to the driver before free memory is read, and what the allocator still holds after that (blocks
    split by smaller tensors, which a pool's 2 GiB tensors cannot use) is not counted."""
    free = {"bytes": 70 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 141 * GIB))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: free.update(bytes=120 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 15 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * GIB)
    tokens = auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), 0, 1)
    assert tokens * bytes_per_token(SMOLLM2, torch.bfloat16) == pytest.approx(0.9 * 120 * GIB, rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's CUDA caching allocator")
def test_a_dropped_pool_goes_back_to_the_driver_whole() -> None:
    """A tensor that outlives the pool, made after it (as the projections wrap() fuses are), must not land in the
    spare end of a pool tensor's allocator segment: it would hold that segment after the engine is gone (the next
    engine in the process found 33 of an H100's 78 GB held so). An odd slot count leaves each tensor's segment a
    spare end of ~1.8 MiB, where a 1.1 MiB tensor fits."""
    device = torch.device("cuda")
    reclaim_device_memory(device)
    cached_before = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pool = KVPool(SMOLLM2, 1_000_003, torch.bfloat16, device)
    assert pool.k[0].shape == (1_000_004, 3, 64) and pool.v[29].is_contiguous()
    kept = torch.empty(1_152 * 1024, dtype=torch.uint8, device=device)  # SmolLM2's fused q/k/v weight
    del pool
    reclaim_device_memory(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert cached - cached_before < 64 << 20, f"{cached >> 20} MiB of the dropped pool stayed cached"
    del kept


def test_gpu_pool_too_small_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 141 * GIB))
    with pytest.raises(MemoryError, match="kv_capacity_tokens"):
        auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), 2 * GIB, 1 << 20)


def test_cpu_pool_keeps_its_ceiling() -> None:
    assert auto_capacity_tokens(SMOLLM2, torch.float32, torch.device("cpu"), 0, host_ceiling_tokens=1000) == 1000


def test_allocator_hands_out_lowest_slots_and_takes_them_back() -> None:
    allocator = SlotAllocator(8)
    first, second = allocator.allocate(3), allocator.allocate(2)
    assert (first, second, allocator.num_free) == ([0, 1, 2], [3, 4], 3)
    allocator.free(first)
    assert allocator.allocate(3) == first[::-1]  # freed slots come back first
    allocator.free([0, 1, 2, 3, 4])
    assert sorted(allocator.free_slots().tolist()) == list(range(8))
    with pytest.raises(RuntimeError, match="9 slots requested, 8 free"):
        allocator.allocate(9)


def test_step_lists_and_verify_mass_are_reserved_beside_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """W3's shape (1,024 requests, PillarAttn with draft chains): the chains' lists (k - 1 forwards over 30 layers x
    3 KV heads, built in several copies) and the verify mass grow with the batch and its contexts; the pool leaves
    room for them, where a pool sized for the K/V alone ran out of memory on an H200 with every request admitted."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (130 * GIB, 141 * GIB))
    per_step, per_request, per_token = step_list_bytes(
        sparse_kv_heads=90,
        chain_forwards=7,
        sparsity=0.05,
        min_entries=136,
        step_entries=1 << 16,
        context_bound=8192,
        scored=True,
    )
    workspace = step_workspace_bytes(max_step_tokens=9216, max_batch_size=1024, k=8, vocab_size=49152)
    plain = auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), workspace, 1)
    step_lists = per_step + 1024 * per_request
    reserved = auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), workspace + step_lists, 1, per_token)
    # Every pool token in some request's lists, each list twice its budget (4 copies of 7 forwards' lists over 90
    # layer-head pairs), and the verify mass of 1,024 rows as wide as the longest context.
    draft_lists = reserved * 4 * 8 * 90 * 7 * 2 * 0.05 + per_step + 1024 * 4 * 8 * 90 * 7 * 136
    mass = 1024 * 8192 * 90 * 2
    assert 1024 * per_request >= mass + 2 * GIB  # the minimum-length lists of 1,024 requests, and the mass
    assert per_step > GIB  # a drained batch's share of the step's draft budget (65,536 entries per forward)
    assert (plain - reserved) * bytes_per_token(SMOLLM2, torch.bfloat16) >= 0.9 * (draft_lists + mass)
    assert reserved > 0.85 * plain  # a few percent of the pool, not a cap


def test_kv_memory_fraction_leaves_the_rest_to_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """A smaller fraction sizes a smaller pool (RL rollouts beside a training step); with an explicit pool size it
    is refused, not ignored."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 141 * GIB))
    full = auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), 0, 1)
    third = auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), 0, 1, device_fraction=0.3)
    assert third == pytest.approx(full / 3, rel=1e-4)
    with pytest.raises(ValueError, match="not both"):
        SpecConfig(kv_capacity_tokens=1000, kv_memory_fraction=0.3)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="kv_memory_fraction"):
            SpecConfig(kv_memory_fraction=bad)
