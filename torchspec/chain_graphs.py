"""The later forwards of a step's draft chains, each with its token sampling, replayed from CUDA graphs.

A round's k draft forwards each cost the host a metadata build, a graph-input fill, token selection and a
launch: hundreds of tensor ops per round, which at batch 256 (and even at batch 1) take longer than the GPU
work they launch. Here forward j (2..k) of every chain in a bucket of ``D'`` requests is captured once as its
own graph, together with what happens after it on the device (the repetition penalty, stop tokens forbidden
below ``min_new_tokens``, temperature, top-k, top-p, min-p, the draw, the draft distribution kept for the
verify). The host writes the round's inputs into the bucket's buffers once (positions, slots, the round's draft
lists: one per request, of which each forward reads a prefix up to its own ends; the sampling columns) and
replays the graph once per forward the round has, back to back: a round of 6 drafts runs 5 later forwards, not
k - 1. One graph serves every forward: it reads which one it runs from a device counter (its rows of the round's
buffers, its sampling column) and advances it, so a bucket captures once where a graph per forward captured
k - 1 times (W1 on the H200: ~170 captures of ~75 ms each, most of them chain forwards).

A bucket of ``D'`` requests holds the round's buffers (draft lists: ~80 MB at 256 requests, 8K contexts and
sparsity 0.05); each sampling layout in it has its own columns and graphs: which filters run and their widths
are host choices a graph fixes (``DraftSampling.layout``). The graphs of every bucket share one memory pool: they run
one after another on one stream and keep nothing in it between replays (tokens and draft distributions go to
buffers outside it).

Layout: forward ``j`` (1 .. k-1) feeds ``tokens[j - 1]`` at ``positions[j - 1]`` and writes ``tokens[j]``;
``j`` is the device counter ``forward``, set to 1 before a round's first replay.
A request whose chain ends before forward ``j`` (and every padding request) reads an empty list, writes its
K/V to the scratch slot and its draft distribution to a spare row of the store; its tokens are never read.

Eligible when no layer has a sliding window, and lists are built by the runner or chosen on the device (a policy
that chooses inside attention on the host is not). On a CPU the same static
path runs without capture (tested in CI against the per-forward path).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from torchspec.cuda_graphs import GraphPool, LiveRequests, SharedStorage, StepGraphs, held_bucket
from torchspec.draft_lists import DraftChoice, RoundLists
from torchspec.draft_probs import KeptDistributions
from torchspec.draft_sampling import DraftSampling
from torchspec.hf import PagedForwardContext, forward_context
from torchspec.step import AttentionMetadata, KVView


@dataclass
class ChainInputs:
    """One round's chain inputs on the device, for ``D`` draft requests (sorted longest chain first) and the
    ``L`` later forwards the longest chain has."""

    first_tokens: torch.Tensor  # [D]: each request's first draft (forward 1's output)
    positions: torch.Tensor  # [L, D]: position fed by forward j + 1 (padding: 0)
    slots: torch.Tensor  # [L, D]: its KV slot (scratch past the request's chain)
    sampling: DraftSampling  # forward j samples with sampling.select
    # The round's lists (``torchspec.draft_lists``), or what a policy choosing on the device chooses them from.
    lists: RoundLists | None = None
    choice: DraftChoice | None = None

    @property
    def forwards(self) -> int:
        return self.positions.shape[0]


@dataclass
class _Sampler:
    """A sampling layout's fixed-address columns in a bucket, and the graph of its forwards."""

    sampling: DraftSampling  # D' rows of the layout (``DraftSampling.buffers``)
    reason: str  # why it was made (its capture is logged with it)
    graph: torch.cuda.CUDAGraph | None = None  # every later forward's, captured on first use


