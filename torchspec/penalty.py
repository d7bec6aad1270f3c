"""The repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``) with its state on the device.

A request's penalty reads every token it holds: its prompt and its output so far, and inside a round the drafts
before the token drawn (the verify's row j conditions on the newest token and drafts 0..j-1, so draft forward j
must penalise the same set, or the draft drifts from the target it is checked against). The host may not know
the output yet (rounds launched ahead, read back later), so the set lives on the device, one row per slot-table
row, and each emitting step adds its accepted drafts and next token there, as it advances ``SlotTable.computed``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from torchspec.request import Request
from torchspec.transfer import row_index, to_device


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty per row: ``logits`` (``[R, V]`` fp32, as transformers' generate holds
    them) of the tokens ``seen`` (``[R, >= V]`` bool) divided by the row's ``penalty`` (``[R]`` fp32) where
    positive, multiplied where negative. A penalty of 1 changes nothing, bit for bit."""
    penalty = penalty[:, None]
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen[:, : logits.shape[-1]], penalised, logits)


class TokenPresence:
    """``[rows, V + 1]`` bool on the device, by slot-table row: the tokens its request holds, as the steps
    queued on the device leave it. Column V takes the writes that mean nothing (a round's drafts past those
    accepted, known only on the device), so an update is one unconditional write.

    Only requests that penalise are tracked: a row is written from the request's tokens when such a request
    first samples in it (its final prompt chunk, or its first step back from the host tier: no step of it in
    flight, so the host knows every token), then by its own emitting steps (``record``). Nothing else writes a
    row, so a request that finds its row still marked as its own finds it as it left it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mask: torch.Tensor | None = None
        self._holders: dict[int, Request] = {}  # row -> the request whose tokens it holds

    def round_sets(
        self, requests: Sequence[Request], rows: Sequence[int], vocab_size: int, earlier: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """``[len(requests), V + 1]``, a copy: what the next draft forward of each request (slot-table row
        ``rows[i]``) penalises, its tokens and the drafts its round made before (``earlier[i]``, on the host)."""
        lengths = np.fromiter(map(len, earlier), np.int64, len(earlier))
        tokens = np.fromiter(itertools.chain.from_iterable(earlier), np.int64, int(lengths.sum()))
        owner = np.arange(len(requests))
        return self._seen(requests, rows, vocab_size, owner, np.repeat(owner, lengths), to_device(tokens, self.device))

    def penalize_rows(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        rows: Sequence[int],
        first_rows: np.ndarray,
        row_counts: np.ndarray,
        drafts: torch.Tensor,
    ) -> torch.Tensor:
        """``logits`` in fp32 (transformers penalises fp32 logits) with the rows of emitting ``requests``
        (slot-table rows ``rows``; logits rows from ``first_rows``, ``row_counts`` each) penalised: row j of a
        request, its distribution after its newest token and j drafts, by its tokens and its first j ``drafts``
        (``[requests, n]`` on the device)."""
        logits = logits.float()
        owner = np.repeat(np.arange(len(requests)), row_counts)  # the request of each row
        step = np.arange(owner.size) - (np.cumsum(row_counts) - row_counts)[owner]  # drafts before the row's token
        extra_rows = np.repeat(np.arange(owner.size), step)  # each (row, earlier draft) pair
        extra_columns = np.arange(extra_rows.size) - (np.cumsum(step) - step)[extra_rows]
        index = to_device(np.stack([owner[extra_rows], extra_columns]), self.device)
        seen = self._seen(requests, rows, logits.shape[-1], owner, extra_rows, drafts[index[0], index[1]])
        penalties = np.fromiter((r.params.repetition_penalty for r in requests), np.float64, len(requests))
        at = row_index((first_rows[owner] + step).tolist(), self.device)
        logits[at] = penalize(logits[at], seen, to_device(penalties[owner], self.device, torch.float32))
        return logits

    def record(
        self, rows: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor
    ) -> None:
        """Add what emitting steps emit, on the device: row ``rows[i]``'s first ``accepted[i]`` drafts of
        ``drafts[i]`` and ``next_token[i]``."""
        kept = torch.arange(drafts.shape[1], device=self.device) < accepted[:, None]
        tokens = torch.cat([torch.where(kept, drafts, self.mask.shape[1] - 1), next_token[:, None]], dim=1)
        self.mask.index_put_((rows[:, None].expand_as(tokens), tokens), self.mask.new_ones(()))

    def _seen(
        self,
        requests: Sequence[Request],
        rows: Sequence[int],
        vocab_size: int,
        owner: np.ndarray,
        extra_rows: np.ndarray,
        extra_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """``[len(owner), V + 1]``, a copy: entry e holds the tokens of ``requests[owner[e]]`` (slot-table row
        ``rows[owner[e]]``) and the ``extra_tokens`` whose ``extra_rows`` is e. The penalising requests are
        tracked first."""
        self._reserve(max(rows) + 1, vocab_size)
        self._track([(request, row) for request, row in zip(requests, rows, strict=True) if request.params.penalises])
        index = to_device(np.concatenate([np.asarray(rows, dtype=np.int64)[owner], extra_rows]), self.device)
        seen = self.mask[index[: owner.size]]
        seen.index_put_((index[owner.size :], extra_tokens), seen.new_ones(()))
        return seen

    def forget(self, row: int) -> None:
        """The request holding ``row`` gave it back: the next one there writes the row from its own tokens."""
        self._holders.pop(row, None)

    def _reserve(self, rows: int, vocab_size: int) -> None:
        """Room for ``rows`` rows of a ``vocab_size`` vocabulary (rows double; what the mask held is kept)."""
        held = 0 if self.mask is None else self.mask.shape[0]
        if rows <= held:
            return
        grown = torch.zeros(max(8, rows, 2 * held), vocab_size + 1, dtype=torch.bool, device=self.device)
        if self.mask is not None:
            grown[:held] = self.mask
        self.mask = grown

    def _track(self, pairs: Sequence[tuple[Request, int]]) -> None:
        """Write the rows of the (request, row) ``pairs`` whose request does not hold its row yet from its
        tokens, in one copy."""
        new = [(request, row) for request, row in pairs if self._holders.get(row) is not request]
        if not new:
            return
        self._holders.update((row, request) for request, row in new)
        lengths = np.fromiter((len(request.token_ids) for request, _ in new), np.int64, len(new))
        total = int(lengths.sum())
        tokens = np.fromiter(itertools.chain.from_iterable(r.token_ids for r, _ in new), np.int64, total)
        new_rows = np.fromiter((row for _, row in new), np.int64, len(new))
        sent = to_device(np.concatenate([new_rows, np.repeat(new_rows, lengths), tokens]), self.device)
        cleared, entry_rows, entry_tokens = sent.split([len(new), total, total])
        self.mask.index_fill_(0, cleared, False)
        self.mask.index_put_((entry_rows, entry_tokens), self.mask.new_ones(()))
