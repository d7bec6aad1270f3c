"""CUDA graphs for one-token steps: plain decoding and draft steps, most of a long generation's steps.

A step's eager forward costs the host a Python call per module and a launch per kernel (tens of ms for a
30-layer model at batch 256, far above the GPU time of the step). Here the forward of a batch padded to
a bucket size is captured once per (bucket, draft or decode) and replayed: every step copies its inputs
and slot lists into the bucket's static buffers (fixed addresses the graph reads) and replays.

What makes replay exact: padding requests get empty slot lists and write their K/V to the pool's scratch
slot; the attention kernels read each request's list length from the device (split sizes adapt to it), so
the grid fixed at capture covers any lengths; the launch hints fixed at capture only affect speed. On a CPU
the same static path runs without capture (tested in CI: same tokens as the dynamic path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from torchspec.hf import AttentionMetadata, KVView, PagedForwardContext, forward_context
from torchspec.kv_cache import KVPool


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes: powers of two to 32, then every 32 (a step pads at most 31 requests past 32)."""
    small = [size for size in (1, 2, 4, 8, 16, 32) if size < max_batch_size]
    return [*small, *range(64, max_batch_size, 32), max_batch_size]


@dataclass
class _StaticStep:
    """One bucket's fixed-address inputs, metadata and (once captured) graph and output."""

    size: int
    drafts: bool
    input_ids: torch.Tensor  # [1, size]
    position_ids: torch.Tensor  # [1, size]
    rows: torch.Tensor  # [size]: every token samples
    metadata: AttentionMetadata
    list_capacity: int  # entries the slot-list buffer holds
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    layer_lists: dict[int, torch.Tensor] = field(default_factory=dict)  # draft steps: [Hkv, capacity] per layer


class StepGraphs:
    """Captures and replays the forward of one-token steps padded to bucket sizes."""

    def __init__(
        self,
        forward: Callable[..., object],
        pool: KVPool,
        ops: ModuleType,
        sparse_layers: dict[int, int],
        max_batch_size: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.pool = pool
        self.ops = ops
        self.sparse_layers = sparse_layers  # draft-reading layer -> its KV heads
        self.buckets = bucket_sizes(max_batch_size)
        self.device = device
        self.capture = device.type == "cuda"
        self.memory_pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._steps: dict[tuple[int, bool], _StaticStep] = {}

    @staticmethod
    def eligible(metadata: AttentionMetadata, num_requests: int) -> bool:
        """One query token per request, all drafts or none, nothing decided inside the forward (query-aware
        draft selection, verify scores) and no sliding-window layers."""
        return (
            metadata.max_q_len == 1
            and metadata.num_drafts in (0, num_requests)
            and metadata.draft_select is None
            and metadata.num_scored_queries is None
            and not metadata.windowed
        )

    def logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata, max_list_len: int
    ) -> torch.Tensor:
        """The step's logits ``[num_requests, V]``: its inputs copied into its bucket, the bucket's graph replayed
        (captured on first use, and again when the slot lists outgrow the buffers). ``max_list_len`` bounds
        the full lists of the running requests over their whole generation (a launch hint)."""
        num_requests = input_ids.shape[1]
        drafts = metadata.num_drafts > 0
        size = next(size for size in self.buckets if size >= num_requests)
        lists = self._lists(metadata)
        step = self._steps.get((size, drafts))
        if step is None or lists.kv_indices.shape[-1] > step.list_capacity:
            capacity = max(lists.kv_indices.shape[-1], 2 * step.list_capacity if step else 0, size * 256)
            hint = lists.max_len if drafts else max_list_len  # split counts fixed at capture: sized for the longest
            step = self._steps[(size, drafts)] = self._static_step(size, drafts, capacity, hint)
        self._fill(step, input_ids, position_ids, metadata, lists)
        if not self.capture:
            return self._run_forward(step)[:num_requests]
        if step.graph is None:
            self._capture(step)
        step.graph.replay()
        return step.logits[:num_requests]

    def _lists(self, metadata: AttentionMetadata) -> KVView:
        """The lists the step reads: the draft lists (any layer's: all share indptr and length) or the full."""
        if metadata.num_drafts:
            return metadata.draft[next(iter(self.sparse_layers))]
        return metadata.full

    def _static_step(self, size: int, drafts: bool, capacity: int, max_list_len: int) -> _StaticStep:
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=self.device)  # noqa: E731
        indptr = zeros(size + 1)
        empty = KVView(zeros(1), zeros(0), 0)
        layer_lists: dict[int, torch.Tensor] = {}
        if drafts:
            layer_lists = {layer: zeros(heads, capacity) for layer, heads in self.sparse_layers.items()}
            full, draft = empty, {layer: KVView(indptr, lists, max_list_len) for layer, lists in layer_lists.items()}
        else:
            full, draft = KVView(indptr, zeros(capacity), max_list_len), {}
        metadata = AttentionMetadata(
            slot_mapping=torch.full((size,), self.pool.scratch_slot, dtype=torch.int64, device=self.device),
            cu_seqlens_q=torch.arange(size + 1, device=self.device),
            windowed={},
            full=full,
            num_drafts=size if drafts else 0,
            draft=draft,
            max_q_len=1,
        )
        return _StaticStep(
            size=size,
            drafts=drafts,
            input_ids=zeros(1, size),
            position_ids=zeros(1, size),
            rows=torch.arange(size, device=self.device),
            metadata=metadata,
            list_capacity=capacity,
            layer_lists=layer_lists,
        )

    def _fill(
        self,
        step: _StaticStep,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        metadata: AttentionMetadata,
        lists: KVView,
    ) -> None:
        """Copy the step into the bucket's buffers; padding requests get empty lists and the scratch slot."""
        n, static = input_ids.shape[1], step.metadata
        step.input_ids[:, :n] = input_ids
        step.position_ids[:, :n] = position_ids
        static.slot_mapping[:n] = metadata.slot_mapping
        static.slot_mapping[n:] = self.pool.scratch_slot
        indptr = (static.draft[next(iter(self.sparse_layers))] if step.drafts else static.full).kv_indptr
        indptr[: n + 1] = lists.kv_indptr
        indptr[n + 1 :] = lists.kv_indptr[-1]
        count = lists.kv_indices.shape[-1]
        if step.drafts:
            for layer, buffer in step.layer_lists.items():
                buffer[:, :count] = metadata.draft[layer].kv_indices
        else:
            static.full.kv_indices[:count] = lists.kv_indices

    def _run_forward(self, step: _StaticStep) -> torch.Tensor:
        context = PagedForwardContext(metadata=step.metadata, pool=self.pool, ops=self.ops)
        with forward_context(context):
            output = self.forward(
                input_ids=step.input_ids, position_ids=step.position_ids, use_cache=False, logits_to_keep=step.rows
            )
        return output.logits[0]

    def _capture(self, step: _StaticStep) -> None:
        """Warm up on a side stream (kernels compile, allocators settle), then capture. The warm-up runs the
        step itself, writing the same K/V the replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run_forward(step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            step.logits = self._run_forward(step)
        step.graph = graph

    @property
    def num_captured(self) -> int:
        return sum(step.graph is not None for step in self._steps.values())