@dataclass
class _ChainStep:
    """One bucket's fixed-address buffers (shared by its sampling layouts), and its layouts' columns and
    graphs."""

    size: int  # D'
    forward: torch.Tensor  # [1]: the forward the next replay runs (1 .. k - 1); each replay advances it
    positions: torch.Tensor  # [k - 1, D']: ``ChainInputs``' rows copied in (padding: as there)
    slots: torch.Tensor  # [k - 1, D']
    indptr: torch.Tensor  # [D' + 1]
    ends: torch.Tensor  # [k - 1, D']
    lists: torch.Tensor  # [sparse layers, Hkv, capacity]
    list_hint: int  # longest list the bucket was made for (a launch hint)
    choice: DraftChoice | None  # [D'] buffers the drafts choose their lists from (its positions: forward 1's)
    tokens: torch.Tensor  # [k, D']
    cu_seqlens_q: torch.Tensor  # [D' + 1]: one query per request (also the kept logits rows)
    store: KeptDistributions  # the draft-probs store's tensors the graphs write (a new store: new captures)
    samplers: dict[tuple, _Sampler]  # by ``DraftSampling.layout()``
    live: LiveRequests | None  # its real requests (and no verifies), in a small bucket


class ChainGraphs:
    """Captures and replays, per bucket of draft requests and sampling layout, the forwards 2..k of their
    chains."""

    def __init__(self, steps: StepGraphs, k: int, generator: torch.Generator | None) -> None:
        """Shares the model forward, pool, attention ops, sparse layers and buckets of the step graphs."""
        self.forward = steps.forward
        self.pool = steps.pool
        self.ops = steps.ops
        self.sparse_layers = steps.sparse_layers  # draft-reading layer -> its KV heads
        self.buckets = steps.buckets
        self.device = steps.device
        self.capture = steps.capture
        self.captures = steps.captures  # one log for both kinds of graph
        self.memory = GraphPool(self.device) if self.capture else None  # every chain graph's pool
        self._lists = SharedStorage(torch.int64, self.device, self.buckets[-1])  # every bucket's draft lists
        self.k = k
        self.generator = generator
        self._steps: dict[int, _ChainStep] = {}

    def tokens(self, inputs: ChainInputs, store: KeptDistributions, spare_row: int) -> torch.Tensor:
        """``[L, D]``: the tokens drafted by forwards 2..L + 1 (row j - 1: forward j + 1), from one replay per
        forward. Writes each forward's K/V, and each draft's distribution into the request's row of ``store``."""
        count = inputs.first_tokens.shape[0]
        (size,) = held_bucket((count,), self.buckets, [(size,) for size in self._steps])
        step = self._steps.get(size)
        entries = inputs.lists.view.kv_indices.shape[-1] if inputs.lists is not None else 0
        if step is None:
            reason = "new bucket"
        elif inputs.choice is not None and (step.choice is None or not inputs.choice.held_by(step.choice)):
            reason = "draft choice outgrew its buffers"
        elif entries > step.lists.shape[-1]:
            reason = "draft lists outgrew its buffer"
        elif step.store is not store:
            reason = "new draft-probs store"
        else:
            reason = None
        if reason is not None:
            capacity = max(2 * entries, 2 * step.lists.shape[-1] if step else 0)
            hint = inputs.lists.view.max_len if inputs.lists is not None else 0
            step = self._steps[size] = self._chain_step(size, capacity, hint, store, inputs.choice)
        layout = inputs.sampling.layout()
        sampler = step.samplers.get(layout)
        if sampler is None:
            reason = reason or "new sampling layout"
            sampler = step.samplers[layout] = _Sampler(inputs.sampling.buffers(size), reason=reason)
        self._fill(step, sampler, inputs, count, spare_row)
        for _ in range(inputs.forwards):
            if not self.capture:
                self._run(step, sampler)
            else:
                if sampler.graph is None:
                    # Its warm-up runs a forward (and its draws joined the penalty's token sets): start over.
                    self._capture(step, sampler)
                    self._fill(step, sampler, inputs, count, spare_row)
                sampler.graph.replay()
        return step.tokens[1 : inputs.forwards + 1, :count]

    def _chain_step(
        self, size: int, capacity: int, hint: int, store: KeptDistributions, choice: DraftChoice | None
    ) -> _ChainStep:
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=self.device)  # noqa: E731
        later = self.k - 1
        heads = max(self.sparse_layers.values())
        positions = zeros(later, size)
        return _ChainStep(
            size=size,
            forward=torch.ones(1, dtype=torch.int64, device=self.device),
            positions=positions,
            slots=zeros(later, size),
            indptr=zeros(size + 1),
            ends=zeros(later, size),
            lists=self._lists.view((len(self.sparse_layers), heads, capacity), size),
            list_hint=hint,
            choice=None if choice is None else choice.padded(size, positions[0]),
            tokens=zeros(self.k, size),
            cu_seqlens_q=torch.arange(size + 1, device=self.device),
            store=store,
            samplers={},
            live=LiveRequests.of((size,), self.device),
        )

    def _fill(self, step: _ChainStep, sampler: _Sampler, inputs: ChainInputs, count: int, spare_row: int) -> None:
        """Copy the round into the bucket's buffers (its forwards' rows) and its layout's columns; padding
        requests get empty lists, the scratch slot and the spare store row."""
        forwards = inputs.forwards
        step.forward.fill_(1)
        if step.live is not None:
            step.live.count(count, 0)
        step.tokens[0, :count] = inputs.first_tokens
        step.positions[:forwards, :count] = inputs.positions
        step.slots[:forwards].fill_(self.pool.scratch_slot)
        step.slots[:forwards, :count] = inputs.slots
        if inputs.choice is not None:
            inputs.choice.copy_into(step.choice)
        else:
            indptr, ends = inputs.lists.view.kv_indptr, inputs.lists.ends[1:]
            step.indptr[: count + 1] = indptr
            step.indptr[count + 1 :] = indptr[-1]  # padding requests' lists: empty, where the real ones end
            step.ends[:forwards, :count] = ends
            step.ends[:forwards, count:] = indptr[-1]
            step.lists[..., : inputs.lists.view.kv_indices.shape[-1]] = inputs.lists.view.kv_indices
        inputs.sampling.copy_into(sampler.sampling, spare_row)

    def _run(self, step: _ChainStep, sampler: _Sampler) -> None:
        """Forward ``step.forward`` (1 .. k - 1) and its sampling, on the bucket's buffers (what its graph
        holds): its rows of the round's buffers are picked on the device, and the counter advanced."""
        forward, tokens = step.forward, step.tokens
        reads = forward - 1  # the row of the round's buffers this forward reads
        positions = step.positions.index_select(0, reads)
        draft, choice = {}, None
        if step.choice is not None:
            choice = dataclasses.replace(step.choice, positions=positions[0])
        else:
            ends = step.ends.index_select(0, reads)[0]
            draft = {
                layer: KVView(step.indptr, step.lists[i, :heads], step.list_hint, ends)
                for i, (layer, heads) in enumerate(self.sparse_layers.items())
            }
        metadata = AttentionMetadata(
            slot_mapping=step.slots.index_select(0, reads)[0],
            cu_seqlens_q=step.cu_seqlens_q,
            windowed={},
            full=KVView(step.cu_seqlens_q[:1], step.cu_seqlens_q[:0], 0),  # no verifies
            num_drafts=step.size,
            draft=draft,
            draft_choice=choice,
            max_q_len=1,
            live_requests=None if step.live is None else step.live.tensor,
        )
        with forward_context(PagedForwardContext(metadata=metadata, pool=self.pool, ops=self.ops)):
            output = self.forward(
                input_ids=tokens.index_select(0, reads),
                position_ids=positions,
                use_cache=False,
                logits_to_keep=step.cu_seqlens_q[:-1],
            )
        drawn = sampler.sampling.select(output.logits[0], forward, step.store, self.generator)
        tokens.index_copy_(0, forward, drawn[None])
        forward.add_(1)

    def _capture(self, step: _ChainStep, sampler: _Sampler) -> None:
        label = f"chain {step.size} (lists to {step.list_hint}): {sampler.reason}"  # hint: see StepGraphs._capture
        sampler.graph, _ = self.captures.capture(lambda: self._run(step, sampler), label, self.memory)
