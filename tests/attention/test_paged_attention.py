"""Tests of both attention implementations (the plain-PyTorch reference and the Triton kernels) against
dense ``scaled_dot_product_attention``.

Without CUDA the Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set in
``tests/conftest.py``); with CUDA they run on the GPU (inputs moved there, fp32 compared at the same
tolerances because fp32 products are computed in IEEE precision, not TF32).

Every expected value is built independently of the op under test: K/V are kept as dense per-request tensors
(ordered by position), written into a larger pool at scattered slots with ``store_kv``, and the expectation is
dense SDPA over the repeat-interleaved K/V with an explicit boolean position mask; the expected log-sum-exp is
``torch.logsumexp`` of the scaled, masked logits.
"""

from __future__ import annotations

import copy
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from attention import flex, paged, reference
from attention.reference import FirstLists, store_kv
from tests.conftest import triton_specialization

pytestmark = pytest.mark.usefixtures("single_thread")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_kernel_device(function):
    """``function`` run on the kernel device with CPU tensors in and out (keyword tensors it writes included)."""

    def run(*args, **kwargs):
        def move(x):
            return x.to(KERNEL_DEVICE) if isinstance(x, torch.Tensor) else x

        def move_tuple(v: tuple) -> tuple:  # a NamedTuple such as FirstLists keeps its type
            return type(v)(*map(move, v)) if hasattr(v, "_fields") else tuple(map(move, v))

        moved = {k: move_tuple(v) if isinstance(v, tuple) else move(v) for k, v in kwargs.items()}
        result = function(*(move(a) for a in args), **moved)
        for name, value in kwargs.items():  # outputs written in place (the verify mass) come back to their tensor
            if isinstance(value, torch.Tensor) and moved[name] is not value:
                value.copy_(moved[name])
        return tuple(r.cpu() for r in result) if isinstance(result, tuple) else result.cpu()

    return run


IMPLEMENTATIONS = {
    "reference": reference.paged_attention,
    "triton": _on_kernel_device(paged.paged_attention),
}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def impl(request):
    """``paged_attention`` of each implementation."""
    return IMPLEMENTATIONS[request.param]


ATOL = 1e-5
RTOL = 1e-5
NUM_KV_HEADS = 2


