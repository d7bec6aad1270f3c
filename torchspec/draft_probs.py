"""The distributions of a round's drafts, kept on the device from the draft steps to the verify.

Rejection sampling needs, at the verify, two things of the distribution q each draft token was drawn from: q at
the draft (the acceptance test) and, after a rejection, the whole q of the rejected draft (the correction draws
from max(p - q, 0)). Each draft forward writes them for all its requests at once (row: the request's slot-table
row; column: the draft's index in its round; ``DraftSampling.select``). A top-k draft's distribution lives on
its support, the ``support`` most likely tokens, so it is kept as those tokens and their probabilities, not as a
row of the vocabulary: W1 (top-k 50 of 49K) wrote and zeroed a ``[256, V]`` fp32 row set every draft forward
(~70 us on an H100, 8 a round) into a 400 MB buffer. Rounds whose requests do not all filter by top-k keep
whole rows (``tokens`` None: entry x is token x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KeptDistributions:
    """``[rows, columns]`` draft distributions: each one's probability of its own draw, and its entries."""

    drawn: torch.Tensor  # [rows, columns] fp32: q at the token the draft drew
    probs: torch.Tensor  # [rows, columns, W] fp32: q at each entry's token (padding: 0)
    tokens: torch.Tensor | None  # [rows, columns, W] int64: each entry's token; None: entry x is token x (W = V)

    @property
    def columns(self) -> int:
        return self.drawn.shape[1]

    def write(
        self,
        rows: torch.Tensor,
        columns: torch.Tensor,
        probs: torch.Tensor,
        tokens: torch.Tensor | None,
        drawn: torch.Tensor,
    ) -> None:
        """Keep distribution ``i`` at (``rows[i]``, ``columns[i]``): ``probs[i]`` over ``tokens[i]`` (``[D, w]``;
        None: the vocabulary) and ``drawn[i]``, the probability of its draw."""
        self.drawn[rows, columns] = drawn
        if self.tokens is not None:  # entries past w hold probability 0 (at token 0)
            missing = self.probs.shape[-1] - probs.shape[-1]
            self.probs[rows, columns] = F.pad(probs, (0, missing)) if missing else probs
            self.tokens[rows, columns] = F.pad(tokens, (0, missing)) if missing else tokens
        elif tokens is None:
            self.probs[rows, columns] = probs
        else:  # a support into whole rows: their zeros, then its probabilities (added: padding repeats token 0)
            self.probs.index_put_((rows, columns), self.probs.new_zeros(()))
            self.probs.index_put_((rows[:, None], columns[:, None], tokens), probs, accumulate=True)

    def dense(self, flat_rows: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Distributions ``flat_rows`` (``[N]``: row * columns + column, -1: none) as ``(rows, index)`` with
        distribution i at ``rows[index[i]]`` (``[., V]`` fp32; index -1 where ``flat_rows`` is): what
        ``ops.warped_sample`` subtracts. Whole rows are read in place; supports are scattered into ``N`` zero rows
        (padding adds 0)."""
        probs = self.probs.flatten(0, 1)
        if self.tokens is None:
            return probs, flat_rows
        taken = flat_rows.clamp(min=0)
        rows = probs.new_zeros(flat_rows.shape[0], vocab_size)
        rows.scatter_add_(1, self.tokens.flatten(0, 1)[taken], probs[taken])
        index = torch.arange(flat_rows.shape[0], device=flat_rows.device)
        return rows, torch.where(flat_rows >= 0, index, -1)


class DraftProbsStore:
    """The ``KeptDistributions`` of ``k`` columns a row, grown on demand: rows double (like the slot table), a
    support widens to what a round draws from (whole rows once a round has no top-k support). A grown store is
    a new object (a captured graph holds the old one's tensors)."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.k = k
        self.device = device
        self.kept: KeptDistributions | None = None

    def reserve(self, rows: int, vocab_size: int, support: int | None) -> KeptDistributions:
        """Room for ``rows`` rows of distributions over ``support`` tokens (None: the vocabulary); what the store
        held is kept."""
        kept = self.kept
        whole = support is None or support >= vocab_size or (kept is not None and kept.tokens is None)
        width = vocab_size if whole else max(support, 0 if kept is None else kept.probs.shape[-1])
        if kept is not None and rows <= kept.drawn.shape[0] and width == kept.probs.shape[-1]:
            return kept
        held = 0 if kept is None else kept.drawn.shape[0]
        size = max(8, rows, 2 * held) if rows > held else held
        grown = KeptDistributions(
            drawn=torch.zeros(size, self.k, device=self.device),
            probs=torch.zeros(size, self.k, width, device=self.device),
            tokens=None if whole else torch.zeros(size, self.k, width, dtype=torch.int64, device=self.device),
        )
        if kept is not None:
            index = torch.arange(held, device=self.device)
            grown.write(
                index.repeat_interleave(self.k),
                torch.arange(self.k, device=self.device).repeat(held),
                kept.probs.flatten(0, 1),
                None if kept.tokens is None else kept.tokens.flatten(0, 1),
                kept.drawn.flatten(),
            )
        self.kept = grown
        return grown
