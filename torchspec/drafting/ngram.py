"""N-gram prompt lookup (as in vLLM / transformers): continue the latest n-gram where it occurred before."""

from __future__ import annotations

from torchspec.drafting.base import DraftPolicy
from torchspec.request import Request

MAX_NGRAM = 3


class NgramPolicy(DraftPolicy):
    """Match the last n tokens (n = 3, 2, 1) at their latest earlier occurrence and propose what followed."""

    name = "ngram"
    proposes_tokens = True

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        tokens = request.token_ids
        for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + max_tokens]
        return []
