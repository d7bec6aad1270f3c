"""The one place that executes: a StepPlan becomes device metadata, one packed forward, and sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from torchspec.hf import AttentionMetadata, KVView, PagedForwardContext, forward_context
from torchspec.kv_cache import KVPool, LayerSpec
from torchspec.sampling import sample_tokens, suppress_stop_tokens
from torchspec.scheduler import StepPlan


class Runner:
    """Runs the wrapped transformers model on packed batches over the paged KV pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        layers: Sequence[LayerSpec],
        ops: ModuleType,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.ops = ops
        self.device = device
        self.generator = generator
        self.windows = sorted({layer.sliding_window for layer in layers}, key=lambda w: (w is not None, w or 0))

    def build_metadata(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the packed batch, built once for all layers."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_seqlens_q = [0]
        lists: dict[int | None, tuple[list[int], list[int]]] = {w: ([0], []) for w in self.windows}
        for item in plan.scheduled:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_query_tokens
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(request.slots[start:end])
            cu_seqlens_q.append(cu_seqlens_q[-1] + item.num_query_tokens)
            for window, (indptr, indices) in lists.items():
                # A sliding-window layer reads only the entries some query of this step can still see.
                first = 0 if window is None else max(0, start - window + 1)
                indices.extend(request.slots[first:end])
                indptr.append(len(indices))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        metadata = AttentionMetadata(
            slot_mapping=as_tensor(slot_mapping),
            cu_seqlens_q=as_tensor(cu_seqlens_q),
            views={w: KVView(as_tensor(indptr), as_tensor(indices)) for w, (indptr, indices) in lists.items()},
        )
        return as_tensor(input_ids)[None], as_tensor(positions)[None], metadata

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[int | None]:
        """Execute one step; returns the sampled token of each scheduled request (None if it did not sample)."""
        input_ids, position_ids, metadata = self.build_metadata(plan)
        sampling = [i for i, item in enumerate(plan.scheduled) if item.samples]
        if not sampling:
            logits_rows = torch.zeros(0, dtype=torch.int64, device=self.device)
        else:
            logits_rows = metadata.cu_seqlens_q[1:][torch.tensor(sampling, device=self.device)] - 1
        context = PagedForwardContext(metadata=metadata, pool=self.pool, ops=self.ops)
        with forward_context(context):
            output = self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_rows
            )
        sampled: list[int | None] = [None] * len(plan.scheduled)
        if not sampling:
            return sampled
        logits = output.logits[0].float()
        requests = [plan.scheduled[i].request for i in sampling]
        below_minimum = [row for row, r in enumerate(requests) if r.num_output_tokens < r.params.min_new_tokens]
        suppress_stop_tokens(logits, below_minimum, [requests[row].params.stop_token_ids for row in below_minimum])
        tokens = sample_tokens(logits, [r.params for r in requests], self.generator).tolist()
        for i, token in zip(sampling, tokens, strict=True):
            sampled[i] = token
        return sampled
