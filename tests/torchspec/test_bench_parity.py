"""The parity harness really runs both generators and compares them (a small CPU run)."""

from __future__ import annotations

import pytest

from torchspec.bench.hf_parity import compare

pytestmark = pytest.mark.slow


def test_parity_harness_compares_real_generations():
    """fp32 on CPU: the harness reports every row identical, with timings for both sides."""
    result = compare(None, "float32", "cpu", num_prompts=2, max_new_tokens=8)
    assert result["identical"] and result["rows_identical"] == 2 and result["rows_first_8_equal"] == 2
    assert result["transformers_s"] > 0 and result["torchspec_s"] > 0
    assert result["torchspec_stats"].startswith("2 requests")
