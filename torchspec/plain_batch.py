"""Plain decoding steps whole on the device: inputs, token selection and the slot table's advance, from columns
kept per batch, captured with the step's forward in one CUDA graph.

A plain step (every request fed its newest token, one query each, no speculation) built by the general path costs
the host a metadata build (``MetadataBuilder.build``: positions, slots and full lists from the slot table), a
token selection (``TokenPicker.pick``: stop tokens forbidden below ``min_new_tokens``, then the argmax, or a draw from
the temperature- and top-k-warped distribution, ``WarpedLogits.sample``'s Gumbel-max kernel under a seed drawn
from the run's generator) and an advance of the table (``Runner._advance``): on one H100 they took 0.75, 1.30 and
0.20 ms of a W1 step's 3.6 ms of host work, in 51 kernel launches and 18 copies (``benchmarks/host_split.py``). Here the
per-request columns are sent once while the batch stays the same, and everything that changes from step to step
is read on the device from the slot table (each request's computed count and newest token: its input, position
and slot, its list of positions, whether its stop tokens are forbidden), so the whole step is one graph: the
host draws the seed and replays. The same ops run eagerly on the runner's inputs where no graph runs (no CUDA
graphs, sliding-window layers), so every path selects the same tokens as ``TokenPicker.pick``.

Requests that filter by top-p or min-p, penalise repetition, keep their scores or logits, or mix greedy and
sampled rows take the general path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from torchspec.request import Request, SamplingParams
from torchspec.row_columns import RowColumns
from torchspec.sampling import TopK, padded_stop_ids, top_k_cutoff
from torchspec.slot_table import SlotTable
from torchspec.step import AttentionMetadata
from torchspec.transfer import to_device

#: The op set's ``WarpedLogits.sample``-style draw: ``(logits, rows, temperature, cutoff, seed) -> tokens``.
Sample = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def selects_plainly(params: SamplingParams) -> bool:
    """Whether a request's tokens can be selected here: temperature and top-k alone, nothing kept or penalised."""
    return (
        params.top_p >= 1
        and params.min_p == 0
        and not params.penalises
        and not params.output_scores
        and not params.output_logits
    )


