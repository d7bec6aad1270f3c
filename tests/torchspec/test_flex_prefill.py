"""``attention_backend="flex"``: prefill chunks through FlexAttention give the reference path's tokens."""

from __future__ import annotations

import pytest
import torch

from attention import flex
from tests.torchspec.conftest import Batch, tiny_spec
from torchspec import sparsespec

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("draft", [None, "pillar_recent"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flex_prefill_gives_the_reference_tokens(arch, draft, monkeypatch):
    """Greedy generation with prompts prefilled in chunks of up to 96 tokens through FlexAttention (the last
    chunk also feeding PillarAttn's verify scores) equals the reference backend token for token, and
    FlexAttention really ran."""
    calls = []
    prefill = flex.prefill_attention
    monkeypatch.setattr(flex, "prefill_attention", lambda *a, **k: calls.append(1) or prefill(*a, **k))
    spec, batch = tiny_spec(arch, 2), Batch((150, 90, 70), seed=6)
    options = {"kv_capacity_tokens": 1024, "k": 4, "min_budget": 8, "max_step_tokens": 96, "draft": draft}
    expected = sparsespec.wrap(spec.build(), attention_backend="reference", **options).generate(
        **batch.kwargs(), max_new_tokens=16, do_sample=False
    )
    actual = sparsespec.wrap(spec.build(), attention_backend="flex", **options).generate(
        **batch.kwargs(), max_new_tokens=16, do_sample=False
    )
    assert torch.equal(expected, actual)
    assert calls, "no step went through FlexAttention"


@pytest.mark.parametrize("window", [None, 100, 300])
def test_block_mask_tiles_cover_every_visible_entry_and_skip_others(window):
    """The KV tiles listed per query tile (built from the packing, not by evaluating the mask densely) include
    every tile holding an entry some query of the tile sees, and skip most others; the tiles listed as full
    (no mask evaluation on the GPU) hold only entries every query of the tile sees. A wrong list would be
    silently wrong on the GPU only (the CPU path evaluates the mask densely), so this checks it tile by tile.
    The mask is built once per step: the next layer's call with the same metadata gets the same object."""
    q_lens, kv_lens = torch.tensor([300, 5, 200, 500, 700]), torch.tensor([300, 900, 450, 500, 1000])
    cu_seqlens_q = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0))
    kv_indptr = torch.nn.functional.pad(kv_lens.cumsum(0), (1, 0))
    num_tokens, num_entries = int(q_lens.sum()), int(kv_lens.sum())
    mask = flex._block_mask(cu_seqlens_q, kv_indptr, window, num_tokens, num_entries)
    assert flex._block_mask(cu_seqlens_q, kv_indptr, window, num_tokens, num_entries) is mask
    q_index, kv_index = torch.arange(num_tokens)[:, None], torch.arange(num_entries)[None, :]
    dense = mask.mask_mod(0, 0, q_index, kv_index)  # [tokens, entries]
    size = flex.BLOCK_SIZE
    tiles = -(-num_tokens // size), -(-num_entries // size)
    some, every = (torch.full((tiles[0] * size, tiles[1] * size), fill) for fill in (False, True))
    some[:num_tokens, :num_entries] = dense
    every[:num_tokens, :num_entries] = dense
    every[:num_tokens, num_entries:] = False  # a full tile must not reach past the entries
    needed = some.view(tiles[0], size, tiles[1], size).any(dim=3).any(dim=1)
    all_seen = every.view(tiles[0], size, tiles[1], size).all(dim=3).all(dim=1)

    def listed(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros(tiles, dtype=torch.bool)
        for q_tile in range(tiles[0]):
            count = int(counts[0, 0, q_tile])
            assert len(set(indices[0, 0, q_tile, :count].tolist())) == count, "a tile listed twice"
            chosen[q_tile, indices[0, 0, q_tile, :count].long()] = True
        return chosen

    partial = listed(mask.kv_num_blocks, mask.kv_indices)
    full = listed(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any(), "a tile listed as both partial and full"
    assert bool((full <= all_seen).all()), "a tile listed as full holds an entry some query must not see"
    assert bool((partial | full | ~needed).all()), "a tile with visible entries is not listed"
    assert int((partial | full).sum()) <= int(needed.sum()) + tiles[0], "tiles listed far beyond the visible ones"
    assert int(full.sum()) >= int(all_seen.sum()) // 2, "most all-visible tiles should be listed as full"
