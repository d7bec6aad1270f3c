"""Every notebook under tutorials/ runs top to bottom without a cell error, from a source checkout.

Protects the tutorials against API drift: a renamed argument or a changed output breaks a notebook long
before a user finds it. The kernel imports torchspec from this checkout (not an installed copy), so the test
works without ``pip install``.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO_ROOT / "tutorials").glob("*.ipynb"))
CELL_TIMEOUT_S = 600  # a loaded 2-core machine can be ~5x slower than an idle one


def _kernel_env() -> dict[str, str]:
    """The environment of the kernel: the repo root first on PYTHONPATH, so ``import torchspec`` finds the
    checkout; a headless matplotlib backend; this test process's intra-op threads (a worker's share of the cores
    when the suite runs in parallel: a kernel taking them all beside another worker ran 02_pillarattn past 10
    minutes, where it takes 2 alone)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return env


def test_tutorials_exist() -> None:
    """The tutorials folder is not silently empty (which would make the notebook test vacuous)."""
    assert NOTEBOOKS, f"no notebooks under {REPO_ROOT / 'tutorials'}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    """Executes every cell in a fresh python3 kernel, cwd = repo root; any cell error fails the test."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(REPO_ROOT)}},
    )
    # Extra arguments of execute() go to the kernel manager's start_kernel: env reaches the kernel process.
    client.execute(env=_kernel_env())
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"


def test_notebooks_are_stored_without_outputs() -> None:
    """Committed notebooks carry no outputs or execution counts (they would go stale and bloat diffs)."""
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: cell {index} has outputs"
