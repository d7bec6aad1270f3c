"""The automatic KV pool: sized from free memory, with no cap from the model's context length on a GPU."""

from __future__ import annotations

import pytest
import torch

from torchspec.kv_cache import LayerSpec, SlotAllocator, auto_capacity_tokens, bytes_per_token, step_workspace_bytes

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


def test_memory_the_allocator_caches_counts_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second engine in the same process (W1's second run) finds the first pool's memory cached by PyTorch's
    allocator, not returned to the driver: it is free for the new pool all the same."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 141 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 65 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5 * GIB)
    tokens = auto_capacity_tokens(SMOLLM2, torch.bfloat16, torch.device("cuda"), 0, 1)
    assert tokens * bytes_per_token(SMOLLM2, torch.bfloat16) == pytest.approx(0.9 * 130 * GIB, rel=1e-4)


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
