"""Token selection on a model's logits (in fp32), in transformers' order: min-new-tokens, temperature, top-k,
top-p."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from torchspec.request import SamplingParams
from torchspec.transfer import row_index, to_device


def suppress_stop_tokens(
    logits: torch.Tensor,
    rows: Sequence[int] | np.ndarray,
    stop_token_ids: Sequence[Sequence[int]],
    when: torch.Tensor | None = None,
) -> None:
    """Forbid each listed row's stop tokens (in place): the row has not reached ``min_new_tokens`` yet (or, with
    ``when``, a device bool per listed row, only the rows where it holds: the host cannot tell yet).
    One indexed write for all rows (a write per row costs a launch each: milliseconds for a large batch), its
    indices built without a Python loop per row. The value is a device tensor: a Python float assigned
    through an index is copied from pageable host memory, which makes the host wait for the whole stream
    (measured: 4 ms of a 12 ms W1 step on the H200)."""
    lengths = np.fromiter(map(len, stop_token_ids), dtype=np.int64, count=len(stop_token_ids))
    total = int(lengths.sum())
    if total:
        row_indices = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
        token_indices = np.fromiter(itertools.chain.from_iterable(stop_token_ids), dtype=np.int64, count=total)
        index = to_device(np.stack([row_indices, token_indices]), logits.device).unbind(0)
        forbidden = logits.new_full((total,), float("-inf"))
        if when is not None:
            which = to_device(np.repeat(np.arange(len(lengths)), lengths), logits.device)
            forbidden = torch.where(when[which], forbidden, logits[index])
        logits.index_put_(index, forbidden)


def warp_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
    sorted_descending: bool = False,
) -> torch.Tensor:
    """Per-row temperature, top-k (0 = off) and top-p, exactly as transformers' warpers compute them.

    ``logits`` is ``[R, V]`` in any float dtype (a bf16 model's own logits: no fp32 copy first); the result is
    fp32, each entry ``logits / temperature`` as transformers computes it on fp32 logits (a bf16 value widens
    exactly). The parameters are ``[R]``. Filtered entries become ``-inf``. ``top_p``
    should be float64: transformers forms the cut-off ``1 - top_p`` from a Python float and only then
    rounds it to fp32, and a cut-off rounded differently drops different tokens at the boundary. Rows with
    ``top_p == 1`` skip top-p entirely, as in transformers. ``None`` skips a filter for every row (no full
    sort of the vocabulary for it: the common case, and two sorts of ``[256, V]`` cost more than the forward
    of a small model). ``max_top_k``: at least every row's top_k (0: none filters), known on the host, so each
    row's threshold (its k-th largest logit, transformers' cut-off) comes from one ``topk`` of that width
    instead of a sort of the vocabulary (transformers' default top_k=50 against a 49K vocabulary). The ``topk``
    reads the logits as given, before the temperature: dividing by a positive temperature keeps the order, so
    the k-th largest scaled logit is the scaled k-th largest, and a bf16 ``topk`` takes half the radix passes
    of an fp32 one. ``sorted_descending``: the rows are in descending order already (the values of a vocabulary
    top-k, as a draft warps over its support), so that ``topk`` is not needed.
    """
    vocab_size = logits.shape[-1]
    scaled = logits / temperature[:, None]
    if top_k is not None and max_top_k > 0:
        width = min(max_top_k, vocab_size)
        k = top_k.clamp(max=width)
        largest = logits if sorted_descending else logits.topk(width, dim=-1).values  # descending
        kth_largest = largest.gather(1, (k - 1).clamp(min=0)[:, None]) / temperature[:, None]
        kth_largest = torch.where(k[:, None] > 0, kth_largest, float("-inf"))  # top_k = 0: nothing filtered
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if top_p is None:
        return scaled
    ascending, order = scaled.sort(dim=-1, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    cutoff = (1 - top_p.double()).to(cumulative.dtype)
    remove_sorted = (cumulative <= cutoff[:, None]) & (top_p < 1)[:, None]
    remove_sorted[:, -1] = False  # always keep the most likely token
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


def warped_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], owner: np.ndarray | None = None
) -> torch.Tensor:
    """Softmax of transformers-warped logits (``[R, V]``, any float dtype; fp32 probabilities), row ``r``
    warped by ``params[owner[r]]`` (``owner`` None: ``params[r]``); the per-row parameters are gathered with
    NumPy, not a loop per row."""
    owner = np.arange(len(params)) if owner is None else owner
    column = lambda values, dtype: np.fromiter(values, dtype, len(params))[owner]  # noqa: E731
    as_tensor = lambda values, dtype: to_device(values, logits.device, dtype)  # noqa: E731
    top_k = column((p.top_k for p in params), np.int64)
    top_p = column((p.top_p for p in params), np.float64)
    warped = warp_logits(
        logits,
        as_tensor(column((p.temperature for p in params), np.float64), torch.float32),
        as_tensor(top_k, torch.int64) if top_k.any() else None,
        as_tensor(top_p, torch.float64) if (top_p < 1).any() else None,
        max_top_k=int(top_k.max(initial=0)),
    )
    return warped.softmax(dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` (``[R, V]``, any float dtype): argmax for greedy rows, multinomial otherwise."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = row_index(sampled_rows, logits.device)
        probs = warped_probs(logits[rows], [params[row] for row in sampled_rows])
        tokens[rows] = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    return tokens
