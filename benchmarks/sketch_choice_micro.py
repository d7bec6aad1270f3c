"""GPU micro-benchmark of query_sketch's choice in one layer at W1's shapes: 256 draft requests, SmolLM2's 3 KV heads
of 64 (GQA groups of 3), contexts spread over 160-8,352 positions (mean ~4.2K), sparsity 0.05 with the GPU's step
share (256 positions), an 8x shortlist. A round's first draft scores every older position and keeps its shortlist;
a later one rescores its sinks and shortlist; slots laid out as an allocator hands them out (one contiguous run a
request) and at random. Each op timed alone (``torch.cuda.Event``s over 20 calls), then the layer's whole choice,
and a round's estimate (30 layers x (one first + 7 later choices)). Random keys; CUDA only; one JSON record per
line.

    python benchmarks/sketch_choice_micro.py > benchmarks/results/sketch_choice_micro_h200.jsonl
"""

import json
import math
from dataclasses import dataclass

import torch
from select_micro import milliseconds  # a sibling script (run from this folder's path)

from attention import ops

DEVICE = "cuda"
REQUESTS, HEADS, GROUP, HEAD_DIM, LONGEST = 256, 3, 3, 64, 8352
SINKS, WINDOW, SHORTLIST, STEP_SHARE, SPARSITY, K = 4, 64, 8, 256, 0.05, 8


@dataclass
class Batch:
    query: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    table: torch.Tensor
    rows: torch.Tensor
    listed: torch.Tensor
    sinks: torch.Tensor
    older: torch.Tensor
    recent: torch.Tensor
    count: torch.Tensor
    picks: int


def time_choice(
    b: Batch, prefix: torch.Tensor, lengths: torch.Tensor, width: int, kept: torch.Tensor | None
) -> dict[str, float]:
    """Each op of one layer's choice, for candidates ``prefix`` positions then ``lengths`` shortlisted; with
    ``kept``, the first choice's shortlist too (written for the later choice to rescore)."""
    candidates = (prefix + lengths)[:, None]
    list_width = SINKS + K + WINDOW + 1 + b.picks
    score = lambda: ops.sketch_mass(  # noqa: E731
        b.query, b.codes, b.scales, b.table, b.rows, prefix, b.listed, lengths, 0.125, b.sinks, width
    )
    mass = score()
    picks = ops.top_k_positions(mass, b.count[:, None], b.picks, candidates)
    timings = {
        "sketch_mass": milliseconds(score),
        "top_k_picks": milliseconds(lambda: ops.top_k_positions(mass, b.count[:, None], b.picks, candidates)),
        "sketch_lists": milliseconds(
            lambda: ops.sketch_lists(
                picks, b.table, b.rows, prefix, b.listed, lengths, b.sinks, b.older, b.recent, 1, list_width
            )
        ),
    }
    if kept is not None:
        shortlist = lambda: ops.top_k_positions(mass, kept[:, None], b.listed.shape[-1], candidates)  # noqa: E731
        timings["top_k_shortlist"] = milliseconds(shortlist)
        b.listed[: b.rows.shape[0]] = shortlist()
    timings["layer"] = sum(timings.values())
    return timings


def main() -> None:
    torch.manual_seed(0)
    contexts = torch.randint(160, LONGEST, (REQUESTS,), device=DEVICE)
    slots = REQUESTS * LONGEST
    k_cache = torch.randn(slots, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    codes = torch.zeros(slots, HEADS, HEAD_DIM // 2, dtype=torch.uint8, device=DEVICE)
    scales = torch.zeros(slots, HEADS, device=DEVICE)
    ops.store_key_sketch(k_cache, torch.arange(slots, device=DEVICE), codes, scales)
    older = contexts - K - 1 - WINDOW  # the recent start
    sinks = torch.full_like(older, SINKS)
    budget = torch.clamp((contexts.double() * SPARSITY).ceil().long(), min=STEP_SHARE)
    count = (budget - (contexts - older) - sinks).clamp(min=1)
    picks = max(STEP_SHARE, math.ceil(SPARSITY * LONGEST))
    batch = Batch(
        query=torch.randn(REQUESTS, HEADS, GROUP, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16),
        codes=codes,
        scales=scales,
        table=torch.empty(0, dtype=torch.int64, device=DEVICE),  # each layout's below
        rows=torch.arange(REQUESTS, device=DEVICE),
        listed=torch.full((REQUESTS + 1, HEADS, SHORTLIST * picks), -1, dtype=torch.int32, device=DEVICE),
        sinks=sinks,
        older=older,
        recent=contexts - older,
        count=count,
        picks=picks,
    )
    kept = torch.minimum(count * SHORTLIST, older - sinks)
    # Slots as a run's allocator hands them out (a request's worst case at admission: one contiguous run), and
    # scattered at random (a pool after much offloading): the scoring gathers a key's 36 bytes from its slot.
    for layout, table in (
        ("contiguous", torch.arange(slots, device=DEVICE).view(REQUESTS, LONGEST)),
        ("random", torch.randperm(slots, device=DEVICE).view(REQUESTS, LONGEST)),
    ):
        batch.table = table
        first = time_choice(batch, older, torch.zeros_like(older), LONGEST, kept)  # writes the shortlists
        later = time_choice(batch, sinks, kept, SINKS + batch.listed.shape[-1], None)
        for name, timings in (("first", first), ("later", later)):
            record = {
                "choice": name,
                "slots": layout,
                "requests": REQUESTS,
                "mean_context": float(contexts.float().mean()),
            }
            print(json.dumps(record | {"ms": {key: round(value, 4) for key, value in timings.items()}}))
        round_ms = 30 * (first["layer"] + (K - 1) * later["layer"])
        print(
            json.dumps({"slots": layout, "round_estimate_ms": round(round_ms, 3), "layers": 30, "later_choices": K - 1})
        )


if __name__ == "__main__":
    main()
