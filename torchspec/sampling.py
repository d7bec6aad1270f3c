"""Token selection on a model's logits (in fp32), in transformers' order: repetition penalty (penalty.py),
min-new-tokens, temperature, top-k, top-p, min-p."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from operator import attrgetter
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from attention.reference import residual_weights
from torchspec.request import SamplingParams
from torchspec.transfer import row_index, to_device

#: An op set's ``top_k_positions`` (see ``attention.reference``): the positions of each row's k largest entries.
TopK = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


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


def padded_stop_ids(params: Sequence[SamplingParams]) -> np.ndarray:
    """``[R, S]`` int64: each row's stop ids, padded by repeating its first (zeros for a row without any; S >= 1):
    a fixed-width column that a gather and a scatter of the logits forbid, or leave, in one op each."""
    width = max(1, max(len(p.stop_token_ids) for p in params))
    stops = np.zeros((len(params), width), dtype=np.int64)
    for i, p in enumerate(params):
        if p.stop_token_ids:
            stops[i] = p.stop_token_ids[0]
            stops[i, : len(p.stop_token_ids)] = p.stop_token_ids
    return stops


def top_k_cutoff(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    max_top_k: int,
    sorted_descending: bool = False,
    select: TopK | None = None,
) -> torch.Tensor:
    """``[R]`` fp32: each row's top-k cut-off in scaled units, its k-th largest logit over its temperature
    (transformers keeps every scaled logit at or above it, ties included), -inf where ``top_k`` is 0. The k-th
    largest comes from one Top-K of width ``max_top_k`` (see ``warp_logits``): ``torch.topk``'s values, or with
    ``select`` (an op set's ``top_k_positions``, a kernel on the GPU) the least of the row's picks."""
    width = min(max_top_k, logits.shape[-1])
    k = top_k.clamp(max=width)
    if sorted_descending or select is None:
        largest = logits if sorted_descending else logits.topk(width, dim=-1).values  # descending
        kth_largest = largest.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
    else:
        picks = select(logits, k, width).long()
        kth_largest = logits.gather(1, picks.clamp(min=0)).masked_fill(picks < 0, float("inf")).amin(dim=-1)
    return torch.where(k > 0, kth_largest / temperature, float("-inf"))  # top_k = 0: nothing filtered


def warp_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
    sorted_descending: bool = False,
    select: TopK | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row temperature, top-k (0 = off), top-p and min-p (0 = off), exactly as transformers' warpers compute
    them.

    ``logits`` is ``[R, V]`` in any float dtype (a bf16 model's own logits: no fp32 copy first); the result is
    fp32, each entry ``logits / temperature`` as transformers computes it on fp32 logits (a bf16 value widens
    exactly). The parameters are ``[R]``. Filtered entries become ``-inf``. ``top_p``
    should be float64: transformers forms the cut-off ``1 - top_p`` from a Python float and only then
    rounds it to fp32, and a cut-off rounded differently drops different tokens at the boundary. Rows with
    ``top_p == 1`` skip top-p entirely, as in transformers. ``None`` skips a filter for every row (no full
    sort of the vocabulary for it: the common case, and two sorts of ``[256, V]`` cost more than the forward
    of a small model). ``max_top_k``: at least every row's top_k (0: none filters), known on the host, so each
    row's threshold (its k-th largest logit, transformers' cut-off) comes from one Top-K of that width
    (``select``: see ``top_k_cutoff``) instead of a sort of the vocabulary (transformers' default top_k=50 against a 49K
    vocabulary). The Top-K reads the logits as given, before the temperature: dividing by a positive temperature
    keeps the order, so the k-th largest scaled logit is the scaled k-th largest, and a 16-bit search takes half
    the steps of an fp32 one. ``sorted_descending``: the rows are in descending order already (the values of a
    vocabulary top-k, as a draft warps over its support), so that Top-K is not needed. ``min_p`` (fp32, as
    transformers rounds its Python float when it scales the top probability) drops what is less likely than
    min_p times the row's most likely token, after the other filters (transformers' order); its most likely
    token always stays, so transformers' ``min_tokens_to_keep=1`` needs nothing more.
    """
    scaled = logits / temperature[:, None]
    if top_k is not None and max_top_k > 0:
        cutoff = top_k_cutoff(logits, temperature, top_k, max_top_k, sorted_descending, select)
        scaled = scaled.masked_fill(scaled < cutoff[:, None], float("-inf"))
    if top_p is not None:
        ascending, order = scaled.sort(dim=-1, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        cutoff = (1 - top_p.double()).to(cumulative.dtype)
        remove_sorted = (cumulative <= cutoff[:, None]) & (top_p < 1)[:, None]
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    if min_p is not None:
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return scaled


class WarpColumns(NamedTuple):
    """Per-row warper parameters on the device (see ``warp_logits``); a filter no row applies is None."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    max_top_k: int
    min_p: torch.Tensor | None

    def warp(self, logits: torch.Tensor, select: TopK | None = None) -> torch.Tensor:
        return warp_logits(
            logits, self.temperature, self.top_k, self.top_p, self.max_top_k, select=select, min_p=self.min_p
        )


def _warp_columns(params: Sequence[SamplingParams], owner: np.ndarray | None, device: torch.device) -> WarpColumns:
    """The warper columns of rows ``r`` taking ``params[owner[r]]`` (``owner`` None: ``params[r]``), gathered
    with NumPy, not a loop of Python per row."""
    owner = np.arange(len(params)) if owner is None else owner
    column = lambda name, dtype: np.fromiter(map(attrgetter(name), params), dtype, len(params))[owner]  # noqa: E731
    top_k = column("top_k", np.int64)
    top_p = column("top_p", np.float64)
    min_p = column("min_p", np.float64)
    return WarpColumns(
        temperature=to_device(column("temperature", np.float64), device, torch.float32),
        top_k=to_device(top_k, device, torch.int64) if top_k.any() else None,
        top_p=to_device(top_p, device, torch.float64) if (top_p < 1).any() else None,
        max_top_k=int(top_k.max(initial=0)),
        min_p=to_device(min_p, device, torch.float32) if min_p.any() else None,
    )


def warped_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], owner: np.ndarray | None = None
) -> torch.Tensor:
    """Softmax of transformers-warped logits (``[R, V]``, any float dtype; fp32 probabilities), row ``r``
    warped by ``params[owner[r]]`` (``owner`` None: ``params[r]``)."""
    return _warp_columns(params, owner, logits.device).warp(logits).softmax(dim=-1)


class DenseProbs:
    """Warped target distributions as their fp32 probabilities ``[R, V]``: what top-p and min-p need (a sort of
    each row's vocabulary, or its normaliser, decides which tokens it keeps)."""

    def __init__(self, probs: torch.Tensor) -> None:
        self.probs = probs
        self.vocab_size = probs.shape[-1]

    def at(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The probability of ``tokens`` under distribution ``rows`` (same shape)."""
        return self.probs[rows, tokens]

    def sample(
        self,
        rows: torch.Tensor,
        generator: torch.Generator | None,
        minus: torch.Tensor | None = None,
        minus_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A token from each distribution ``rows`` (``[N]``), less row ``minus_rows[i]`` of ``minus`` where given
        (see ``attention.reference.warped_sample``)."""
        probs = self.probs[rows]
        if minus is not None:
            probs = residual_weights(probs, minus, minus_rows)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]


class WarpedLogits:
    """Warped target distributions (temperature and top-k, transformers' rules) kept as the logits they come
    from: ``p(x) = exp(l_x / T - lse)`` where ``l_x / T`` reaches the row's top-k cut-off, else 0. Rejection
    sampling reads p at a few tokens per row (the drafts), and its draws (the correction after a rejection, the
    bonus token, a plain step's token) read each row's logits once in one kernel (``ops.warped_sample``): the fp32
    ``[R, V]`` probabilities of the verify's rows (W1: 450 MB, several passes over it) never exist, nor the
    drawn rows' (a dozen passes over ``[256, V]`` fp32 a step)."""

    def __init__(self, logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor, ops: ModuleType):
        self.logits = logits
        self.temperature = temperature
        self.cutoff = cutoff
        self.vocab_size = logits.shape[-1]
        self._ops = ops

    @functools.cached_property
    def lse(self) -> torch.Tensor:
        """``[R]``: each row's log-normaliser, computed when a probability is first asked for."""
        return self._ops.warped_lse(self.logits, self.temperature, self.cutoff)

    def sample(
        self,
        rows: torch.Tensor,
        generator: torch.Generator | None,
        minus: torch.Tensor | None = None,
        minus_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A token from each distribution ``rows`` (``[N]``), less row ``minus_rows[i]`` of ``minus`` where given
        (see ``attention.reference.warped_sample``), without materialising any row: a Gumbel-max draw under a seed
        taken from ``generator``."""
        seed = torch.randint(1 << 62, (1,), generator=generator, device=self.logits.device)
        lse = None if minus is None else self.lse
        return self._ops.warped_sample(self.logits, rows, self.temperature, self.cutoff, seed, lse, minus, minus_rows)

    def at(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The probability of ``tokens`` under distribution ``rows`` (same shape)."""
        scaled = self.logits[rows, tokens] / self.temperature[rows]
        return torch.where(scaled >= self.cutoff[rows], torch.exp(scaled - self.lse[rows]), 0.0)


def reported_scores(
    logits: torch.Tensor, params: Sequence[SamplingParams], owner: np.ndarray, select: TopK | None = None
) -> torch.Tensor:
    """transformers' ``scores`` of ``logits`` rows (row ``r`` by ``params[owner[r]]``, the stop-token and
    repetition-penalty processors already applied): fp32, and for sampled rows warped as ``generate`` warps them
    (temperature, top-k, top-p, min-p; filtered entries ``-inf``)."""
    scores = logits.to(torch.float32, copy=True)  # written below: never the caller's rows
    sampled = np.flatnonzero(~np.fromiter((params[i].greedy for i in owner.tolist()), bool, owner.size))
    if sampled.size:
        rows = torch.as_tensor(sampled, device=logits.device)
        scores[rows] = _warp_columns(params, owner[sampled], logits.device).warp(logits[rows], select=select)
    return scores


def target_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], owner: np.ndarray | None, ops: ModuleType
) -> DenseProbs | WarpedLogits:
    """The warped target distributions of ``logits`` rows (row ``r`` by ``params[owner[r]]``), as
    ``warped_probs`` computes them: dense where some row filters by top-p or min-p, else kept as the logits with
    one top-k cut-off and one log-normaliser per row (``ops``: the op set whose ``top_k_positions``,
    ``warped_lse`` and ``warped_sample`` compute them and draw from them, see ``attention.reference``)."""
    columns = _warp_columns(params, owner, logits.device)
    if columns.top_p is not None or columns.min_p is not None:
        return DenseProbs(columns.warp(logits, select=ops.top_k_positions).softmax(dim=-1))
    temperature, top_k, max_top_k = columns.temperature, columns.top_k, columns.max_top_k
    cutoff = logits.new_full(logits.shape[:1], float("-inf"), dtype=torch.float32)
    if top_k is not None and max_top_k > 0:
        cutoff = top_k_cutoff(logits, temperature, top_k, max_top_k, select=ops.top_k_positions)
    return WarpedLogits(logits, temperature, cutoff, ops)


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
