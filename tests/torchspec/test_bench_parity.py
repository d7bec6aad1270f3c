"""The parity harness really runs both generators and compares them (a small CPU run)."""

from __future__ import annotations

import pytest

from torchspec.bench.hf_parity import compare

pytestmark = pytest.mark.slow


def test_parity_harness_compares_real_generations():
    """fp32 on CPU: the harness reports every row identical for each backend, with timings for every side."""
    result = compare(None, "float32", "cpu", num_prompts=2, max_new_tokens=8, backends=("reference", "auto"))
    assert result["transformers_s"] > 0
    for backend in ("reference", "auto"):
        run = result[backend]
        assert run["identical"] and run["rows_identical"] == 2 and run["rows_first_8_equal"] == 2
        assert run["seconds"] > 0 and run["stats"].startswith("2 requests")
    assert result["auto"]["vs_reference"] == {"rows_identical": 2, "rows_first_8_equal": 2}
