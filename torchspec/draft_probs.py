"""The warped distributions of a round's drafts, kept on the device from the draft steps to the verify.

Rejection sampling needs, at the verify, the distribution q each draft token was sampled from. Each draft
forward writes the rows of all its draft requests at once into one ``[rows, k, V]`` buffer (row: the request's
slot-table row; column: the draft's index in its round; ``DraftSampling.select``) and the verify's rejection
sampling gathers what it needs from it (each draft's q, and the q of a rejected draft). Keeping a tensor per
draft instead cost a view per draft and a stack per verify: hundreds of small host-side ops per step at batch
256.
"""

from __future__ import annotations

import torch


class DraftProbsStore:
    """``[rows, k, V]`` fp32 on the device, grown on demand (rows double, like the slot table)."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.k = k
        self.device = device
        self.probs: torch.Tensor | None = None

    def reserve(self, rows: int, vocab_size: int) -> None:
        """Room for ``rows`` rows of ``vocab_size`` entries (rows double; what the buffer held is kept)."""
        if self.probs is not None and rows <= self.probs.shape[0] and vocab_size == self.probs.shape[-1]:
            return
        grown = torch.zeros(max(8, rows, 2 * self._rows), self.k, vocab_size, device=self.device)
        if self.probs is not None and vocab_size == self.probs.shape[-1]:
            grown[: self._rows] = self.probs
        self.probs = grown

    @property
    def _rows(self) -> int:
        return 0 if self.probs is None else self.probs.shape[0]
