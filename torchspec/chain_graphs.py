"""The later forwards of a step's draft chains, with their token sampling, replayed as one CUDA graph.

A round's k draft forwards each cost the host a metadata build, a graph-input fill, token selection and a
launch: hundreds of tensor ops per round, which at batch 256 (and even at batch 1) take longer than the GPU
work they launch. Here forwards 2..k of every chain in a bucket of ``D'`` requests are captured once, together
with what happens between them on the device (stop tokens forbidden below ``min_new_tokens``, temperature,
the draw, the draft distribution kept for the verify), and replayed with one launch per round. The host
writes the round's inputs into the bucket's buffers once: positions, slots and per-forward draft lists (one
flat buffer, each forward's offsets into it), and the sampling parameters.

Layout: forward ``j`` (1 .. k-1) feeds ``tokens[j - 1]`` at ``positions[j - 1]`` and writes ``tokens[j]``.
A request whose chain ends before forward ``j`` (and every padding request) reads an empty list, writes its
K/V to the scratch slot and its draft distribution to a spare row of the store; its tokens are never read.

Eligible when every draft request samples by temperature alone (no top-k/top-p: their sorts are per-row
choices the graph does not hold) and no layer has a sliding window or picks its lists inside attention. On a
CPU the same static path runs without capture (tested in CI against the per-forward path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchspec.cuda_graphs import StepGraphs
from torchspec.draft_sampling import DraftSampling
from torchspec.hf import AttentionMetadata, KVView, PagedForwardContext, forward_context


@dataclass
class ChainInputs:
    """One round's chain inputs on the device, for ``D`` draft requests (sorted longest chain first)."""

    first_tokens: torch.Tensor  # [D]: each request's first draft (forward 1's output)
    positions: torch.Tensor  # [k - 1, D]: position fed by forward j + 1 (padding: 0)
    slots: torch.Tensor  # [k - 1, D]: its KV slot (scratch past the request's chain)
    indptr: torch.Tensor  # [k - 1, D + 1]: offsets of each request's list into ``lists`` (empty past its chain)
    lists: torch.Tensor  # [sparse layers, Hkv, N]: every forward's lists, flat
    max_list_len: int  # longest list (a launch hint)
    sampling: DraftSampling  # temperature only (no top-k/top-p): forward j samples with sampling.select


@dataclass
class _ChainStep:
    """One bucket's fixed-address buffers, per-forward metadata and (once captured) graph."""

    size: int  # D'
    inputs: ChainInputs  # buffers of D' requests, the round's inputs copied in
    tokens: torch.Tensor  # [k, D']
    rows: torch.Tensor  # [D']: every row's logits are kept
    metadata: list[AttentionMetadata]  # forward j + 1 reads metadata[j]
    list_capacity: int
    store: torch.Tensor  # the draft-probs store the graph writes (a new store means a new capture)
    graph: torch.cuda.CUDAGraph | None = None


