"""Where a throughput run's time goes as its batch drains: steps, seconds and milliseconds a step by running batch
size (the records' ``steps_by_batch``) with the host's time a step in each phase (where it waits on the read-back,
the GPU sets the pace), what the slowest answers accepted, and, for runs with EOS held back, what
the run would take if every request needed the mean number of rounds at the full batch's step time (issue 14: on W1
every request makes the same 8,192 tokens, so the answers whose drafts fall short set the run's end alone).

    python -m benchmarks.drain_report RECORDS.jsonl [SETTING ...]

Reads every record of ``RECORDS.jsonl`` (``python -m torchspec.bench.throughput ... --out RECORDS.jsonl``) with a
``steps_by_batch``, or those whose ``setting`` is named; prints one markdown table per record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torchspec.bench.records import record_setting
from torchspec.engine import HOST_PHASES


def drain_table(record: dict) -> str:
    """The record's steps by batch size as markdown, then a line on its drain."""
    buckets = record["steps_by_batch"]
    total = sum(bucket["seconds"] for bucket in buckets)
    lines = [
        f"{record_setting(record)} on {record['device']} (tree {record.get('tree')}): "
        f"{record['tokens_per_s']:,.0f} tok/s, {record['steps']} steps in {record['seconds']:.1f} s",
        "",
        "| running requests | steps | seconds | ms a step | share of the run | host ms a step: "
        f"{' / '.join(HOST_PHASES)} |",
        "|---|---|---|---|---|---|",
    ]
    bounds = [bucket["batch_from"] for bucket in buckets]
    for bucket, upper in zip(buckets, [None, *bounds[:-1]], strict=True):
        span = f"{bucket['batch_from']}" if upper is None else f"{bucket['batch_from']}-{upper - 1}"
        seconds, steps = bucket["seconds"], bucket["steps"]
        # Records before session 46 kept no host phases by batch size.
        host = bucket.get("host_ms_per_step")
        host = " / ".join(f"{host[phase]:.1f}" for phase in HOST_PHASES) if host else "-"
        lines.append(
            f"| {span} | {steps} | {seconds:.2f} | {1000 * seconds / steps:.1f} | {seconds / total:.0%} | {host} |"
        )
    full = buckets[0]
    drain = total - full["seconds"]
    line = f"\nAfter the largest batch (the first request finished): {drain:.1f} s of {total:.1f} ({drain / total:.0%})"
    if record.get("mean_accepted") and "request_accepted_p10_p50_p90" in record and not record.get("natural_lengths"):
        # Every request's rounds at the run's mean acceptance (all make max_new_tokens), at the full batch's step time.
        rounds = record["max_new_tokens"] / (1 + record["mean_accepted"])
        even = rounds * full["seconds"] / full["steps"]
        p10, p50, p90 = record["request_accepted_p10_p50_p90"]
        slowest = ", ".join(f"{request['mean_accepted']:.2f}" for request in record["slowest_requests"])
        line += (
            f". Accepted per request: p10 {p10:.2f}, p50 {p50:.2f}, p90 {p90:.2f}; the slowest "
            f"{slowest}. Every request at the mean ({record['mean_accepted']:.2f}) and the full batch's step time: "
            f"{rounds:,.0f} rounds, {even:.1f} s ({record['generated_tokens'] / even:,.0f} tok/s)"
        )
    return "\n".join(lines) + line + "."


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    path, settings = Path(argv[0]), argv[1:]
    for text in path.read_text().splitlines():
        record = json.loads(text)
        if record.get("steps_by_batch") and (not settings or record_setting(record) in settings):
            print(drain_table(record), end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1:])
