"""W1 over time: plain decoding and the default draft, each tree measured in one process, from the raw records.

    python benchmarks/plot_w1.py [benchmarks/results/throughput_w1_h200.jsonl] [docs/w1_h200.png]

Keeps the records of W1 itself (256 requests, 8,192 new tokens, default options) that carry a ``tree``, pairs
``none`` with ``pillar_recent`` of the same tree and session, and plots both rates and their ratio in the order
they were measured (the plot in docs/performance.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent


def w1_pairs(path: Path) -> tuple[list[tuple[str, float, float]], set[str]]:
    """(tree, none tok/s, pillar_recent tok/s) for every tree and session that ran both at W1's defaults, and the
    devices those runs name."""
    runs: dict[tuple[str, str], dict[str, float]] = {}
    devices = set()
    for line in path.read_text().splitlines():
        record = json.loads(line)
        w1 = record.get("requests") == 256 and record.get("max_new_tokens") == 8192 and not record.get("options")
        if w1 and record.get("tree") and record.get("setting") in ("none", "pillar_recent"):
            key = (record["tree"], str(record.get("session")))
            runs.setdefault(key, {})[record["setting"]] = record["tokens_per_s"]
            devices.add(record.get("device", "an unnamed GPU"))
    pairs = [(tree.split()[0], run["none"], run["pillar_recent"]) for (tree, _), run in runs.items() if len(run) == 2]
    return pairs, devices


def plot(pairs: list[tuple[str, float, float]], devices: set[str], out: Path) -> None:
    trees = [tree for tree, _, _ in pairs]
    x = range(len(pairs))
    figure, (rates, ratios) = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(pairs)), 6), sharex=True)
    rates.bar([i - 0.2 for i in x], [p[1] / 1e3 for p in pairs], 0.4, label="draft=None")
    rates.bar([i + 0.2 for i in x], [p[2] / 1e3 for p in pairs], 0.4, label="pillar_recent (default)")
    rates.set_ylabel("K tok/s")
    rates.legend()
    rates.set_title(f"W1 on one {' / '.join(sorted(devices))}: SmolLM2 bf16, 256 prompts x 8,192 sampled tokens")
    ratios.plot(list(x), [p[2] / p[1] for p in pairs], marker="o")
    ratios.axhline(1.0, color="grey", linewidth=0.8)
    ratios.axhline(2.0, color="red", linewidth=0.8, linestyle="--", label="issue 14's target")
    ratios.set_ylabel("speculation / plain")
    ratios.legend()
    ratios.set_xticks(list(x), trees, rotation=60, fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


def main() -> None:
    records = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "results" / "throughput_w1_h200.jsonl"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT.parent / "docs" / "w1_h200.png"
    pairs, devices = w1_pairs(records)
    plot(pairs, devices, out)
    print(f"{len(pairs)} trees -> {out}")


if __name__ == "__main__":
    main()