@dataclass
class PlainBatch(RowColumns):
    """The columns of a plain step's ``B`` requests on the device (request i in row i), and the slot table's
    tensors its steps read and advance."""

    # Tensors that are not one entry per request: the draws, the seed and the slot table's.
    SHARED: ClassVar[tuple[str, ...]] = ("draws", "seed", "computed", "last_tokens", "slots")

    greedy: bool  # every request takes the argmax (else every one samples)
    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor | None  # [B] int64, 0 = off (None: no request filters)
    max_top_k: int  # at least every request's top_k (a launch width, known on the host)
    stop_tokens: torch.Tensor  # [B, S]: each request's stop ids, padded by repeating one (S >= 1)
    # [B]: the request's stop tokens are forbidden while its computed count is below this (its next token is then
    # output number computed + 1 - prompt, which must reach min_new_tokens)
    suppress_below: torch.Tensor
    table_rows: torch.Tensor  # [B]: the requests' slot-table rows
    advance: torch.Tensor  # [B]: 1 (what a row's computed count gains a step; padding rows of a graph's: 0)
    draws: torch.Tensor  # [B]: 0 .. B - 1, the draws of ``sample`` (row i draws for request i)
    seed: torch.Tensor  # [1] int64: the current step's seed, drawn before its forward
    # The slot table's computed counts, newest tokens and slots (a grown table: a new batch).
    computed: torch.Tensor
    last_tokens: torch.Tensor
    slots: torch.Tensor
    top_k_positions: TopK
    sample: Sample

    @classmethod
    def of(
        cls,
        requests: Sequence[Request],
        table_rows: np.ndarray,
        table: SlotTable,
        top_k_positions: TopK,
        sample: Sample,
    ) -> PlainBatch | None:
        """The columns of ``requests`` (at rows ``table_rows`` of ``table``), or None when some request's selection
        needs ``TokenPicker.pick`` (see ``selects_plainly``; greedy and sampled requests mixed)."""
        params = [request.params for request in requests]
        greedy = params[0].greedy
        if any(p.greedy != greedy or not selects_plainly(p) for p in params):
            return None
        count, device = len(params), table.device
        stops = padded_stop_ids(params)
        prompt = np.fromiter((request.num_prompt_tokens for request in requests), np.int64, count)
        min_new = np.fromiter((p.min_new_tokens for p in params), np.int64, count)
        has_stops = np.fromiter((bool(p.stop_token_ids) for p in params), bool, count)
        top_k = np.zeros(count, np.int64) if greedy else np.fromiter((p.top_k for p in params), np.int64, count)
        below = np.where(has_stops, min_new + prompt - 1, np.iinfo(np.int64).min)
        columns = [below, top_k, np.asarray(table_rows, dtype=np.int64), np.ones(count, np.int64), np.arange(count)]
        sent = to_device(np.concatenate([np.stack(columns).ravel(), stops.ravel()]), device)
        below_t, top_k_t, rows_t, advance_t, draws_t = sent[: 5 * count].view(5, count)
        temperature = [1.0 if greedy else p.temperature for p in params]
        return cls(
            greedy=greedy,
            temperature=to_device(temperature, device, torch.float32),
            top_k=top_k_t if top_k.any() else None,
            max_top_k=int(top_k.max(initial=0)),
            stop_tokens=sent[5 * count :].view(stops.shape),
            suppress_below=below_t,
            table_rows=rows_t,
            advance=advance_t,
            draws=draws_t,
            seed=torch.zeros(1, dtype=torch.int64, device=device),
            computed=table.computed,
            last_tokens=table.last_tokens,
            slots=table.slots,
            top_k_positions=top_k_positions,
            sample=sample,
        )

    def layout(self) -> tuple[bool, bool, int, int]:
        """What a captured step's selection fixes on the host: greedy or not, whether top-k applies and its width, and
        how many stop ids a row holds."""
        return self.greedy, self.top_k is not None, self.max_top_k, self.stop_tokens.shape[1]

    def buffers(self, size: int) -> PlainBatch:
        """Columns of the same layout for ``size`` rows, each a copy of this one's first (padding rows select
        valid tokens that nobody reads, and advance nothing; ``draws`` stays 0 .. size - 1): fixed-address
        buffers that batches are copied into (``copy_into``)."""
        fixed = super().buffers(size)
        fixed.advance.zero_()
        fixed.draws = torch.arange(size, device=self.draws.device)
        fixed.seed = torch.zeros_like(self.seed)
        return fixed

    def copy_into(self, fixed: PlainBatch) -> None:
        """Write these columns into the first rows of ``fixed`` (``buffers`` of the same layout); the rows past
        them (a larger batch's before) advance nothing."""
        fixed.advance[self.write_rows(fixed) :] = 0

    def reads(self, table: SlotTable | PlainBatch) -> bool:
        """Whether this batch reads the tensors of ``table`` (or those another batch reads): a table grows into
        new ones, with more rows or wider rows."""
        return self.computed is table.computed and self.slots is table.slots

    def write_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata, scratch_slot: int
    ) -> None:
        """The step's inputs in a bucket's buffers (``[1, B]`` ids and positions, the metadata of a bucket of B
        verifies of one query each), from the slot table as the steps queued before left it: request i is fed
        its newest token at its computed count, writes its K/V to that position's slot and attends to every
        position up to it; padding rows own no query, write the scratch slot and attend to nothing. What
        ``MetadataBuilder.build`` makes of a plain step, with nothing from the host."""
        rows, real = self.table_rows, self.advance
        positions = self.computed[rows]
        input_ids[0].copy_(self.last_tokens[rows])
        position_ids[0].copy_(positions)
        width = self.slots.shape[1]  # (a padding row may read a finished request's row: kept in bounds)
        slots = self.slots[rows, positions.clamp(max=width - 1)]
        metadata.slot_mapping.copy_(torch.where(real > 0, slots, scratch_slot))
        torch.cumsum(real, 0, out=metadata.cu_seqlens_q[1:])
        indptr, indices = metadata.full.kv_indptr, metadata.full.kv_indices
        torch.cumsum((positions + 1) * real, 0, out=indptr[1:])
        flat = torch.arange(indices.shape[0], device=indices.device)
        owner = torch.searchsorted(indptr[1:], flat, right=True).clamp_(max=rows.shape[0] - 1)
        offset = (flat - indptr[owner]).clamp_(max=width - 1)  # past the last list: never read
        indices.copy_(self.slots[rows[owner], offset])

    def draw_seed(self, generator: torch.Generator | None) -> None:
        """The step's seed, from the run's generator (as ``WarpedLogits.sample`` draws it): outside any graph."""
        if not self.greedy:
            torch.randint(1 << 62, (1,), generator=generator, device=self.seed.device, out=self.seed)

    def tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B]``: each row's token from ``logits`` (``[B, V]``, written in place: its stop tokens forbidden
        where its request is below ``min_new_tokens``), under the seed drawn last; then each request's state in
        the slot table moves past the step, as ``Runner._advance`` moves it: one more token computed, the new
        one its newest. (A padding row reads the state of some row, a real one's maybe, and adds 0 to it:
        accumulated, where a write would race the real row's.)"""
        computed = self.computed[self.table_rows]
        active = (computed < self.suppress_below)[:, None]
        stops = logits.gather(1, self.stop_tokens).masked_fill(active, float("-inf"))
        logits.scatter_(1, self.stop_tokens, stops)
        if self.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            cutoff = logits.new_full(logits.shape[:1], float("-inf"), dtype=torch.float32)
            if self.top_k is not None:
                cutoff = top_k_cutoff(logits, self.temperature, self.top_k, self.max_top_k, select=self.top_k_positions)
            tokens = self.sample(logits, self.draws, self.temperature, cutoff, self.seed)
        self.computed.index_add_(0, self.table_rows, self.advance)
        self.last_tokens.index_add_(0, self.table_rows, (tokens - self.last_tokens[self.table_rows]) * self.advance)
        return tokens
