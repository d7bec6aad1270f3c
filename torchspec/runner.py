"""The one place that executes: a StepPlan becomes device metadata, one packed forward, and step results."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import ModuleType

import torch

from torchspec.drafting import DraftPolicy
from torchspec.hf import AttentionMetadata, KVView, PagedForwardContext, forward_context
from torchspec.kv_cache import KVPool, LayerSpec
from torchspec.sampling import suppress_stop_tokens, warped_probs
from torchspec.scheduler import Phase, ScheduledRequest, StepPlan, StepResult
from torchspec.speculative import accept_greedy, accept_sampled


class Runner:
    """Runs the wrapped transformers model on packed batches over the paged KV pool."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        layers: Sequence[LayerSpec],
        ops: ModuleType,
        device: torch.device,
        policy: DraftPolicy | None = None,
        generator: torch.Generator | None = None,
        compile_model: bool = False,
    ) -> None:
        self.model = model
        # Dynamic shapes: the packed token count changes every step; attention is one opaque op per layer.
        self.forward = torch.compile(model, dynamic=True) if compile_model else model
        self.pool = pool
        self.ops = ops
        self.device = device
        self.policy = policy
        self.generator = generator
        self.windows = sorted({layer.sliding_window for layer in layers if layer.sliding_window is not None})
        self.num_kv_heads = {layer.layer_idx: layer.num_kv_heads for layer in layers}

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def build_metadata(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the packed batch, built once for all layers."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_seqlens_q = [0]
        windowed = {w: ([0], []) for w in self.windows}
        full: tuple[list[int], list[int]] = ([0], [])
        for item in plan.scheduled:
            request, start = item.request, item.first_position
            end = start + item.num_query_tokens
            input_ids.extend(item.query_token_ids())
            positions.extend(range(start, end))
            slot_mapping.extend(request.slots[start:end])
            cu_seqlens_q.append(cu_seqlens_q[-1] + item.num_query_tokens)
            for window, (indptr, indices) in windowed.items():
                # A sliding-window layer reads only the entries some query of this step can still see.
                indices.extend(request.slots[max(0, start - window + 1) : end])
                indptr.append(len(indices))
            if item.phase is not Phase.DRAFT:
                full[1].extend(request.slots[:end])
                full[0].append(len(full[1]))
        num_drafts = plan.num_drafts
        scored = self._scored_queries(plan.scheduled[num_drafts:])
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping),
            cu_seqlens_q=self._tensor(cu_seqlens_q),
            windowed={w: self._view(p, i) for w, (p, i) in windowed.items()},
            full=self._view(*full),
            num_drafts=num_drafts,
            draft=self._draft_views(plan.scheduled[:num_drafts]),
            draft_select=self._draft_selector(plan.scheduled[:num_drafts]),
            num_scored_queries=None if not any(scored) else self._tensor(scored),
            max_q_len=max(item.num_query_tokens for item in plan.scheduled),
            max_scored_queries=max(scored, default=0),
        )
        return self._tensor(input_ids)[None], self._tensor(positions)[None], metadata

    def _view(self, indptr: Sequence[int], indices: Sequence[int]) -> KVView:
        lengths = [end - start for start, end in itertools.pairwise(indptr)]
        return KVView(self._tensor(indptr), self._tensor(indices), max(lengths, default=0))

    def _scored_queries(self, items: Sequence[ScheduledRequest]) -> list[int]:
        """Trailing queries whose attention mass the policy learns from: all queries of a verify, the last
        k + 1 of a final prefill chunk."""
        if self.policy is None or not self.policy.uses_verify_scores:
            return [0] * len(items)
        k_plus_1 = self.policy.config.k + 1
        return [min(item.num_query_tokens, k_plus_1) if item.samples else 0 for item in items]

    def _draft_views(self, items: Sequence[ScheduledRequest]) -> dict[int, KVView]:
        """Per sparse layer, each draft request's per-KV-head slot lists (its policy's positions, as slots).

        Built for all layers at once (one gather per request, one host-to-device copy per step): per-layer
        work here would cost more host time than the draft step's attention."""
        if not items or self.policy.selects_in_attention:
            return {}
        num_layers, num_heads = len(self.policy.sparse_layers), self.policy.num_kv_heads
        positions = []
        for item in items:
            chosen = self.policy.draft_positions(item.request, item.first_position)
            positions.append(chosen.expand(num_layers, num_heads, -1) if chosen.dim() == 1 else chosen)
        view = self._per_head_view(items, positions)  # lists [layers, Hkv, N]
        return {
            layer: KVView(view.kv_indptr, view.kv_indices[i, : self.num_kv_heads[layer]], view.max_len)
            for i, layer in enumerate(self.policy.sparse_layers)
        }

    def _per_head_view(self, items: Sequence[ScheduledRequest], positions: Sequence[torch.Tensor]) -> KVView:
        """Per-KV-head slot lists from per-head positions (``[..., Hkv, n]`` each; -1 stays padding)."""
        lists, indptr = [], [0]
        for item, chosen in zip(items, positions, strict=True):
            slots = torch.tensor(item.request.slots[: item.first_position + 1], device=chosen.device)
            lists.append(torch.where(chosen >= 0, slots[chosen.clamp(min=0)], -1))
            indptr.append(indptr[-1] + chosen.shape[-1])
        max_len = max(p.shape[-1] for p in positions)
        return KVView(self._tensor(indptr), torch.cat(lists, dim=-1).to(self.device), max_len)

    def _draft_selector(self, items: Sequence[ScheduledRequest]):
        """For query-aware policies: pick each draft request's lists from the layer's own draft queries."""
        if not items or not self.policy.selects_in_attention:
            return None

        def select(layer: int, queries: torch.Tensor, k_cache: torch.Tensor, scale: float) -> KVView:
            positions = []
            for item, query in zip(items, queries, strict=True):
                slots = self._tensor(item.request.slots[: item.first_position + 1])
                chosen = self.policy.select_positions(
                    item.request, item.first_position, layer, query, k_cache[slots], scale
                )
                positions.append(chosen.to(self.device))
            return self._per_head_view(items, positions)

        return select

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[StepResult]:
        """Execute one step: the forward, the policy's learning from verify attention, token selection."""
        input_ids, position_ids, metadata = self.build_metadata(plan)
        rows, first_row = [], []
        for i, item in enumerate(plan.scheduled):
            first_row.append(len(rows))
            if item.samples:
                end = metadata.cu_seqlens_q[i + 1].item()
                count = item.num_query_tokens if item.phase is Phase.VERIFY else 1
                rows.extend(range(end - count, end))
        context = PagedForwardContext(metadata=metadata, pool=self.pool, ops=self.ops)
        with forward_context(context):
            output = self.forward(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=self._tensor(rows)
            )
        self._learn_from_verify(plan, metadata)
        return self._select(plan, output.logits[0].float(), first_row)

    def _learn_from_verify(self, plan: StepPlan, metadata: AttentionMetadata) -> None:
        if self.policy is None:
            return
        full_items = plan.scheduled[metadata.num_drafts :]
        indptr = metadata.full.kv_indptr.tolist()
        scored = [0] * len(full_items) if metadata.num_scored_queries is None else metadata.num_scored_queries
        for j, item in enumerate(full_items):
            if not item.samples:
                continue
            first_query = item.first_position + item.num_query_tokens - (int(scored[j]) or item.num_query_tokens)
            mass = None
            if int(scored[j]) and self.policy.sparse_layers:  # [layers, Hkv, context], stays on the device
                mass = torch.stack(
                    [metadata.mass[layer][:, indptr[j] : indptr[j + 1]] for layer in self.policy.sparse_layers]
                )
            self.policy.on_verify(item.request, mass, first_query)

    def _select(self, plan: StepPlan, logits: torch.Tensor, first_row: list[int]) -> list[StepResult]:
        """Tokens from the logits rows of each request: draft samples, verified tokens (see speculative.py)."""
        row_params, row_output_index = [], []
        for item in plan.scheduled:
            if not item.samples:
                continue
            request = item.request
            count = item.num_query_tokens if item.phase is Phase.VERIFY else 1
            base = request.num_output_tokens + (len(request.round.tokens) if item.phase is Phase.DRAFT else 0)
            row_params.extend([request.params] * count)
            row_output_index.extend(range(base, base + count))
        below_minimum = [
            row
            for row, (p, index) in enumerate(zip(row_params, row_output_index, strict=True))
            if index < p.min_new_tokens
        ]
        suppress_stop_tokens(logits, below_minimum, [row_params[row].stop_token_ids for row in below_minimum])
        sampled_rows = [row for row, params in enumerate(row_params) if not params.greedy]
        probs = {}
        if sampled_rows:
            warped = warped_probs(logits[sampled_rows], [row_params[row] for row in sampled_rows])
            probs = dict(zip(sampled_rows, warped, strict=True))
        argmax = logits.argmax(dim=-1).tolist()
        results = []
        for item, row in zip(plan.scheduled, first_row, strict=True):
            if not item.samples:
                results.append(StepResult())
            elif item.phase is Phase.DRAFT:
                results.append(self._draft_result(row, argmax, probs, logits))
            else:
                results.append(self._verify_result(item, row, argmax, probs))
        return results

    def _draft_result(
        self, row: int, argmax: list[int], probs: dict[int, torch.Tensor], logits: torch.Tensor
    ) -> StepResult:
        entropy = None
        if self.policy.uses_draft_entropy:
            log_probs = logits[row].log_softmax(dim=-1)
            entropy = float(-(log_probs.exp() * log_probs).nan_to_num().sum())
        if row not in probs:
            return StepResult(draft_token=argmax[row], draft_entropy=entropy)
        token = int(torch.multinomial(probs[row], 1, generator=self.generator))
        return StepResult(draft_token=token, draft_probs=probs[row], draft_entropy=entropy)

    def _verify_result(
        self, item: ScheduledRequest, row: int, argmax: list[int], probs: dict[int, torch.Tensor]
    ) -> StepResult:
        drafts = item.request.round.tokens if item.phase is Phase.VERIFY else []
        count = len(drafts) + 1
        if row not in probs:
            accepted, tokens = accept_greedy(argmax[row : row + count], drafts)
        else:
            target = torch.stack([probs[r] for r in range(row, row + count)])
            draft_probs = item.request.round.probs
            if drafts and draft_probs[0] is None:  # proposed tokens: a point mass on each proposal
                draft_probs = [
                    torch.nn.functional.one_hot(torch.tensor(t), target.shape[-1]).to(target) for t in drafts
                ]
            accepted, tokens = accept_sampled(target, drafts, draft_probs, self.generator)
        return StepResult(tokens=tokens, num_accepted=accepted)
