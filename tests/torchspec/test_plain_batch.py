"""Plain steps select their tokens from columns kept per batch (``torchspec.plain_batch``), inside the step's
graph where one runs: the same tokens as the general selection (``TokenPicker.pick``), which a request keeping its
scores still takes."""

from __future__ import annotations

import pytest
import torch

from tests.torchspec.conftest import Batch, assert_no_slot_leak, tiny_spec
from torchspec import sparsespec
from torchspec.plain_batch import PlainBatch
from torchspec.request import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = tiny_spec("llama")
BATCH = Batch((5, 9, 4, 7, 6), seed=5)
OPTIONS = {"kv_capacity_tokens": 512, "max_batch_size": 8}


def _run(
    params: list[SamplingParams], cuda_graphs: bool, device: str = "cpu", seed: int = 0
) -> tuple[list[list[int]], list]:
    """Each request's tokens, and the selections the plain steps used (None: ``TokenPicker.pick`` selected). On
    CUDA with the Triton kernels, and graphs captured and replayed where ``cuda_graphs``."""
    backend = {"attention_backend": "triton"} if device == "cuda" else {}
    model = SPEC.build().to(device)
    wrapped = sparsespec.wrap(model, draft=None, cuda_graphs=cuda_graphs, **OPTIONS, **backend)
    engine = wrapped.engine
    pairs = enumerate(zip(BATCH.prompts, params, strict=True))
    requests = [engine.new_request(i, prompt, p) for i, (prompt, p) in pairs]
    used = []
    original = engine.runner._plain_batch

    def watched(plan):
        selection = original(plan)
        if not plan.has_prefill:
            used.append(selection)
        return selection

    engine.runner._plain_batch = watched
    torch.manual_seed(seed)
    for _ in engine.steps(requests):
        pass
    assert_no_slot_leak(wrapped)
    return [request.token_ids for request in requests], used


def _params(keep_scores: bool, **sampling) -> list[SamplingParams]:
    """Request i makes 6 + 2 i tokens at most, its stop token (7) forbidden for its first 3 + i."""
    return [
        SamplingParams(6 + 2 * i, 3 + i, stop_token_ids=(7,), output_scores=keep_scores, **sampling)
        for i in range(len(BATCH.prompts))
    ]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize(
    "sampling",
    [
        {"do_sample": False},
        {"do_sample": True, "temperature": 0.8, "top_k": 6},
        {"do_sample": True, "temperature": 1.3},
    ],
)
def test_plain_steps_select_the_tokens_the_general_selection_does(device, cuda_graphs, sampling):
    """Greedy, top-k sampled and unfiltered sampled batches draining one request at a time: every plain step took
    the kept columns (with ``cuda_graphs`` the whole step in the bucket's graph: inputs built from the slot table,
    forward, selection, the table advanced), and each request's tokens equal those of the same run where requests
    keep their scores (which ``TokenPicker.pick`` selects after a forward built by ``MetadataBuilder.build``),
    under the same seed."""
    ours, used = _run(_params(False, **sampling), cuda_graphs, device)
    assert used and all(selection is not None for selection in used)
    assert len({id(selection) for selection in used}) < len(used), "no selection kept for a batch's next step"
    theirs, general = _run(_params(True, **sampling), cuda_graphs, device)
    assert all(selection is None for selection in general)
    assert ours == theirs


def test_stop_tokens_stay_forbidden_below_min_new_tokens():
    """A greedy request whose stop token is its argmax at output 2: below ``min_new_tokens`` the plain step's
    selection forbids it (the token differs from the unconstrained run's), from there on it ends the request."""
    free, _ = _run([SamplingParams(8, 0, do_sample=False)] * len(BATCH.prompts), cuda_graphs=True)
    prompt_length = len(BATCH.prompts[0])
    stop = free[0][prompt_length + 2]
    held = [SamplingParams(8, 3, do_sample=False, stop_token_ids=(stop,))] * len(BATCH.prompts)
    ours, _ = _run(held, cuda_graphs=True)
    theirs, _ = _run(
        [SamplingParams(8, 3, do_sample=False, stop_token_ids=(stop,), output_scores=True)] * len(BATCH.prompts), True
    )
    assert ours == theirs
    assert ours[0][prompt_length + 2] != stop