def _position_mask(q_len: int, kv_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """``[q_len, kv_len]``: query at position ``p`` sees positions ``p - w + 1 .. p`` (all ``<= p`` if no window)."""
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for i in range(q_len):
        p = kv_len - q_len + i
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        mask[i, lo : p + 1] = True
    return mask


def _dense_expected(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense reference for one request: ``q`` ``[Lq, H, D]``, ``k``/``v`` ``[L, Hkv, D]``, ``mask`` ``[Lq, L]``.

    Returns the output ``[Lq, H, D]`` (zeros where a query sees nothing) and the lse ``[Lq, H]``.
    """
    q_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros(q_len, num_heads, head_dim), torch.full((q_len, num_heads), -math.inf)
    k_rep = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v_rep = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qh = q.transpose(0, 1)  # [H, Lq, D]
    out = F.scaled_dot_product_attention(qh[None], k_rep[None], v_rep[None], attn_mask=mask, scale=scale)[0]
    sees_any = mask.any(dim=-1)  # [Lq]
    out = torch.where(sees_any[None, :, None], out, torch.zeros_like(out)).transpose(0, 1)
    logits = torch.einsum("hqd,hkd->hqk", qh, k_rep) * scale
    lse = torch.logsumexp(logits.masked_fill(~mask, -math.inf), dim=-1).transpose(0, 1)
    return out, lse


class _Batch:
    """A packed batch: dense per-request K/V stored at scattered, permuted slots of a larger garbage-filled pool."""

    def __init__(
        self,
        lens: list[tuple[int, int]],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        seed: int = 0,
        pool_factor: int = 3,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lens = lens
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        total_kv = sum(kv for _, kv in lens)
        num_slots = max(4, pool_factor * total_kv)
        # Garbage in every slot, so that reading a wrong slot cannot go unnoticed.
        self.k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g) * 3
        self.v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g) * 3
        perm = torch.randperm(num_slots, generator=g)
        self.keys, self.values, self.queries, self.slots = [], [], [], []
        offset = 0
        for q_len, kv_len in lens:
            self.keys.append(torch.randn(kv_len, num_kv_heads, head_dim, generator=g))
            self.values.append(torch.randn(kv_len, num_kv_heads, head_dim, generator=g))
            self.queries.append(torch.randn(q_len, num_heads, head_dim, generator=g))
            self.slots.append(perm[offset : offset + kv_len].clone())  # slot of position i
            offset += kv_len
        store_kv(self.k_cache, self.v_cache, torch.cat(self.keys), torch.cat(self.values), torch.cat(self.slots))
        self.query = torch.cat(self.queries)
        self.cu_seqlens_q = torch.tensor([0, *torch.tensor([q for q, _ in lens]).cumsum(0).tolist()])

    def run(self, impl, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sliding_window: int | None = None, **hints):
        return impl(
            self.query,
            self.k_cache,
            self.v_cache,
            self.cu_seqlens_q,
            kv_indptr,
            kv_indices,
            self.scale,
            sliding_window=sliding_window,
            **hints,
        )

    def shared_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One list for all KV heads: each request's slots in position order."""
        indptr = torch.tensor([0, *torch.tensor([kv for _, kv in self.lens]).cumsum(0).tolist()])
        return indptr, torch.cat(self.slots)

    def expected_shared(self, sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses = [], []
        for (q_len, kv_len), q, k, v in zip(self.lens, self.queries, self.keys, self.values, strict=True):
            mask = _position_mask(q_len, kv_len, sliding_window)
            out, lse = _dense_expected(q, k, v, mask, self.scale)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


def _check(actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    out, lse = actual
    exp_out, exp_lse = expected
    assert out.shape == exp_out.shape and out.dtype == exp_out.dtype
    assert lse.shape == exp_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out, exp_out, atol=ATOL, rtol=RTOL)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(exp_lse))
    torch.testing.assert_close(lse, exp_lse, atol=ATOL, rtol=RTOL)


SCENARIOS = {
    # (q_len, kv_len) per request
    "decode": [(1, 1), (1, 7), (1, 13)],
    "verify": [(5, 12), (5, 5)],
    "prefill_chunk": [(4, 20), (6, 6)],  # a later chunk after 16 earlier tokens; a first chunk
    "mixed": [(1, 9), (5, 14), (3, 3), (1, 1), (6, 17)],
    # Lists over several 64/128-entry blocks, the first query's causal edge just before, on and after a block
    # boundary: the kernel reads whole visible blocks without masks and must mask exactly the rest.
    "long_lists": [(1, 200), (5, 131), (5, 132), (9, 136), (9, 137), (5, 67), (5, 68), (1, 129)],
}


def test_store_kv_writes_only_the_given_slots():
    """store_kv puts token t's K/V at slot_mapping[t], converts to the cache dtype and leaves other slots intact."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(10, 2, 4, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(10, 2, 4, generator=g).to(torch.bfloat16)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    slots = torch.tensor([7, 2, 5])
    store_kv(k_cache, v_cache, key, value, slots)
    assert k_cache.dtype == torch.bfloat16 and v_cache.dtype == torch.bfloat16
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s], key[t].to(torch.bfloat16))
        assert torch.equal(v_cache[s], value[t].to(torch.bfloat16))
    untouched = [s for s in range(10) if s not in slots.tolist()]
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa_ratio", [1, 3, 4, 8])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_shared_lists_match_sdpa(scenario, gqa_ratio, head_dim, impl):
    """Decode, verify (q_len 5), prefill chunks, mixed packed batches and lists over several blocks, for GQA
    ratios 1/3/4/8, head_dim 64/128.

    Protects the gather by scattered slots, the causal offset of multi-token queries, the GQA head grouping
    (query head h uses KV head h // ratio) and the per-request packing.
    """
    batch = _Batch(SCENARIOS[scenario], NUM_KV_HEADS * gqa_ratio, NUM_KV_HEADS, head_dim, seed=gqa_ratio + head_dim)
    _check(batch.run(impl, *batch.shared_lists()), batch.expected_shared())


@pytest.mark.parametrize("window", [1, 2, 5, 16, 100])
def test_sliding_window_matches_sdpa(window, impl):
    """A sliding window w lets query position p see exactly positions p-w+1..p (w >= kv_len means no window)."""
    batch = _Batch(SCENARIOS["mixed"], 8, NUM_KV_HEADS, 64, seed=window)
    _check(batch.run(impl, *batch.shared_lists(), sliding_window=window), batch.expected_shared(window))


def test_empty_and_length_one_lists(impl):
    """A request with an empty list outputs zeros with lse -inf; a length-1 list outputs that V (lse = scaled q.k).

    The neighbouring requests in the same packed batch must not be disturbed.
    """
    lens = [(1, 0), (1, 1), (3, 8), (2, 0), (1, 1)]
    batch = _Batch(lens, 6, NUM_KV_HEADS, 64, seed=3)
    out, lse = batch.run(impl, *batch.shared_lists())
    _check((out, lse), batch.expected_shared())
    # Explicit checks of the two edge cases, independent of SDPA.
    assert torch.equal(out[0], torch.zeros(6, 64)) and torch.isneginf(lse[0]).all()
    assert torch.equal(out[5:7], torch.zeros(2, 6, 64)) and torch.isneginf(lse[5:7]).all()
    v = batch.values[1][0].repeat_interleave(3, dim=0)  # [H, D]
    k = batch.keys[1][0].repeat_interleave(3, dim=0)
    torch.testing.assert_close(out[1], v, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse[1], (batch.queries[1][0] * k).sum(-1) * batch.scale, atol=ATOL, rtol=RTOL)


def _per_head_lists(
    batch: _Batch, keep: list[list[torch.Tensor]], num_padding: list[int], g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head lists from ``keep[b][h]`` (sorted positions), each head padded with -1 to a common length.

    Padding entries go at random places among the context entries (never among the last q_len, which must be
    the request's own query tokens). Returns ``kv_indptr`` and ``kv_indices`` ``[Hkv, N]``.
    """
    rows: list[list[int]] = [[] for _ in range(batch.num_kv_heads)]
    indptr = [0]
    for b, (q_len, _) in enumerate(batch.lens):
        length = max(len(p) for p in keep[b]) + num_padding[b]
        for h, positions in enumerate(keep[b]):
            slots = batch.slots[b][positions].tolist()
            context, own = slots[: len(slots) - q_len], slots[len(slots) - q_len :]
            for _ in range(length - len(slots)):
                at = int(torch.randint(0, len(context) + 1, (1,), generator=g))
                context.insert(at, -1)
            rows[h].extend(context + own)
        indptr.append(indptr[-1] + length)
    return torch.tensor(indptr), torch.tensor(rows)


def _expected_per_head(batch: _Batch, keep: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each KV head separately: dense SDPA of its query-head group over that head's kept positions only."""
    group = batch.num_heads // batch.num_kv_heads
    outs, lses = [], []
    for b, (q_len, kv_len) in enumerate(batch.lens):
        out = torch.zeros(q_len, batch.num_heads, batch.head_dim)
        lse = torch.full((q_len, batch.num_heads), -math.inf)
        for h in range(batch.num_kv_heads):
            positions = keep[b][h]
            heads = slice(h * group, (h + 1) * group)
            q_pos = torch.arange(kv_len - q_len, kv_len)
            mask = positions[None, :] <= q_pos[:, None]
            k = batch.keys[b][positions, h : h + 1]
            v = batch.values[b][positions, h : h + 1]
            out[:, heads], lse[:, heads] = _dense_expected(batch.queries[b][:, heads], k, v, mask, batch.scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _random_subsets(batch: _Batch, sizes: list[list[int]], g: torch.Generator) -> list[list[torch.Tensor]]:
    """For request b and head h: ``sizes[b][h]`` random context positions plus the request's own query positions."""
    keep = []
    for b, (q_len, kv_len) in enumerate(batch.lens):
        per_head = []
        for h in range(batch.num_kv_heads):
            ctx = kv_len - q_len
            chosen = torch.randperm(ctx, generator=g)[: sizes[b][h]].sort().values
            per_head.append(torch.cat([chosen, torch.arange(ctx, kv_len)]))
        keep.append(per_head)
    return keep


@pytest.mark.parametrize("gqa_ratio", [1, 4])
def test_per_head_lists_match_per_head_sdpa(gqa_ratio, impl):
    """Per-KV-head lists ([Hkv, N]) with a different subset per head: each head attends only to its own subset."""
    g = torch.Generator().manual_seed(10 + gqa_ratio)
    batch = _Batch([(1, 12), (5, 15), (3, 9)], 3 * gqa_ratio, 3, 64, seed=gqa_ratio)
    keep = _random_subsets(batch, [[6, 6, 6], [4, 4, 4], [5, 5, 5]], g)
    # The subsets must really differ between heads for this test to mean anything.
    assert not all(torch.equal(keep[0][0], keep[0][h]) for h in range(3))
    indptr, indices = _per_head_lists(batch, keep, [0, 0, 0], g)
    assert indices.shape == (3, int(indptr[-1]))
    _check(batch.run(impl, indptr, indices), _expected_per_head(batch, keep))


@pytest.mark.parametrize("gqa_ratio", [1, 3])
def test_per_head_lists_with_padding(gqa_ratio, impl):
    """Padding slots (-1) in per-head lists are skipped; heads of unequal true length share one padded length
    (the last two requests' lists span several blocks, padding inside whole blocks)."""
    g = torch.Generator().manual_seed(20 + gqa_ratio)
    batch = _Batch([(1, 14), (5, 16), (1, 6), (2, 10), (1, 300), (5, 260)], 3 * gqa_ratio, 3, 64, seed=gqa_ratio)
    sizes = [[10, 3, 7], [2, 8, 5], [0, 5, 2], [8, 1, 4], [150, 90, 200], [140, 60, 100]]
    keep = _random_subsets(batch, sizes, g)
    indptr, indices = _per_head_lists(batch, keep, [2, 0, 1, 3, 20, 5], g)
    assert (indices == -1).any()
    _check(batch.run(impl, indptr, indices), _expected_per_head(batch, keep))


def test_the_reference_attends_requests_of_a_shape_together():
    """The reference attends requests of the same query count and scored queries, whose lists are within twice
    each other's length, in one pass (lists padded to the longest), in runs whose padded logits and gathered K/V
    stay within ``REFERENCE_CHUNK_ELEMENTS``; requests that see nothing are left out."""
    q_lens = [1, 1, 9, 1, 9, 1, 0, 9]
    kv_lens = [30, 50, 60, 64, 70, 65, 10, 0]
    scored = [0, 0, 9, 0, 4, 0, 0, 9]
    runs = list(reference._runs(q_lens, kv_lens, scored, num_heads=6, kv_row=2))
    assert sorted(runs) == [(1, 0, [0]), (1, 0, [1, 3]), (1, 0, [5]), (9, 4, [4]), (9, 9, [2])]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "REFERENCE_CHUNK_ELEMENTS", 6 * 64)  # the logits of one decode of a list of 64
        assert [r for r in reference._runs(q_lens, kv_lens, scored, 6, kv_row=2) if r[0] == 1] == [
            (1, 0, [0]), (1, 0, [1]), (1, 0, [3]), (1, 0, [5])
        ]  # fmt: skip
        # The gathered K/V bound a run too: 2 x 2 KV heads x 64 elements a list entry.
        assert [r for r in reference._runs(q_lens, kv_lens, scored, 6, kv_row=256) if r[0] == 1] == [
            (1, 0, [0]), (1, 0, [1]), (1, 0, [3]), (1, 0, [5])
        ]  # fmt: skip
        patch.setattr(reference, "REFERENCE_CHUNK_ELEMENTS", 256 * 64 * 2)  # two such requests
        assert [r for r in reference._runs(q_lens, kv_lens, scored, 6, kv_row=256) if r[0] == 1] == [
            (1, 0, [0]), (1, 0, [1, 3]), (1, 0, [5])
        ]  # fmt: skip


@pytest.mark.parametrize("limit", [1, 40_000])
def test_runs_of_requests_give_what_one_pass_gives(monkeypatch, limit):
    """However the reference's runs split a batch (limit 1: a request a run; 40,000: a few), outputs, log-sum-exps
    and the verify mass equal one pass's up to rounding (a padded product may round a row's last bit otherwise)
    and the dense expectation, with shared lists (mass scored, requests of equal shapes) and per-head lists."""
    lens = [(9, 70), (1, 20), (9, 9), (5, 130), (40, 200), (1, 3), (1, 30), (1, 30), (1, 40), (9, 50), (9, 60)]
    scored = torch.tensor([9, 0, 4, 2, 5, 1, 0, 1, 0, 9, 9])
    batch = _Batch(lens, 6, 2, 64, seed=3)
    keep = _random_subsets(batch, [[kv // 2, kv // 3] for _, kv in lens], torch.Generator().manual_seed(3))
    per_head = _per_head_lists(batch, keep, [1, 0, 2, 0, 3, 1, 0, 1, 2, 0, 1], torch.Generator().manual_seed(4))

    def attend() -> tuple[torch.Tensor, ...]:
        mass = torch.full((2, len(lens), 208), 7.0, dtype=reference.MASS_DTYPE)
        shared = batch.run(reference.paged_attention, *batch.shared_lists(), mass=mass, num_scored_queries=scored)
        return *shared, mass, *batch.run(reference.paged_attention, *per_head)

    one_pass = attend()
    monkeypatch.setattr(reference, "REFERENCE_CHUNK_ELEMENTS", limit)
    runs = []
    attend_run = reference._attend
    monkeypatch.setattr(reference, "_attend", lambda *args: runs.append(args[3]) or attend_run(*args))
    in_runs = attend()
    assert len(runs) == 2 * len(lens) if limit == 1 else 2 * 5 < len(runs) < 2 * len(lens)
    for actual, expected in zip(in_runs, one_pass, strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    _check(one_pass[:2], batch.expected_shared())
    _check(one_pass[3:], _expected_per_head(batch, keep))
    written = torch.zeros_like(one_pass[2], dtype=torch.bool)
    for b, ((_, kv_len), count) in enumerate(zip(lens, scored.tolist(), strict=True)):
        written[:, b, :kv_len] = count > 0
    torch.testing.assert_close(
        one_pass[2].float()[written], _expected_mass(batch, scored.tolist(), 208)[written], atol=1e-6, rtol=8e-3
    )
    assert (one_pass[2][~written] == 7).all()


def test_per_head_list_all_padding_gives_zero_output(impl):
    """A decode head whose list is only padding outputs zeros with lse -inf; the other heads are unaffected."""
    batch = _Batch([(1, 5)], 4, 2, 64, seed=5)
    slots = batch.slots[0].tolist()
    indices = torch.tensor([slots, [-1] * 5])
    out, lse = batch.run(impl, torch.tensor([0, 5]), indices)
    assert torch.equal(out[:, 2:], torch.zeros(1, 2, 64)) and torch.isneginf(lse[:, 2:]).all()
    exp_out, exp_lse = _dense_expected(
        batch.queries[0][:, :2], batch.keys[0][:, :1], batch.values[0][:, :1], _position_mask(1, 5), batch.scale
    )
    torch.testing.assert_close(out[:, :2], exp_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse[:, :2], exp_lse, atol=ATOL, rtol=RTOL)


def test_per_head_lists_empty_request(impl):
    """Per-head lists with an empty request in the middle: zeros and lse -inf for it, neighbours unaffected."""
    batch = _Batch([(1, 8), (1, 0), (3, 7)], 4, 2, 64, seed=30)
    keep = [
        [torch.tensor([0, 2, 3, 7]), torch.tensor([1, 5, 6, 7])],
        [torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)],
        [torch.tensor([1, 4, 5, 6]), torch.tensor([0, 4, 5, 6])],
    ]
    rows = [[], []]
    for b in range(3):
        for h in range(2):
            rows[h].extend(batch.slots[b][keep[b][h]].tolist())
    indptr = torch.tensor([0, 4, 4, 8])
    _check(batch.run(impl, indptr, torch.tensor(rows)), _expected_per_head(batch, keep))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_dtype_follows_query(impl, dtype):
    """Half-precision queries/caches give an output in the query dtype and an fp32 lse close to the fp32 result."""
    if impl is IMPLEMENTATIONS["triton"] and KERNEL_DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's CPU interpreter computes with numpy, which has no bfloat16 (fp16 is covered)")
    batch = _Batch(SCENARIOS["mixed"], 8, NUM_KV_HEADS, 64, seed=7)
    indptr, indices = batch.shared_lists()
    out, lse = impl(
        batch.query.to(dtype),
        batch.k_cache.to(dtype),
        batch.v_cache.to(dtype),
        batch.cu_seqlens_q,
        indptr,
        indices,
        batch.scale,
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    exp_out, exp_lse = batch.expected_shared()
    torch.testing.assert_close(out.float(), exp_out, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(lse, exp_lse, atol=5e-2, rtol=5e-2)


def test_heads_not_divisible_by_kv_heads_raise(impl):
    """A query head count that is not a multiple of the KV head count is rejected."""
    batch = _Batch([(1, 3)], 4, 2, 64, seed=0)
    with pytest.raises(ValueError):
        impl(torch.randn(1, 3, 64), batch.k_cache, batch.v_cache, batch.cu_seqlens_q, *batch.shared_lists(), 0.125)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("window", [None, 100])
def test_split_kv_matches_one_pass(num_splits, window):
    """Flash-decoding splits (multiples of 64 entries, some empty when there are more splits than blocks) merged
    by their LSE give the unsplit result, for lists just above and below the split boundaries."""
    batch = _Batch([(1, 300), (1, 129), (1, 64), (1, 65), (5, 200), (1, 1)], 6, 2, 64, seed=num_splits)
    expected = batch.expected_shared(window)
    _check(batch.run(IMPLEMENTATIONS["triton"], *batch.shared_lists(), window, num_splits=num_splits), expected)


def test_a_forced_split_count_reaches_every_launch(monkeypatch):
    """``num_splits`` (the kernel benchmark's ``--splits``) replaces the planner's split count: the launch is
    split 3 ways and the merge combines 3 partial results, and the output is still the unsplit one."""
    batch = _Batch([(1, 300), (5, 200)], 6, 2, 64, seed=5)
    merges = []
    merge = paged._merge_splits_kernel
    monkeypatch.setattr(paged, "_merge_splits_kernel", _Recording(merge, merges))
    result = batch.run(IMPLEMENTATIONS["triton"], *batch.shared_lists(), None, num_splits=3)
    _check(result, batch.expected_shared(None))
    values = dict(zip(merge.arg_names, merges[0][0], strict=False))
    assert (values["splits_first"], values["splits_second"]) == (3, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="models the specialization of interpreted launches")
def test_a_configuration_compiles_once_whatever_wave_it_is_planned_for(monkeypatch):
    """On a GPU the planner compiles a kernel configuration with the nominal wave (528 programs) only to read how
    many of its programs the GPU holds at once, then launches it with that count (396 where 3 fit each of 132
    SMs): the count is left unspecialised, so both launches are one compiled variant of each kernel. Specialised
    on being a multiple of 16, it made a second: W1 on an H100 compiled the attention kernel 4 s mid-run."""
    launches = {"_attention_kernel": [], "_merge_splits_kernel": []}
    for name, calls in launches.items():
        monkeypatch.setattr(paged, name, _Recording(getattr(paged, name), calls))
    batch = _Batch([(1, 300), (5, 200)], 6, 2, 64, seed=5)
    for resident in (528, 396):
        monkeypatch.setattr(paged, "NOMINAL_RESIDENT_PROGRAMS", resident)
        _check(batch.run(IMPLEMENTATIONS["triton"], *batch.shared_lists(), None, num_splits=3), batch.expected_shared())
    for name, calls in launches.items():
        kernel = getattr(paged, name).kernel
        assert len(calls) == 2 and len({triton_specialization(kernel, *call) for call in calls}) == 1, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="resident programs are read from a GPU binary")
def test_the_planner_reads_resident_programs_from_the_compiled_kernel():
    """On a GPU the first launch of a kernel configuration compiles it and records how many of its programs the
    GPU holds at once: at least one per SM, at most the 32 per SM the hardware allows."""
    paged._RESIDENT.clear()
    batch = _Batch([(1, 3000), (1, 2000)], 6, 2, 64, seed=6)
    _check(batch.run(IMPLEMENTATIONS["triton"], *batch.shared_lists(), None), batch.expected_shared(None))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert len(paged._RESIDENT) == 1 and sms <= next(iter(paged._RESIDENT.values())) <= 32 * sms


class _Recording:
    """Stands in for a kernel: records each launch's arguments (positional, keyword), then launches the real one."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _fused_batch() -> tuple[_Batch, torch.Tensor, torch.Tensor, FirstLists, tuple, tuple]:
    """Two draft requests (per-head lists) before a verify and a decode (shared lists), and each group's own
    expectation: ``(batch, full_indptr, full_indices, first_lists, expected_drafts, expected_full)``."""
    g = torch.Generator().manual_seed(40)
    batch = _Batch([(1, 40), (1, 17), (9, 300), (1, 200)], 6, 2, 64, seed=40)
    drafts = copy.copy(batch)  # the first two requests only, same pool
    for name in ("lens", "keys", "values", "queries", "slots"):
        setattr(drafts, name, getattr(batch, name)[:2])
    keep = _random_subsets(drafts, [[9, 4], [3, 12]], g)
    draft_indptr, draft_indices = _per_head_lists(drafts, keep, [2, 0], g)
    full_indptr = torch.tensor([0, 300, 500])
    full_indices = torch.cat(batch.slots[2:])
    full_out, full_lse = batch.expected_shared()
    first = FirstLists(2, draft_indptr, draft_indices)
    return batch, full_indptr, full_indices, first, _expected_per_head(drafts, keep), (full_out[2:], full_lse[2:])


def test_fused_draft_and_full_lists_match_separate_calls(impl):
    """``first_lists``: draft requests (first, per-head lists) and verify/decode requests (shared lists) in one
    call give what each group gives on its own: the fused launch changes nothing but the launch count."""
    batch, full_indptr, full_indices, first, expected_drafts, expected_full = _fused_batch()
    out, lse = batch.run(impl, full_indptr, full_indices, first_lists=first)
    draft_part = reference.paged_attention(
        batch.query[:2], batch.k_cache, batch.v_cache, batch.cu_seqlens_q[:3], first.kv_indptr, first.kv_indices,
        batch.scale,
    )  # fmt: skip
    _check(draft_part, expected_drafts)  # the draft requests' own expectation, independent of first_lists
    _check((out[:2], lse[:2]), expected_drafts)
    _check((out[2:], lse[2:]), expected_full)


def test_fused_launch_of_drafts_only(impl):
    """A step of drafts only: every request reads the first lists and the shared set is empty (its code is
    compiled out of the kernel)."""
    batch, _, _, first, expected_drafts, _ = _fused_batch()
    out, lse = impl(
        batch.query[:2], batch.k_cache, batch.v_cache, batch.cu_seqlens_q[:3], torch.zeros(1, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64), batch.scale, max_q_len=0, max_kv_len=0, first_lists=first,
    )  # fmt: skip
    _check((out, lse), expected_drafts)


def _with_hidden_tails(indptr: torch.Tensor, indices: torch.Tensor, extra: int, g: torch.Generator):
    """``indices`` with ``extra`` random pool slots after each request's list, its new indptr, and the ends that
    hide them again."""
    lists = [indices[..., a:b] for a, b in itertools.pairwise(indptr.tolist())]
    tails = [torch.randint(0, int(indices.max()) + 1, (*lst.shape[:-1], extra), generator=g) for lst in lists]
    grown = torch.cat([torch.cat([lst, tail], dim=-1) for lst, tail in zip(lists, tails, strict=True)], dim=-1)
    lengths = torch.tensor([lst.shape[-1] + extra for lst in lists])
    new_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return new_indptr, grown, new_indptr[:-1] + lengths - extra


@pytest.mark.parametrize("num_splits", [None, (2, 3)])
def test_list_ends_read_a_prefix_of_each_list(impl, num_splits):
    """``kv_ends`` (and ``FirstLists.kv_ends``): a request reads its list only up to its end, and the causal mask
    is relative to that end, so entries past it (here, slots of other tokens) change nothing: how a draft round's
    forwards read growing prefixes of one list per request."""
    if num_splits is not None and impl is IMPLEMENTATIONS["reference"]:
        pytest.skip("split counts are a kernel launch choice")
    batch, full_indptr, full_indices, first, expected_drafts, expected_full = _fused_batch()
    g = torch.Generator().manual_seed(41)
    draft_indptr, draft_indices, draft_ends = _with_hidden_tails(first.kv_indptr, first.kv_indices, 7, g)
    indptr, indices, ends = _with_hidden_tails(full_indptr, full_indices, 5, g)
    hints = {} if num_splits is None else {"num_splits": num_splits}
    out, lse = batch.run(
        impl, indptr, indices, kv_ends=ends, first_lists=FirstLists(2, draft_indptr, draft_indices, kv_ends=draft_ends),
        **hints,
    )  # fmt: skip
    _check((out[:2], lse[:2]), expected_drafts)
    _check((out[2:], lse[2:]), expected_full)


@pytest.mark.parametrize("num_splits", [(1, 3), (2, 1), (3, 5)])
def test_fused_list_sets_split_on_their_own(num_splits):
    """Each list set of a fused launch has its own split count: a set that is not split writes the output
    directly and the merge combines only the other set's splits (some of them empty)."""
    batch, full_indptr, full_indices, first, expected_drafts, expected_full = _fused_batch()
    kernel = IMPLEMENTATIONS["triton"]
    out, lse = batch.run(kernel, full_indptr, full_indices, first_lists=first, num_splits=num_splits)
    _check((out[:2], lse[:2]), expected_drafts)
    _check((out[2:], lse[2:]), expected_full)


def _padded_bucket(batch: _Batch, first: FirstLists, full_indptr: torch.Tensor, trailing: int):
    """``_fused_batch``'s launch as a graph's bucket replays it: two padding drafts (a token each, empty lists)
    after its drafts, a padding verify (no token, an empty list) after its others and ``trailing`` tokens of no
    request, every query row of padding filled with garbage. Returns the query, its ``cu_seqlens_q``, the drafts'
    and the others' list offsets and where each real token's row lies in it."""
    g = torch.Generator().manual_seed(42)
    drafts, others = batch.query[:2], batch.query[2:]
    pad = lambda n: torch.randn(n, *batch.query.shape[1:], generator=g) * 100  # noqa: E731
    query = torch.cat([drafts, pad(2), others, pad(trailing)])
    q_lens = [1, 1, 1, 1, *(q for q, _ in batch.lens[2:]), 0]
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    draft_indptr = torch.cat([first.kv_indptr, first.kv_indptr[-1:].repeat(2)])
    indptr = torch.cat([full_indptr, full_indptr[-1:]])
    rows = torch.cat([torch.arange(2), torch.arange(4, 4 + others.shape[0])])
    return query, cu_seqlens_q, draft_indptr, indptr, rows


@pytest.mark.parametrize(("live", "num_splits"), [((2, 2), None), ((2, 2), (1, 2)), ((1, 1), None), ((2, 0), None)])
def test_a_replayed_bucket_splits_its_real_requests_lists_on_the_device(live, num_splits):
    """``live_requests`` (a small graph bucket replayed for fewer requests than it holds): the kernel reads how many
    drafts and others are real, grows the split counts planned for the whole bucket to fill a wave with them (up
    to 64 splits of these short lists, most of them empty) and skips the rest: the real requests' tokens get what
    the unpadded launch gives, every padding or trailing token a zero output and a -inf LSE, whatever garbage its
    query rows hold. With fewer real requests than were filled in, the ones past the count are padding too."""
    batch, full_indptr, full_indices, first, expected_drafts, expected_full = _fused_batch()
    query, cu_seqlens_q, draft_indptr, indptr, rows = _padded_bucket(batch, first, full_indptr, trailing=2)
    hints = {} if num_splits is None else {"num_splits": num_splits}
    out, lse = IMPLEMENTATIONS["triton"](
        query, batch.k_cache, batch.v_cache, cu_seqlens_q, indptr, full_indices, batch.scale,
        first_lists=FirstLists(4, draft_indptr, first.kv_indices), live_requests=torch.tensor(live), **hints,
    )  # fmt: skip
    expected_out, expected_lse = torch.zeros_like(query), torch.full(query.shape[:2], -math.inf)
    other_tokens = [0, 9, 10][live[1]]  # the verify's 9 tokens, then the decode's one
    real = torch.cat([rows[: live[0]], rows[2 : 2 + other_tokens]])
    unpadded = [torch.cat([drafts, others]) for drafts, others in zip(expected_drafts, expected_full, strict=True)]
    expected_out[real], expected_lse[real] = (part[torch.isin(rows, real)] for part in unpadded)
    _check((out, lse), (expected_out, expected_lse))


def _expected_mass(batch: _Batch, scored: list[int], width: int) -> torch.Tensor:
    """Dense verify mass ``[Hkv, requests, width]``: per entry, ``exp(logit - the larger of the first and last
    entries' logits)`` summed over each request's last ``scored`` queries and its group's heads (entries a query
    cannot see weigh 0); zeros elsewhere."""
    group = batch.num_heads // batch.num_kv_heads
    expected = torch.zeros(batch.num_kv_heads, len(batch.lens), width)
    for b, ((q_len, kv_len), count) in enumerate(zip(batch.lens, scored, strict=True)):
        if count == 0:
            continue
        k = batch.keys[b].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        logits = torch.einsum("qhd,hld->hql", batch.queries[b][q_len - count :], k) * batch.scale
        base = torch.maximum(logits[..., :1], logits[..., -1:])  # the first and last entries' (all unmasked)
        weights = (logits - base).exp().masked_fill(~_position_mask(q_len, kv_len)[q_len - count :], 0)
        expected[:, b, :kv_len] = weights.reshape(batch.num_kv_heads, group, count, kv_len).sum(dim=(1, 2))
    return expected


@pytest.mark.parametrize("gqa_ratio", [1, 3, 4, 8])
def test_verify_mass_weighs_entries_against_the_sink(gqa_ratio, impl):
    """Verify scores, computed in the attention's own pass: per (KV head, request, list entry), the scored queries'
    attention relative to the list's first or last entry (``exp(logit - max(logit_0, logit_last))``), summed
    over a request's last ``num_scored`` queries and its group's heads, in its row of one layer's slab of the
    engine's stacked buffer. Unscored requests, entries past a list and the other slabs keep what they held; the
    attention itself is unchanged. A prefill-sized request (40 queries over several row tiles) scores its last
    queries too."""
    lens = [(9, 70), (1, 20), (9, 9), (5, 130), (40, 200)]
    scored = [min(9, 64 // gqa_ratio), 0, 4, 2, 5]
    batch = _Batch(lens, 2 * gqa_ratio, 2, 64, seed=gqa_ratio)
    stacked = torch.full((3, 2, len(lens), 208), 7.0, dtype=reference.MASS_DTYPE)
    out, lse = batch.run(
        impl,
        *batch.shared_lists(),
        mass=stacked[1],
        num_scored_queries=torch.tensor(scored),
        max_scored_queries=max(scored),
    )
    _check((out, lse), batch.expected_shared())
    mass = stacked[1].float()
    expected = _expected_mass(batch, scored, 208)
    written = torch.zeros_like(mass, dtype=torch.bool)
    for b, ((_, kv_len), count) in enumerate(zip(lens, scored, strict=True)):
        written[:, b, :kv_len] = count > 0
    torch.testing.assert_close(  # bf16: within half a unit in the last place (~4e-3 of the value)
        mass[written], expected[written], atol=1e-6, rtol=8e-3
    )
    assert (mass[~written] == 7).all() and (stacked[[0, 2]] == 7).all()


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_verify_mass_splits_cover_every_entry_once(num_splits):
    """Split lists (some splits empty with 7 of the short lists) write each entry's mass from the one program
    that reads it, as the reference does; drafts in the same launch (first lists) score nothing."""
    batch, full_indptr, full_indices, first, _, expected_full = _fused_batch()
    scored = torch.tensor([9, 0])  # the verify, then the decode
    masses = []
    for function in (reference.paged_attention, IMPLEMENTATIONS["triton"]):
        mass = torch.zeros(2, 2, 304, dtype=reference.MASS_DTYPE)
        hints = {"num_splits": num_splits} if function is IMPLEMENTATIONS["triton"] else {}
        out, lse = batch.run(
            function, full_indptr, full_indices, first_lists=first, mass=mass, num_scored_queries=scored, **hints
        )
        _check((out[2:], lse[2:]), expected_full)
        masses.append(mass.float())
    torch.testing.assert_close(masses[1], masses[0], atol=1e-6, rtol=8e-3)
    assert masses[0][:, 0, :300].min() > 0 and (masses[0][:, 1] == 0).all()


def test_verify_mass_beyond_a_tile_is_refused():
    """More scored (query, head) rows than one row tile holds: a clear error, not a silently partial score."""
    batch = _Batch([(9, 20)], 16, 2, 64)
    with pytest.raises(ValueError, match="score at most 8 queries"):
        batch.run(
            IMPLEMENTATIONS["triton"], *batch.shared_lists(), mass=torch.zeros(2, 1, 32, dtype=reference.MASS_DTYPE),
            num_scored_queries=torch.tensor([9]), max_scored_queries=9,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel benchmark times CUDA graphs")
def test_kernel_benchmark_measures_every_case_of_a_small_point(tmp_path):
    """The benchmark times every case of ours at one small point (no dense baselines asked for) and reports it
    (GPU only)."""
    from benchmarks import kernels

    records = kernels.measure(kernels.Case(kernels.SHAPES["smollm2"], 8, 1024), baselines=False)
    assert {r["case"] for r in records} == set(kernels.OUR_CASES) <= set(kernels.COLUMNS)
    assert all(r["ms"] > 0 and r["bytes"] > 0 for r in records), records
    assert "| smollm2 | 8 | 1024 |" in kernels.report(records)


@pytest.mark.parametrize(
    ("sets", "resident", "expected"),
    [
        # 256 decodes x 3 KV heads, 128 blocks each: 768 programs already fill the 792 an H200 holds: no split
        (((0, 0), (768, 128)), 792, (1, 1)),
        # 32 decodes: 8 splits make 768 programs, one wave of the shortest chunks that fit
        (((0, 0), (96, 128)), 792, (1, 8)),
        # 32 verifies of 4-per-SM programs (528 resident), 64 blocks each: 5 splits (480 programs, one wave),
        # where 6 (576, 1.09 waves) would take two waves of 11-block chunks
        (((0, 0), (96, 64)), 528, (1, 5)),
        # 228 drafts of 7 blocks + 28 verifies of 128: the verify lists are cut into 9 chunks of 15 blocks,
        # and the drafts fill the slots around them
        (((684, 7), (84, 128)), 792, (1, 9)),
        # nothing to read, and a list too long for MAX_SPLITS chunks
        (((0, 0), (0, 0)), 792, (1, 1)),
        (((0, 0), (3, 2**14)), 792, (1, paged.MAX_SPLITS)),
    ],
)
def test_split_counts_fill_whole_waves_of_resident_programs(sets, resident, expected):
    """Lists are cut into chunks of about equal work, as many as fill whole waves of the programs the GPU holds
    at once, so neither a few long lists nor a last, nearly empty wave leaves the GPU idle."""
    assert paged._split_counts(sets, resident, 4, 2) == expected


def test_a_bigger_per_program_cost_plans_fewer_splits():
    """The planner weighs a program's fixed cost against shorter chunks: free programs make two waves of
    6-block chunks (11 splits) beat one wave of 13-block chunks (5 splits); at 2 blocks per program they lose."""
    sets = ((0, 0), (96, 64))
    assert [paged._split_counts(sets, 528, 2, cost)[1] for cost in (0, 2)] == [11, 5]


def test_makespan_schedules_programs_on_the_first_free_slot():
    """Launch order puts the long (second-set) programs first and short ones into the slots left over: 2
    programs of 4 blocks and 10 of 1 on 4 slots end at 5; a launch one program over a wave takes two."""
    assert paged._makespan(((10, 1), (2, 4)), (1, 1), 4, 0) == 5
    assert paged._makespan(((0, 0), (5, 4)), (1, 1), 4, 1) == 2 * (4 + 1)
    assert paged._makespan(((0, 0), (4, 8)), (1, 2), 4, 0) == 2 * 4  # 8 programs of 4 blocks: two whole waves


H200 = SimpleNamespace(
    regs_per_multiprocessor=65536,
    shared_memory_per_multiprocessor=233472,
    max_threads_per_multi_processor=2048,
    multi_processor_count=132,
)


@pytest.mark.parametrize(
    ("registers", "warps", "shared", "resident"),
    [
        (255, 2, 46080, 4 * 132),  # SmolLM2 verify (sm_90 compile): 8 warps' registers, 4 programs
        (152, 2, 20992, 6 * 132),  # SmolLM2 decode: registers allow 6 of 2 warps
        (242, 4, 82432, 2 * 132),  # Qwen3-8B verify: registers and shared memory both allow 2
        (32, 1, 0, 32 * 132),  # a tiny program: the 32-programs-per-SM limit
    ],
)
def test_resident_programs_from_the_compiled_kernel(registers, warps, shared, resident):
    """The occupancy arithmetic on a compiled kernel's registers, warps and shared memory (figures from local
    sm_90 compiles of the real launches)."""
    compiled = SimpleNamespace(n_regs=registers, metadata=SimpleNamespace(num_warps=warps, shared=shared),
                               _init_handles=lambda: None)  # fmt: skip
    assert paged._resident_programs(compiled, H200) == resident


def test_launch_shapes_shrink_to_fit_shared_memory():
    """The pipeline gives up stages, then entries per iteration, until its K/V buffers fit the budget (the H200's
    ~160 KB: fp32 head_dim 128 at 128 entries x 3 stages would need 256 KB); what fits stays as chosen."""
    h200 = 0.7 * 232448
    chosen = paged.LaunchConfig(128, 4, 3)
    assert paged._fit_shared_memory(chosen, 128 * 4, h200) == paged.LaunchConfig(128, 4, 2)  # fp32, head_dim 128
    assert paged._fit_shared_memory(chosen, 128 * 2, h200) == chosen  # bf16 fits
    assert paged._fit_shared_memory(chosen, 128 * 4, 40_000) == paged.LaunchConfig(32, 4, 2)
    assert paged._fit_shared_memory(chosen, 128 * 4, None) == chosen  # the CPU interpreter: no limit


# -- FlexAttention prefill ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("gqa_ratio", [1, 3, 4, 8])
@pytest.mark.parametrize("scenario", ["prefill_chunk", "mixed", "verify"])
def test_flex_prefill_matches_sdpa(scenario, gqa_ratio):
    """FlexAttention over the gathered slot lists with the document mask built from them: the same outputs and
    LSE as dense SDPA for packed chunks (a later chunk over earlier tokens, a first chunk), GQA 1/3/4/8.

    Protects attention/flex.py's mask: a query seeing another request's entries, a later position or, with
    the offset wrong, one position too few changes the outputs."""
    batch = _Batch(SCENARIOS[scenario], NUM_KV_HEADS * gqa_ratio, NUM_KV_HEADS, 64, seed=gqa_ratio)
    _check(batch.run(flex.prefill_attention, *batch.shared_lists()), batch.expected_shared())


@pytest.mark.parametrize("window", [1, 5, 100])
def test_flex_prefill_sliding_window(window):
    batch = _Batch(SCENARIOS["mixed"], 8, NUM_KV_HEADS, 64, seed=window)
    actual = batch.run(flex.prefill_attention, *batch.shared_lists(), sliding_window=window)
    _check(actual, batch.expected_shared(window))


def test_flex_op_set_routes_only_long_shared_queries():
    """``attention_backend="flex"`` sends a call to FlexAttention only for prefill-length queries without draft
    lists; decode, verify and draft calls go to the base kernels."""
    calls = []
    base = SimpleNamespace(**dict.fromkeys(reference.OP_NAMES))  # every op of the set, unused but the attention
    base.paged_attention = lambda *args, **hints: calls.append("base")
    ops = flex.with_flex_prefill(base)
    batch = _Batch([(100, 120)], 4, NUM_KV_HEADS, 16)
    out, _ = batch.run(ops.paged_attention, *batch.shared_lists(), max_q_len=100, max_kv_len=120)
    assert calls == [] and out.shape == batch.query.shape
    batch.run(ops.paged_attention, *batch.shared_lists(), max_q_len=9, max_kv_len=120)
    first = FirstLists(1, *batch.shared_lists())
    batch.run(ops.paged_attention, *batch.shared_lists(), max_q_len=100, max_kv_len=120, first_lists=first)
    assert calls == ["base", "base"]
