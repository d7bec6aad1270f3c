"""The kernel benchmark's report (runs anywhere: it only reads records)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import kernel_case, kernels


def _record(case: str, ms: float, **setting) -> dict:
    return {"shape": "smollm2", "batch": 32, "context": 8192, "case": case, "ms": ms, **setting}


def test_sweep_records_become_one_column_per_launch_shape_with_the_fastest_in_bold():
    records = [
        _record("verify", 0.081, block_n=128, num_warps=2, num_stages=3),
        _record("verify", 0.088, block_n=128, num_warps=4, num_stages=3),
        _record("decode", 0.057, block_n=128, num_warps=4, num_stages=3),
    ]
    failed = {k: v for k, v in _record("decode", 0, block_n=128, num_warps=2, num_stages=3).items() if k != "ms"}
    records.append({**failed, "error": "out of resources"})
    lines = kernels.report(records).splitlines()
    assert lines[0] == "| shape | batch | context | case | 128/2/3 | 128/4/3 |"
    assert lines[2] == "| smollm2 | 32 | 8192 | verify | **81** | 88 |"
    assert lines[3] == "| smollm2 | 32 | 8192 | decode | - | **57** |"  # the failed setting shows "-"


@pytest.mark.parametrize("setting", kernels.SETTINGS)
def test_split_setting_records_become_one_column_per_value(setting):
    records = [_record("decode", 0.056, **{setting: 2}), _record("decode", 0.063, **{setting: 8})]
    lines = kernels.report(records).splitlines()
    assert lines[0] == "| shape | batch | context | case | 2 | 8 |"
    assert lines[2] == "| smollm2 | 32 | 8192 | decode | **56** | 63 |"


def test_plain_records_give_bandwidth_per_case_and_the_fused_speedup():
    records = [
        {**_record("mixed_fused", 0.015), "pct_peak": 39.0},
        {**_record("mixed_two_launches", 0.026), "pct_peak": 23.0},
    ]
    row = kernels.report(records).splitlines()[2]
    assert row.startswith("| smollm2 | 32 | 8192 |") and "39% (15 us)" in row and row.endswith("| 1.73x |")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the benchmark's cases live on the GPU)")
@pytest.mark.parametrize("case", ["verify", "draft_floor"])
def test_kernel_case_launches_one_case_for_a_profiler(case, monkeypatch):
    """``kernel_case`` runs a benchmark case (here a small verify and the draft floor) the number of times asked."""
    launches = []
    launch_case = kernels.OUR_CASES[case]

    def counted(point):
        launch, nbytes = launch_case(point)
        return (lambda: launches.append(launch())), nbytes

    monkeypatch.setitem(kernels.OUR_CASES, case, counted)
    kernel_case.main(["smollm2", "4", "256", case, "--repeats", "2"])
    assert len(launches) == 2
