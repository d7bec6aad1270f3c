"""Token selection after a forward, all on the device: draft samples, and each verify's accepted drafts and next
token (greedy from the argmax, sampled by rejection sampling), with the processors a request asks for (stop tokens
below ``min_new_tokens``, the repetition penalty) and the scores or logits it keeps. Nothing is read back here:
the step reads its picks once, at its end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from types import ModuleType

import numpy as np
import torch

from torchspec.draft_lists import offsets
from torchspec.draft_probs import DraftProbsStore, KeptDistributions
from torchspec.draft_sampling import DraftSampling
from torchspec.drafting import DraftPolicy
from torchspec.penalty import TokenPresence
from torchspec.request import SamplingParams
from torchspec.sampling import DenseProbs, WarpedLogits, reported_scores, suppress_stop_tokens, target_probs
from torchspec.slot_table import SlotTable
from torchspec.speculative import accept_greedy, accept_sampled
from torchspec.step import Phase, ScheduledRequest, StepPlan
from torchspec.transfer import row_index, to_device


class TokenPicker:
    """Picks a forward's tokens from its logits rows (``pick``) for the runner, which feeds, advances and reads
    them back."""

    def __init__(
        self,
        table: SlotTable,
        policy: DraftPolicy | None,
        draft_probs: DraftProbsStore,
        presence: TokenPresence,
        ops: ModuleType,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> None:
        self.table = table
        self.policy = policy
        self.draft_probs = draft_probs  # the draft distributions sampled drafts are verified against
        self.presence = presence  # the tokens of requests with a repetition penalty
        self.ops = ops
        self.device = device
        self.generator = generator

    def pick(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        first_row: list[int],
        drafted: torch.Tensor | None = None,
        sampling: DraftSampling | None = None,
        shifts: torch.Tensor | None = None,
    ) -> Picks:
        """Tokens from the logits rows of each request, on the device: draft samples, verified tokens (see
        speculative.py). ``drafted``: the verifies' drafts on the device (``[requests, n]``, a round verified in
        the step that drafted it), else the host's. ``sampling``: the draft requests' columns (given when the
        plan has drafts), which select their tokens as every later forward of their chains does. ``shifts``:
        see ``MetadataBuilder.shifts``.

        Every random draw covers the whole forward at once, and nothing is read back here: per-request draws
        would cost a host round trip each, which for hundreds of requests costs more than the forward. The
        host's share is one pass over the requests and NumPy over the rows (a verify of k + 1 rows for each of
        256 requests is 2,304 rows: a Python loop per row costs milliseconds)."""
        items = plan.scheduled
        num_items = len(items)
        params = list(map(attrgetter("request.params"), items))
        # Rows each request samples (its first row to the next request's: ``logits`` holds sampled rows only),
        # and the output index of the token sampled after its first one (from positions alone: the host's
        # token list may lag the step in flight).
        first = np.asarray(first_row, dtype=np.int64)
        counts = np.diff(first, append=logits.shape[0])
        columns = plan.columns
        bases = columns.first_position + columns.num_query_tokens - columns.num_prompt_tokens + 1 - counts
        owner = np.repeat(np.arange(num_items), counts)  # the request of each row
        row_number = np.arange(owner.size) - first[owner]  # the row's index within its request's rows
        is_draft = columns.is_draft
        kept = self._keep_rows(logits, params, first, counts, is_draft)
        min_new = np.fromiter(map(attrgetter("min_new_tokens"), params), np.int64, num_items)
        outputs = bases[owner] + row_number  # the output index each row samples (an upper bound for a bound item)
        below = outputs < min_new[owner]
        stops = [p.stop_token_ids for p in params]
        below_minimum = np.flatnonzero(below)
        suppress_stop_tokens(logits, below_minimum, [stops[i] for i in owner[below_minimum].tolist()])
        if shifts is not None:  # rows a bound item may sample below min_new_tokens: the device knows which
            slack = np.fromiter((item.ahead if item.bound else 0 for item in items), np.int64, num_items)
            unsure = np.flatnonzero(~below & (outputs - slack[owner] < min_new[owner]))
            if unsure.size:
                margin = to_device(outputs[unsure] - min_new[owner[unsure]], self.device)
                when = margin < shifts[to_device(owner[unsure], self.device)]
                suppress_stop_tokens(logits, unsure, [stops[i] for i in owner[unsure].tolist()], when)
        greedy = np.fromiter(map(attrgetter("greedy"), params), bool, num_items)
        # Verifies and final prompt chunks emit tokens: accepted drafts and the next token, on the device.
        emitting = np.flatnonzero((counts > 0) & ~is_draft).tolist()
        drafts = self._emitting_drafts([items[i] for i in emitting], emitting, drafted) if emitting else None
        penalising = [e for e, i in enumerate(emitting) if params[i].penalises]
        if penalising:  # (drafts penalise in ``sampling.select``)
            at = [emitting[e] for e in penalising]
            requests = [items[i].request for i in at]
            rows = [self.table.row(request) for request in requests]
            penalised_drafts = drafts[row_index(penalising, self.device)]
            logits = self.presence.penalize_rows(logits, requests, rows, first[at], counts[at], penalised_drafts)
        if kept is not None and kept.keeps_scores:  # the rows as the processors left them, then warped
            kept.scores = reported_scores(logits[kept.index], params, kept.owner, self.ops.top_k_positions)
        sampled_rows = np.flatnonzero(~greedy[owner] & ~is_draft[owner])
        target_index = np.full(owner.size, -1, dtype=np.int64)  # each sampled row's distribution in ``targets``
        target_index[sampled_rows] = np.arange(sampled_rows.size)
        targets = None
        if sampled_rows.size:
            # A verify forward of sampled rounds samples every row: read in place, not gathered (W1: 226 MB).
            every = sampled_rows.size == owner.size
            target_logits = logits if every else logits[row_index(sampled_rows.tolist(), self.device)]
            targets = target_probs(target_logits, params, owner[sampled_rows], self.ops)
        # Greedy rows take the argmax (a pass over the logits: 226 MB for W1's verify); sampled rows never read it.
        tokens = logits.argmax(dim=-1) if greedy.any() else logits.new_zeros(logits.shape[0], dtype=torch.int64)
        draft_items = np.flatnonzero(is_draft)
        if draft_items.size:
            rows = row_index(first[draft_items].tolist(), self.device)
            tokens[rows] = sampling.select(logits[rows], 0, self.draft_probs.kept, self.generator)
        accepted, next_token = None, None
        if emitting:
            accepted, next_token = self._accept(
                [(i, items[i], first_row[i]) for i in emitting], greedy, tokens, targets, target_index, drafts
            )
        return Picks(
            tokens=tokens,
            entropies=self._draft_entropies(logits, first[draft_items].tolist()),
            emitting=emitting,
            emitting_rows={first_row[i]: j for j, i in enumerate(emitting)},
            drafts=drafts,
            accepted=accepted,
            next_token=next_token,
            kept=kept,
        )

    def _keep_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        first: np.ndarray,
        counts: np.ndarray,
        is_draft: np.ndarray,
    ) -> KeptRows | None:
        """The rows of the emitting requests whose params keep scores or raw logits (None: no request does), with
        the raw logits copied now, before any processor changes them; their scores come once the processors ran."""
        keeping = [
            i for i, p in enumerate(params) if (p.output_scores or p.output_logits) and counts[i] and not is_draft[i]
        ]
        if not keeping:
            return None
        rows = np.concatenate([np.arange(first[i], first[i] + counts[i]) for i in keeping])
        index = to_device(rows, self.device)
        starts = offsets(counts[keeping])[:-1].tolist()
        raw = logits[index].float() if any(params[i].output_logits for i in keeping) else None
        return KeptRows(
            starts={int(first[i]): start for i, start in zip(keeping, starts, strict=True)},
            index=index,
            owner=np.repeat(np.asarray(keeping), counts[keeping]),
            keeps_scores=any(params[i].output_scores for i in keeping),
            raw=raw,
        )

    def _emitting_drafts(
        self, items: Sequence[ScheduledRequest], indices: Sequence[int], drafted: torch.Tensor | None
    ) -> torch.Tensor:
        """``[E, n]``: the drafts each emitting request (``items``, at plan ``indices``) checks, zeros past them
        (none for a final prompt chunk): from ``drafted`` (rows by plan index) when given, else from the host."""
        if drafted is not None:
            return drafted[row_index(indices, self.device)]
        n = max(map(attrgetter("checked_drafts"), items))
        if not n:  # plain steps and final prompt chunks: nothing to copy over
            return torch.zeros(len(items), 0, dtype=torch.int64, device=self.device)
        rounds = [item.request.round.tokens if item.phase is Phase.VERIFY else [] for item in items]
        return to_device([[*tokens, *[0] * (n - len(tokens))] for tokens in rounds], self.device).view(len(rounds), n)

    def _draft_entropies(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Predictive entropy of each draft row (``[rows]``), for policies that steer the round length by it."""
        if not rows or not self.policy.uses_draft_entropy:
            return None
        log_probs = logits[row_index(rows, self.device)].float().log_softmax(dim=-1)
        return -(log_probs.exp() * log_probs).nan_to_num().sum(dim=-1)

    def _accept(
        self,
        emitting: list[tuple[int, ScheduledRequest, int]],
        greedy: np.ndarray,
        tokens: torch.Tensor,
        targets: DenseProbs | WarpedLogits | None,
        target_index: np.ndarray,
        drafts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted drafts and next token of every verify (and final prompt chunk) of a forward, on the device:
        greedy requests' from the argmax (``tokens``), sampled requests' by rejection sampling, each kind in one
        batch. ``emitting``: (index in the plan, item, first row); ``greedy``: per plan index; ``drafts``: theirs
        (``_emitting_drafts``)."""
        counts = [item.checked_drafts for _, item, _ in emitting]
        meta = to_device([counts, [row for _, _, row in emitting]], self.device)
        num_drafts, first_rows = meta
        # Each round's rows, from its first: its newest token's and one per draft (padding repeats the last).
        steps = torch.minimum(torch.arange(drafts.shape[1] + 1, device=self.device), num_drafts[:, None])
        kinds = greedy[[index for index, _, _ in emitting]]
        accepted, next_token = num_drafts.new_empty(len(emitting)), num_drafts.new_empty(len(emitting))
        for kind in (True, False):
            members = np.flatnonzero(kinds == kind)
            if not members.size:
                continue
            whole = members.size == len(emitting)
            at = slice(None) if whole else row_index(members.tolist(), self.device)
            if kind:
                picked = accept_greedy(tokens[first_rows[at, None] + steps[at]], drafts[at], num_drafts[at])
            else:
                sampled = [emitting[m] for m in members.tolist()]
                picked = self._accept_sampled(sampled, targets, target_index, drafts[at], num_drafts[at], steps[at])
            if whole:
                return picked
            accepted[at], next_token[at] = picked
        return accepted, next_token

    def _accept_sampled(
        self,
        verifies: list[tuple[int, ScheduledRequest, int]],
        targets: DenseProbs | WarpedLogits,
        target_index: np.ndarray,
        drafts: torch.Tensor,
        num_drafts: torch.Tensor,
        steps: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling of sampled verifies (and final prompt chunks) in one batch. ``verifies``: (index in
        the plan, item, first row); ``steps``: each one's rows past its first (``[J, n + 1]``). Sampled drafts'
        distributions come from the draft-probs store (written by their draft steps); proposed drafts (n-gram)
        count as point masses."""
        n = drafts.shape[1]
        # A verify's rows are consecutive, all sampled (one request's parameters): so are its ``targets`` rows.
        target_rows = to_device(target_index[[row for _, _, row in verifies]], self.device)[:, None] + steps
        if not n:  # plain steps and final prompt chunks: a sample from p, no draft distribution to read
            return accept_sampled(targets, target_rows, drafts, None, None, num_drafts, self.generator)
        # Proposed drafts as point masses, one row per verify; sampled drafts' distributions are the store's, read
        # where the draft steps kept them (entries past a round's drafts are padding).
        if self.policy.proposes_tokens:
            drafted = (steps[:, :n] < num_drafts[:, None]).float()
            kept = KeptDistributions(drawn=drafted, probs=drafted[..., None], tokens=drafts[..., None])
            kept_rows = torch.arange(len(verifies), device=self.device)
        else:
            kept = self.draft_probs.kept
            kept_rows = to_device([self.table.row(item.request) for _, item, _ in verifies], self.device)
        return accept_sampled(targets, target_rows, drafts, kept, kept_rows, num_drafts, self.generator)


@dataclass
class Picks:
    """A forward's token choices, still on the device (the step reads them back once, at its end)."""

    tokens: torch.Tensor  # [rows]: each row's argmax, or its draw for a sampled draft
    entropies: torch.Tensor | None  # [draft rows]: their entropy, for policies that steer by it
    emitting: list[int]  # plan indices of the verifies and final prompt chunks, which emit tokens
    emitting_rows: dict[int, int]  # first row of each of them -> its index in accepted / next_token
    drafts: torch.Tensor | None  # [emitting, n]: the drafts each checked (zeros past them)
    accepted: torch.Tensor | None  # [emitting]: drafts kept
    next_token: torch.Tensor | None  # [emitting]: the corrected or bonus token (or a prompt's first)
    kept: KeptRows | None = None  # the rows of requests that keep their scores or logits

    @classmethod
    def plain(cls, tokens: torch.Tensor) -> Picks:
        """A plain step's picks: request i (row i) emits ``tokens[i]``, no drafts to check."""
        count = tokens.shape[0]
        return cls(
            tokens=tokens,
            entropies=None,
            emitting=list(range(count)),
            emitting_rows=dict(zip(range(count), range(count), strict=True)),
            drafts=None,
            accepted=tokens.new_zeros(count),
            next_token=tokens,
        )

    def parts(self) -> list[torch.Tensor]:
        """What the step reads back of this forward: tokens, accepted counts, next tokens (empty: none)."""
        verified = [self.accepted, self.next_token]
        return [self.tokens, *(self.tokens[:0] if part is None else part for part in verified)]


@dataclass
class KeptRows:
    """A forward's logits rows of the requests that keep them (``SamplingParams.output_scores`` and
    ``output_logits``), fp32 on the device until the step is collected."""

    starts: dict[int, int]  # a request's first logits row -> its first row here
    index: torch.Tensor  # [R]: the rows, in the forward's logits
    owner: np.ndarray  # [R]: each row's plan index
    keeps_scores: bool  # some request keeps transformers' scores (``scores`` is set once the processors ran)
    raw: torch.Tensor | None  # [R, V]: the raw logits (None: no request keeps them)
    scores: torch.Tensor | None = None  # [R, V]: transformers' scores

    def on_host(self) -> KeptRows:
        """The rows in host memory (copied at the first call: the step is read back by then)."""
        self.scores, self.raw = (None if rows is None else rows.cpu() for rows in (self.scores, self.raw))
        return self