def test_a_table_grown_mid_batch_gives_the_batch_new_columns():
    """A slot table that widens while the batch runs on (a request topped up past its width, with ``offload``)
    holds its state in new tensors: the batch's next step reads those (new columns, and its graph bucket made
    again), never the old ones, and the tokens stay those of a run without the growth."""
    params = [SamplingParams(8, 8, do_sample=False)] * len(BATCH.prompts)
    expected, _ = _run(params, cuda_graphs=True)
    wrapped = sparsespec.wrap(SPEC.build(), draft=None, cuda_graphs=True, **OPTIONS)
    engine = wrapped.engine
    requests = [
        engine.new_request(i, prompt, p) for i, (prompt, p) in enumerate(zip(BATCH.prompts, params, strict=True))
    ]
    batches = []
    for plan, _ in engine.steps(requests):
        held = engine.runner._plain[2]
        if held is not None and not plan.has_prefill:
            batches.append(held)
            if len(batches) == 2:
                table = engine.runner.table
                table._fit(2 * table.slots.shape[1])  # what a top-up past the width does
    assert [request.token_ids for request in requests] == expected
    assert batches[2] is not batches[1] and batches[2].reads(engine.runner.table)
    assert any(step.reason == "slot table grew" for step in engine.runner.graphs._steps.values())


def test_a_graphed_plain_step_builds_the_inputs_the_metadata_builder_does(monkeypatch):
    """Each plain step's inputs, as its graph builds them from the slot table (``PlainBatch.write_inputs``), equal
    what ``MetadataBuilder.build`` makes of its plan: fed tokens, positions, slots (padding rows: the scratch slot),
    query offsets and every request's list of slots (a batch of 5 padded to a bucket of 8, draining)."""
    wrapped = sparsespec.wrap(SPEC.build(), draft=None, cuda_graphs=True, **OPTIONS)
    engine, runner = wrapped.engine, wrapped.engine.runner
    launched, compared = [], []
    launch, write_inputs = runner.launch, PlainBatch.write_inputs

    def launching(plan):
        launched.append(plan)
        return launch(plan)

    def writing(batch, input_ids, position_ids, metadata, scratch_slot):
        write_inputs(batch, input_ids, position_ids, metadata, scratch_slot)
        ids, positions, expected = runner.builder.build(launched[-1])
        count = ids.shape[1]
        assert torch.equal(input_ids[0, :count], ids[0]) and torch.equal(position_ids[0, :count], positions[0])
        assert torch.equal(metadata.slot_mapping[:count], expected.slot_mapping)
        assert bool((metadata.slot_mapping[count:] == scratch_slot).all())
        assert torch.equal(metadata.cu_seqlens_q[: count + 1], expected.cu_seqlens_q)
        indptr = expected.full.kv_indptr
        assert torch.equal(metadata.full.kv_indptr[: count + 1], indptr)
        assert bool((metadata.full.kv_indptr[count:] == indptr[-1]).all())  # padding rows: empty lists
        assert torch.equal(metadata.full.kv_indices[: int(indptr[-1])], expected.full.kv_indices)
        compared.append(count)

    runner.launch = launching
    monkeypatch.setattr(PlainBatch, "write_inputs", writing)
    params = [SamplingParams(3 + 2 * i, 0, do_sample=True, temperature=0.9) for i in range(len(BATCH.prompts))]
    requests = [
        engine.new_request(i, prompt, p) for i, (prompt, p) in enumerate(zip(BATCH.prompts, params, strict=True))
    ]
    for _ in engine.steps(requests):
        pass
    assert compared and max(compared) == len(BATCH.prompts) and min(compared) < max(compared), compared
