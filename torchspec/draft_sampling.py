"""Token selection for the later forwards of a round's draft chains, from columns built once per round.

Forward j of a chain (j = 1 .. k - 1) samples for the same requests as forward 0, or a prefix of them (chains
are sorted longest first), with the same parameters. Building each forward's selection from its requests (the
general ``TokenPicker.pick``: a pass over the items, NumPy over the rows, parameters sent per forward) cost the host
~1.6 ms per forward at batch 256 on the H200, about what the forward's replay costs the GPU. Here the per-request
columns (temperature, top-k, top-p, stop tokens below ``min_new_tokens``, where each draft distribution is kept)
are sent once per round, and a forward's selection is a fixed dozen tensor ops on a prefix of them, the same ops
a chain graph captures. A repetition penalty reads a per-round copy of each request's tokens on the device
(``presence``), to which every forward adds its draws: forward j penalises what the verify's row j will.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from torchspec.draft_probs import KeptDistributions
from torchspec.penalty import penalize
from torchspec.request import Request
from torchspec.row_columns import RowColumns
from torchspec.sampling import TopK, padded_stop_ids, warp_logits
from torchspec.transfer import to_device


@dataclass
class DraftSampling(RowColumns):
    """Sampling columns of ``D`` draft requests on the device (request i in row i)."""

    temperature: torch.Tensor  # [D] fp32 (1 for greedy requests)
    greedy: torch.Tensor  # [D] bool
    top_k: torch.Tensor | None  # [D] int64, 0 = off (None: no request filters)
    top_p: torch.Tensor | None  # [D] float64, 1 = off (None: no request filters)
    min_p: torch.Tensor | None  # [D] fp32, 0 = off (None: no request filters)
    penalty: torch.Tensor | None  # [D] fp32 repetition penalty, 1 = off (None: no request penalises)
    # [D, V + 1] bool with ``penalty``: the tokens each request holds before this forward's draw (its tokens,
    # the round's drafts so far), which each forward adds its draws to
    presence: torch.Tensor | None
    max_top_k: int  # at least every request's top_k (a launch width, known on the host)
    support: int | None  # max_top_k when every sampled request filters by top-k, else None (the vocabulary)
    suppress_until: torch.Tensor  # [D]: forward j forbids the request's stop tokens while j < this
    stop_tokens: torch.Tensor  # [D, S]: each request's stop ids, padded by repeating one (S >= 1)
    store_rows: torch.Tensor  # [D]: the request's row of the draft-probs store
    store_columns: torch.Tensor  # [D]: forward j's distribution goes to column store_columns + j
    top_k_positions: TopK  # the op set's Top-K, which finds the support
    all_greedy: bool = False  # every request takes the argmax: no distribution to warp, draw from or keep
    any_greedy: bool = False  # some request takes the argmax (else no pass over the logits computes it)

    @classmethod
    def of(
        cls,
        requests: Sequence[Request],
        first_positions: Sequence[int],
        store_rows: Sequence[int],
        store_columns: Sequence[int],
        device: torch.device,
        top_k_positions: TopK,
        presence: torch.Tensor | None = None,
    ) -> DraftSampling:
        """The columns of chains whose forward 0 draws the token at ``first_positions[i]`` + 1 of
        ``requests[i]``, kept in draft-probs store row ``store_rows[i]`` from column ``store_columns[i]`` (the
        drafts its round made before): one copy of integers, one of temperatures, penalties and min-p values
        (and one of top-p values when some request filters by it). ``top_k_positions``: the op set's (see
        ``attention.reference``). ``presence``: the requests' tokens and the round's drafts so far
        (``TokenPresence.gather``), given when some request penalises."""
        count = len(requests)
        params = [request.params for request in requests]
        stops = padded_stop_ids(params)
        first = np.asarray(first_positions, dtype=np.int64)
        prompt = np.fromiter((request.num_prompt_tokens for request in requests), np.int64, count)
        min_new = np.fromiter((p.min_new_tokens for p in params), np.int64, count)
        has_stops = np.fromiter((bool(p.stop_token_ids) for p in params), bool, count)
        greedy = np.fromiter((p.greedy for p in params), np.int64, count)
        top_k = np.fromiter((p.top_k for p in params), np.int64, count) * (1 - greedy)  # greedy rows filter nothing
        # The token forward j draws is output number first + 1 - prompt + j: forbidden while below min_new.
        until = np.where(has_stops, min_new - (first + 1 - prompt), 0)
        columns = [until, greedy, top_k, np.asarray(store_rows, dtype=np.int64), np.asarray(store_columns, np.int64)]
        sent = to_device(np.concatenate([np.stack(columns).ravel(), stops.ravel()]), device)
        until_t, greedy_t, top_k_t, rows_t, columns_t = sent[: 5 * count].view(5, count)
        # Greedy rows warp nothing; the penalty applies to them too.
        floats = np.array(
            [
                [1.0 if p.greedy else p.temperature for p in params],
                [0.0 if p.greedy else p.min_p for p in params],
                [p.repetition_penalty for p in params],
            ]
        )
        temperature, min_p, penalty = to_device(floats, device, torch.float32)
        top_p = [1.0 if p.greedy else p.top_p for p in params]
        filters = top_k.any() and bool((top_k > 0)[greedy == 0].all())
        return cls(
            temperature=temperature,
            greedy=greedy_t.bool(),
            top_k=top_k_t if top_k.any() else None,
            top_p=to_device(top_p, device, torch.float64) if min(top_p) < 1 else None,
            min_p=min_p if floats[1].any() else None,
            penalty=None if presence is None else penalty,
            presence=presence,
            max_top_k=int(top_k.max(initial=0)),
            support=int(top_k.max()) if filters else None,
            suppress_until=until_t,
            stop_tokens=sent[5 * count :].view(stops.shape),
            store_rows=rows_t,
            store_columns=columns_t,
            top_k_positions=top_k_positions,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
        )

    def layout(self) -> tuple[bool, bool, int | None, int, bool, bool, bool, bool, int]:
        """What a captured selection fixes on the host: greedy alone, in part or not at all, the top-k support
        and width, whether top-k, top-p, min-p and the repetition penalty apply at all, and how many stop ids a
        row holds."""
        present = [column is not None for column in (self.top_k, self.top_p, self.min_p, self.penalty)]
        return self.all_greedy, self.any_greedy, self.support, self.max_top_k, *present, self.stop_tokens.shape[1]

    def copy_into(self, fixed: DraftSampling, spare_row: int) -> None:
        """Write these columns into the first rows of ``fixed`` (``buffers`` of the same layout); the rows past
        them keep their draft distributions in store row ``spare_row`` from column 0, where any forward's fits."""
        count = self.write_rows(fixed)
        fixed.store_rows[count:] = spare_row
        fixed.store_columns[count:] = 0

    def prefix(self, count: int) -> DraftSampling:
        """The columns of the first ``count`` requests (views, no copy)."""
        if count == self.greedy.shape[0]:
            return self
        return self._each_column(lambda column: column[:count])

    def select(
        self,
        logits: torch.Tensor,
        forward: int | torch.Tensor,
        store: KeptDistributions,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """The tokens forward ``forward`` of the chains draws from ``logits`` (``[D, V]``, request i in row i;
        ``forward``: its index, or a device tensor ``[1]`` holding it, as in a chain graph that serves every forward):
        the argmax for greedy requests, else a draw from the warped distribution (transformers' order: repetition
        penalty, stop tokens below ``min_new_tokens``, temperature, top-k, top-p, min-p), which goes to ``store``
        (over the support below, or the vocabulary) for the verify's rejection sampling. A round of greedy
        requests alone takes the argmax and nothing else (its verify reads no draft distribution). The draws
        join ``presence``, for the next forward's penalty.

        When every sampled request filters by top-k, the distribution is warped over the ``support`` most
        likely tokens alone (one Top-K, then ops on ``[D, support]``: at 256 x 49K, a dozen passes over the
        vocabulary cost the GPU ~0.5 ms per forward), and kept as that support. It equals transformers' warping
        unless a token outside the support ties the k-th largest logit, which transformers would keep; the draft
        may leave such a tie out, as the verify's rejection sampling is exact for any draft distribution it is
        told."""
        # Stop tokens below min_new_tokens: only their entries are read and written (repeats write one value).
        active = (forward < self.suppress_until)[:, None]
        stops = logits.gather(1, self.stop_tokens).masked_fill(active, float("-inf"))
        logits = logits.scatter(1, self.stop_tokens, stops)
        if self.penalty is not None:  # in fp32, as transformers penalises (-inf stays -inf)
            logits = penalize(logits.float(), self.presence, self.penalty)
        tokens = logits.argmax(dim=-1) if self.all_greedy else self._draw(logits, forward, store, generator)
        if self.presence is not None:
            self.presence.scatter_(1, tokens[:, None], True)
        return tokens

    def _draw(
        self,
        logits: torch.Tensor,
        forward: int | torch.Tensor,
        store: KeptDistributions,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """``select``'s tokens of a round with sampled requests, their distributions kept in ``store``."""
        candidates, support = logits, None
        if self.support is not None and self.support < logits.shape[-1]:
            candidates, support = self._support(logits)
        warped = warp_logits(
            candidates,
            self.temperature,
            self.top_k,
            self.top_p,
            self.max_top_k,
            sorted_descending=support is not None,
            min_p=self.min_p,
        )
        probs = warped.softmax(dim=-1)
        draws = torch.multinomial(probs, 1, generator=generator)
        store.write(self.store_rows, self.store_columns + forward, probs, support, probs.gather(1, draws)[:, 0])
        if support is not None:
            draws = support.gather(1, draws)
        if not self.any_greedy:  # the argmax is a pass over the logits (~23 us a draft at 256 x 49K on an H100)
            return draws[:, 0]
        return torch.where(self.greedy, logits.argmax(dim=-1), draws[:, 0])

    def _support(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``support`` largest logits of each row in descending order, and their tokens: the op set's Top-K
        sorted (on an H100 at 256 x 49K, the radix kernel and the sort take 0.11 ms where ``torch.topk`` takes
        0.17: ``benchmarks/results/select_micro_h100.jsonl``)."""
        picks = self.top_k_positions(logits, self.suppress_until.new_full((), self.support), self.support).long()
        values, order = logits.gather(1, picks).sort(dim=-1, descending=True)
        return values, picks.gather(1, order)