class ChainGraphs:
    """Captures and replays, per bucket of draft requests, the forwards 2..k of their chains."""

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
        self.k = k
        self.generator = generator
        self._steps: dict[int, _ChainStep] = {}

    def tokens(self, inputs: ChainInputs, store: torch.Tensor, spare_row: int) -> torch.Tensor:
        """``[k - 1, D]``: the tokens drafted by forwards 2..k (row j - 1: forward j + 1), from one replay.
        Writes each forward's K/V, and each draft's distribution into the request's row of ``store``."""
        count = inputs.first_tokens.shape[0]
        size = next(size for size in self.buckets if size >= count)
        step = self._steps.get(size)
        entries = inputs.lists.shape[-1]
        if step is None or entries > step.list_capacity or step.store is not store:
            capacity = max(2 * entries, 2 * step.list_capacity if step else 0)
            step = self._steps[size] = self._chain_step(size, capacity, inputs.max_list_len, store)
        self._fill(step, inputs, count, spare_row)
        if not self.capture:
            self._run(step)
        else:
            if step.graph is None:
                self._capture(step)
            step.graph.replay()
        return step.tokens[1:, :count]

    def _chain_step(self, size: int, capacity: int, hint: int, store: torch.Tensor) -> _ChainStep:
        zeros = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=self.device)  # noqa: E731
        later = self.k - 1
        heads = max(self.sparse_layers.values())
        inputs = ChainInputs(
            first_tokens=zeros(size),
            positions=zeros(later, size),
            slots=zeros(later, size),
            indptr=zeros(later, size + 1),
            lists=zeros(len(self.sparse_layers), heads, capacity),
            max_list_len=hint,
            sampling=DraftSampling(
                temperature=torch.ones(size, device=self.device),
                greedy=torch.ones(size, dtype=torch.bool, device=self.device),
                top_k=None,
                top_p=None,
                max_top_k=0,
                support=None,
                suppress_until=zeros(size),
                stop_tokens=zeros(size, 1),
                store_rows=zeros(size),
                store_columns=zeros(size),
            ),
        )
        cu_seqlens_q = torch.arange(size + 1, device=self.device)
        no_verifies = KVView(cu_seqlens_q[:1], cu_seqlens_q[:0], 0)
        metadata = [
            AttentionMetadata(
                slot_mapping=inputs.slots[j],
                cu_seqlens_q=cu_seqlens_q,
                windowed={},
                full=no_verifies,
                num_drafts=size,
                draft={
                    layer: KVView(inputs.indptr[j], inputs.lists[i, :layer_heads], hint)
                    for i, (layer, layer_heads) in enumerate(self.sparse_layers.items())
                },
                max_q_len=1,
            )
            for j in range(later)
        ]
        return _ChainStep(
            size=size,
            inputs=inputs,
            tokens=zeros(self.k, size),
            rows=torch.arange(size, device=self.device),
            metadata=metadata,
            list_capacity=capacity,
            store=store,
        )

    def _fill(self, step: _ChainStep, inputs: ChainInputs, count: int, spare_row: int) -> None:
        """Copy the round into the bucket's buffers; padding requests get empty lists, the scratch slot and the
        spare store row."""
        static = step.inputs
        step.tokens[0, :count] = inputs.first_tokens
        static.positions[:, :count] = inputs.positions
        static.slots.fill_(self.pool.scratch_slot)
        static.slots[:, :count] = inputs.slots
        static.indptr[:, : count + 1] = inputs.indptr
        static.indptr[:, count + 1 :] = inputs.indptr[:, -1:]
        static.lists[..., : inputs.lists.shape[-1]] = inputs.lists
        fixed, given = static.sampling, inputs.sampling
        fixed.temperature[:count] = given.temperature
        fixed.greedy[:count] = given.greedy
        fixed.suppress_until.zero_()
        fixed.suppress_until[:count] = given.suppress_until
        if fixed.stop_tokens.shape[1] != given.stop_tokens.shape[1]:  # a new width is a new graph
            fixed.stop_tokens = given.stop_tokens.new_zeros(step.size, given.stop_tokens.shape[1])
            step.graph = None
        fixed.stop_tokens[:count] = given.stop_tokens
        fixed.store_rows.fill_(spare_row)
        fixed.store_rows[:count] = given.store_rows
        fixed.store_columns.zero_()
        fixed.store_columns[:count] = given.store_columns

    def _run(self, step: _ChainStep) -> None:
        """Forwards 2..k and their sampling, on the bucket's buffers (what the graph holds)."""
        static, tokens = step.inputs, step.tokens
        for j, metadata in enumerate(step.metadata, start=1):
            with forward_context(PagedForwardContext(metadata=metadata, pool=self.pool, ops=self.ops)):
                output = self.forward(
                    input_ids=tokens[j - 1][None],
                    position_ids=static.positions[j - 1][None],
                    use_cache=False,
                    logits_to_keep=step.rows,
                )
            tokens[j] = static.sampling.select(output.logits[0], j, step.store, self.generator)

    def _capture(self, step: _ChainStep) -> None:
        step.graph, _ = self.captures.capture(lambda: self._run(step))
