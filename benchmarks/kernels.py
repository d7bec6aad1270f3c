"""Kernel benchmark: the Triton paged attention against FlexAttention decoding and SDPA, in effective HBM
bandwidth (bytes of K/V a case must read / time).

Cases per (model shape, batch, context): ``decode`` (1 query, full list), ``verify`` (k + 1 = 9 queries, full
list), ``verify_scored`` (the verify also writing PillarAttn's verify mass), ``draft`` (1 query, per-KV-head
lists of 5% of the context, gathered rows), and ``mixed`` (1 verify per 8 drafts) as one fused launch and as
two launches. FlexAttention and SDPA decode over a dense ``[B, Hkv, L, D]`` copy of the same K/V (their
best case: no paging). Times are medians of CUDA-graph replays (no host overhead), caches flushed.

    python -m benchmarks.kernels --out kernels.jsonl
    python -m benchmarks.kernels --report kernels.jsonl      # markdown table of a finished run (any kind)
    python -m benchmarks.kernels --sweep --batches 32 128 --contexts 8192 --out sweep.jsonl
        # every launch configuration (BLOCK_N x warps x stages) for our cases, records tagged with it
    python -m benchmarks.kernels --no-baselines --cases decode verify --split-overhead 0 2 8
        # the split planner's per-program cost (split_overhead) per value, records tagged with it
    python -m benchmarks.kernels --no-baselines --cases verify --splits 1 2 4 8 16
        # each split count forced on every launch, records tagged with it
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e
K = 8  # drafts per round: a verify has K + 1 queries, a mixed batch 1 verify per K drafts
SPARSITY = 0.05
FLOOR_CONTEXT = 40  # a draft's budget here is two entries: one older position and the newest


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = {
    "smollm2": Shape("smollm2", 9, 3, 64),
    "qwen3-8b": Shape("qwen3-8b", 32, 8, 128),
}


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception:  # not capturable (e.g. a compiled function that re-guards): time eagerly
        return float(triton.testing.do_bench(fn, rep=100, return_mode="median"))


class Case:
    """One (shape, batch, context) point: a paged pool with each request's slots contiguous (a fresh
    allocation), and the lists and queries every case reads."""

    def __init__(
        self, shape: Shape, batch: int, context: int, dtype: torch.dtype = torch.bfloat16, **tuning: object
    ) -> None:
        self.shape, self.batch, self.context = shape, batch, context
        # Launch choices pinned for a sweep (``launch``, ``num_splits``, ``split_overhead``: keyword arguments of
        # the Triton attention); none: the kernels' own.
        self.tuning = tuning
        device = torch.device("cuda")
        g = torch.Generator(device=device).manual_seed(0)
        slots = batch * context
        self.k_cache = torch.randn(slots, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype, generator=g)
        self.v_cache = torch.randn_like(self.k_cache)
        self.scale = shape.head_dim**-0.5
        self.full_indices = torch.arange(slots, device=device)
        self.full_indptr = torch.arange(batch + 1, device=device) * context
        self.row_bytes = shape.num_kv_heads * shape.head_dim * self.k_cache.element_size()  # one token's K (or V)
        budget = math.ceil(SPARSITY * context)
        # Per KV head: `budget - 1` random older positions (sorted) and the request's own newest token.
        older = torch.rand(batch, shape.num_kv_heads, context - 1, device=device, generator=g)
        picks = older.topk(budget - 1, dim=-1).indices.sort(dim=-1).values
        newest = torch.full((batch, shape.num_kv_heads, 1), context - 1, device=device, dtype=picks.dtype)
        positions = torch.cat([picks, newest], dim=-1)
        base = (torch.arange(batch, device=device) * context)[:, None, None]
        self.draft_indices = (positions + base).permute(1, 0, 2).reshape(shape.num_kv_heads, -1).contiguous()
        self.draft_indptr = torch.arange(batch + 1, device=device) * budget
        self.budget = budget

    def queries(self, q_len: int, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch or self.batch
        q = torch.randn(
            batch * q_len, self.shape.num_heads, self.shape.head_dim, device="cuda", dtype=self.k_cache.dtype
        )
        return q, torch.arange(batch + 1, device="cuda") * q_len


def _ours(case: Case, q_len: int, per_head: bool, scored: bool = False) -> tuple[Callable[[], object], int]:
    from attention import paged
    from attention.reference import MASS_DTYPE

    q, cu = case.queries(q_len)
    indptr, indices = (case.draft_indptr, case.draft_indices) if per_head else (case.full_indptr, case.full_indices)
    length = case.budget if per_head else case.context
    mass = {}
    if scored:
        mass = dict(
            mass=torch.empty(case.shape.num_kv_heads, case.batch, case.context, dtype=MASS_DTYPE, device="cuda"),
            num_scored_queries=torch.full((case.batch,), q_len, device="cuda"),
            max_scored_queries=q_len,
        )
    fn = lambda: paged.paged_attention(  # noqa: E731
        q,
        case.k_cache,
        case.v_cache,
        cu,
        indptr,
        indices,
        case.scale,
        max_q_len=q_len,
        max_kv_len=length,
        **mass,
        **case.tuning,
    )
    return fn, 2 * case.batch * length * case.row_bytes


def _draft_floor(case: Case) -> tuple[Callable[[], object], int]:
    """The draft launch of this batch over two-entry lists: its fixed cost, which a draft pays whatever its
    context (the time above it is the streaming part; the small sizes' bandwidth is bounded by it)."""
    return _ours(Case(case.shape, case.batch, FLOOR_CONTEXT, **case.tuning), 1, per_head=True)


def _mixed(case: Case, fused: bool) -> tuple[Callable[[], object], int]:
    """The first 8/9 of the batch draft (sparse lists), the rest verify (full lists)."""
    from attention import paged
    from attention.reference import FirstLists

    num_verify = max(1, case.batch // (K + 1))
    num_draft = case.batch - num_verify
    draft_q, draft_cu = case.queries(1, num_draft)
    verify_q, verify_cu = case.queries(K + 1, num_verify)
    draft_lists = FirstLists(num_draft, case.draft_indptr[: num_draft + 1], case.draft_indices, 1, case.budget)
    verify_indptr = case.full_indptr[: num_verify + 1]
    query = torch.cat([draft_q, verify_q])
    cu = torch.cat([draft_cu, verify_cu[1:] + num_draft])
    nbytes = 2 * (num_draft * case.budget + num_verify * case.context) * case.row_bytes
    if fused:
        return lambda: paged.paged_attention(
            query,
            case.k_cache,
            case.v_cache,
            cu,
            verify_indptr,
            case.full_indices,
            case.scale,
            max_q_len=K + 1,
            max_kv_len=case.context,
            first_lists=draft_lists,
            **case.tuning,
        ), nbytes

    def two_launches() -> None:
        paged.paged_attention(
            draft_q,
            case.k_cache,
            case.v_cache,
            draft_cu,
            draft_lists[1],
            draft_lists[2],
            case.scale,
            max_q_len=1,
            max_kv_len=case.budget,
            **case.tuning,
        )
        paged.paged_attention(
            verify_q,
            case.k_cache,
            case.v_cache,
            verify_cu,
            verify_indptr,
            case.full_indices,
            case.scale,
            max_q_len=K + 1,
            max_kv_len=case.context,
            **case.tuning,
        )

    return two_launches, nbytes


def _dense_baselines(case: Case) -> dict[str, tuple[Callable[[], object], int]]:
    """FlexAttention (compiled, decoding kernel) and SDPA over a dense copy of the K/V, one query per request."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    shape = case.shape
    dense = (case.batch, case.context, shape.num_kv_heads, shape.head_dim)
    k = case.k_cache.view(dense).transpose(1, 2).contiguous()
    v = case.v_cache.view(dense).transpose(1, 2).contiguous()
    q = torch.randn(case.batch, shape.num_heads, 1, shape.head_dim, device="cuda", dtype=k.dtype)
    flex = torch.compile(flex_attention, dynamic=False)
    nbytes = 2 * case.batch * case.context * case.row_bytes
    return {
        "flex_decode": (lambda: flex(q, k, v, scale=case.scale, enable_gqa=True), nbytes),
        "sdpa_decode": (lambda: F.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=True), nbytes),
    }


SWEEP = [(block_n, warps, stages) for block_n in (32, 64, 128) for warps in (2, 4, 8) for stages in (2, 3)]


def sweep(case: Case, cases: list[str] | None = None) -> list[dict]:
    """Our cases under every launch configuration of ``SWEEP`` (the kernel's own choice is bypassed)."""
    from attention import paged

    records = []
    pinned = case.tuning
    for block_n, warps, stages in SWEEP:
        case.tuning = {**pinned, "launch": paged.LaunchConfig(block_n, warps, stages)}
        for record in measure(case, baselines=False, cases=cases):
            records.append({**record, "block_n": block_n, "num_warps": warps, "num_stages": stages})
    case.tuning = pinned
    return records


OUR_CASES: dict[str, Callable[[Case], tuple[Callable[[], object], int]]] = {
    "decode": lambda case: _ours(case, 1, per_head=False),
    "verify": lambda case: _ours(case, K + 1, per_head=False),
    "verify_scored": lambda case: _ours(case, K + 1, per_head=False, scored=True),
    "draft": lambda case: _ours(case, 1, per_head=True),
    "draft_floor": _draft_floor,
    "mixed_fused": lambda case: _mixed(case, fused=True),
    "mixed_two_launches": lambda case: _mixed(case, fused=False),
}


def measure(case: Case, baselines: bool = True, cases: list[str] | None = None) -> list[dict]:
    """The ``cases`` (default: all of ours) of one point, as result records, with FlexAttention and SDPA
    unless ``baselines=False``."""
    records = []
    for name in cases or list(OUR_CASES):
        fn, nbytes = OUR_CASES[name](case)
        records.append(_record(case, name, fn, nbytes))
    if not baselines:
        return records
    try:
        for name, (fn, nbytes) in _dense_baselines(case).items():
            records.append(_record(case, name, fn, nbytes))
    except Exception as error:  # a baseline that cannot run at this shape is reported, not fatal
        records.append({**_point(case), "case": "dense_baselines", "error": repr(error)[:300]})
    return records


def _point(case: Case) -> dict:
    return {"shape": case.shape.name, "batch": case.batch, "context": case.context}


def _record(case: Case, name: str, fn: Callable[[], object], nbytes: int) -> dict:
    try:
        ms = _time_ms(fn)
    except Exception as error:
        return {**_point(case), "case": name, "error": repr(error)[:300]}
    tbps = nbytes / (ms * 1e-3) / 1e12
    return {
        **_point(case),
        "case": name,
        "ms": ms,
        "bytes": nbytes,
        "tb_per_s": tbps,
        "pct_peak": 100 * tbps * 1e12 / PEAK_BYTES_PER_S,
    }


#: Record keys of a run under several values of one kernel setting: the split planner's per-program cost, a forced
#: split count, and the fixed split target the planner replaced (kernels_h200_targets.jsonl).
SETTINGS = ("split_overhead", "splits", "target_programs")
COLUMNS = ["decode", "verify", "verify_scored", "draft", "draft_floor", "mixed_fused", "mixed_two_launches"]
COLUMNS += ["flex_decode", "sdpa_decode"]


def report(records: list[dict]) -> str:
    """Markdown: one row per point, % of peak HBM bandwidth per case, and the fused launch's speed-up; for a
    ``--sweep`` or ``--split-overhead`` run (or an older run's split targets), one row per (point, case) and one
    column per setting instead."""
    if any("block_n" in r for r in records):
        return _settings_table(records, lambda r: f"{r['block_n']}/{r['num_warps']}/{r['num_stages']}")
    for key in SETTINGS:
        if any(key in r for r in records):
            return _settings_table(records, lambda r, key=key: str(r[key]))
    points: dict[tuple, dict[str, dict]] = {}
    for r in records:
        points.setdefault((r["shape"], r["batch"], r["context"]), {})[r["case"]] = r
    lines = [
        "| shape | batch | context | " + " | ".join(COLUMNS) + " | fused speed-up |",
        "|---|---|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    for (shape, batch, context), cases in points.items():
        cells = []
        for column in COLUMNS:
            r = cases.get(column, {})
            cells.append(f"{r['pct_peak']:.0f}% ({r['ms'] * 1e3:.0f} us)" if "ms" in r else "-")
        fused, two = cases.get("mixed_fused", {}), cases.get("mixed_two_launches", {})
        speedup = f"{two['ms'] / fused['ms']:.2f}x" if "ms" in fused and "ms" in two else "-"
        lines.append(f"| {shape} | {batch} | {context} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines)


def _settings_table(records: list[dict], setting: Callable[[dict], str]) -> str:
    """Microseconds per call of each (point, case) under each setting (launch shape or split planning), the
    fastest in bold; a setting that failed at a point shows "-"."""
    rows: dict[tuple, dict[str, float]] = {}
    columns: dict[str, None] = {}
    for r in records:
        columns[setting(r)] = None
        if "ms" in r:
            rows.setdefault((r["shape"], r["batch"], r["context"], r["case"]), {})[setting(r)] = r["ms"] * 1e3
    lines = [
        "| shape | batch | context | case | " + " | ".join(columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for (shape, batch, context, case), times in rows.items():
        best = min(times.values())
        cells = [
            "-"
            if column not in times
            else f"**{times[column]:.0f}**"
            if times[column] == best
            else f"{times[column]:.0f}"
            for column in columns
        ]
        lines.append(f"| {shape} | {batch} | {context} | {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 128, 256])
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192, 16384])
    parser.add_argument("--out", default="kernels.jsonl", help="JSON lines, appended after every point")
    parser.add_argument("--report", metavar="JSONL", help="print the markdown table of a finished run and exit")
    parser.add_argument("--sweep", action="store_true", help="measure every launch configuration (no baselines)")
    parser.add_argument("--cases", nargs="+", choices=list(OUR_CASES), help="only these of our cases")
    parser.add_argument(
        "--baselines", action=argparse.BooleanOptionalAction, default=True, help="FlexAttention and SDPA decoding"
    )
    vary = parser.add_mutually_exclusive_group()
    vary.add_argument(
        "--split-overhead",
        nargs="+",
        type=int,
        help="measure under each of these per-program costs of the split planner (split_overhead)",
    )
    vary.add_argument(
        "--splits", nargs="+", type=int, help="measure with each of these split counts forced on every launch"
    )
    args = parser.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(report([json.loads(line) for line in f if line.strip()]))
        return
    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA GPU")
    from tqdm import tqdm

    points = [(s, b, c) for s in args.shapes for b in args.batches for c in args.contexts]
    varied = [  # (kernel keyword argument, record key, values): at most one is given
        ("split_overhead", "split_overhead", args.split_overhead),
        ("num_splits", "splits", args.splits),
    ]
    setting, key, values = next((v for v in varied if v[2]), ("num_splits", "", [None]))
    records = []
    for shape, batch, context in tqdm(points, desc="kernel benchmark"):
        case = Case(SHAPES[shape], batch, context)
        new = []
        for value in values:
            case.tuning = {setting: value} if value is not None else {}
            runs = sweep(case, args.cases) if args.sweep else measure(case, args.baselines, args.cases)
            new += [{**r, key: value} if value is not None else r for r in runs]
        del case
        torch.cuda.empty_cache()
        records.extend(new)
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
    if not args.sweep and not key:
        print(report(records))


if __name__ == "__main__":
    main()
