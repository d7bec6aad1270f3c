"""A ``generate`` call's tokens handed to a transformers streamer (``BaseStreamer``) as they are committed.

transformers' ``generate`` puts the input ids ``[B, S]`` first (one row per sample), then after every decoding step
one new token per row, ``[B]`` (``pad_token_id`` in a finished row), and calls ``end()`` last. Rows here advance at
their own pace (a round commits several tokens, rows finish apart), so a column goes out once every row has
committed its token there or finished: the same calls in the same order, each as soon as its tokens are known.
Only committed tokens are read, so no token past a stop (EOS, ``max_new_tokens``, a stopping criterion) is ever
put. A streamer that takes one row only (``TextStreamer``) refuses a batch itself, as it does in transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from torchspec.request import Request
from torchspec.step import StepPlan


class StreamedColumns:
    """The engine's step callback that puts each column of new tokens once all rows have it."""

    def __init__(self, streamer: BaseStreamer, requests: Sequence[Request], pad_token_id: int) -> None:
        self.streamer = streamer
        self.requests = requests
        self.pad_token_id = pad_token_id
        self.sent = 0  # columns put so far

    def __call__(self, plan: StepPlan, finished: list[Request]) -> None:
        running = [r.num_output_tokens for r in self.requests if not r.is_finished]
        ready = min(running) if running else max(r.num_output_tokens for r in self.requests)  # never decreases
        for column in range(self.sent, ready):
            tokens = [
                r.token_ids[r.num_prompt_tokens + column] if column < r.num_output_tokens else self.pad_token_id
                for r in self.requests
            ]
            self.streamer.put(torch.tensor(tokens, dtype=torch.long))
        self.sent = ready
