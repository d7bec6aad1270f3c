"""transformers' stopping criteria, checked as a request's tokens are committed, on the batch they came with.

transformers calls a ``generate`` call's criteria after every token on the whole batch ``[B, length]``: each row's
input (its padding included), then the row's tokens so far. Some criteria keep state per row: lm-eval's
``MultiTokenEOSCriteria`` records which rows have shown their stop sequence and says stop once all have, so it
must see every row of the call where it expects it (a batch of one row failed it with an IndexError). Requests
here advance at their own pace (a round commits several tokens, requests finish apart): a row holds its request's
committed tokens, then padding, and a request's check reads the columns up to its newest token. A criterion
that answers per row is asked for the request's row; one that answers for the batch, for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Criteria = Callable[[torch.Tensor, torch.Tensor | None], bool | torch.Tensor]


class CriteriaBatch:
    """The rows a call's stopping criteria read: ``[B, width + max_new_tokens]`` int64 on the CPU, each row its
    request's input row, then its committed tokens, then ``pad_token_id``."""

    def __init__(self, input_rows: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int) -> None:
        self.width = len(input_rows[0])
        self.rows = torch.full((len(input_rows), self.width + max_new_tokens), pad_token_id, dtype=torch.long)
        self.rows[:, : self.width] = torch.tensor(input_rows, dtype=torch.long)
        self.pad_token_id = pad_token_id

    def first_stop(self, criteria: Criteria, row: int, generated: int, tokens: Sequence[int]) -> int | None:
        """The index of the first of ``tokens`` (row ``row``'s next, after its ``generated``) after which the
        criteria say stop for the row, or None. They are called token by token with ``scores=None``, as
        transformers calls them after each token; a token past the stop goes back to padding, as transformers
        pads a stopped row."""
        start = self.width + generated
        self.rows[row, start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        for index in range(len(tokens)):
            done = torch.as_tensor(criteria(self.rows[:, : start + index + 1], None)).reshape(-1)
            if bool(done[row] if done.numel() > 1 else done[0]):
                self.rows[row, start + index + 1 :] = self.pad_token_id
                return index
        return None
