"""The quickstart notebook, executed by a real Jupyter kernel through nbclient."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbtext import outputs_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_quickstart_executes(tmp_path: Path) -> None:
    nb = nbformat.read(str(ROOT / "notebooks" / "quickstart.ipynb"), as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env={**os.environ})
    texts = [outputs_text(c) for c in nb.cells if c.cell_type == "code"]
    assert "Out[ranks 0,1]: tensor([3., 3.])" in texts[1]
    assert "[ranks 0,1] hello from the pool" in texts[2]
    assert "ValueError on rank 1 at cell line 2" in texts[3] and "Out[rank 0]: 'fine'" in texts[3]
    assert "rank-conditional collective: rank 0 entered all_reduce #" in texts[4], texts[4]
    assert "in all_reduce" in texts[5]  # %dist_stacks annotates the waiting rank
    assert "first divergence" in texts[6]
    assert "{0: 0.1, 1: 0.1}" in texts[8]
    assert "rank 1 peaks at" in texts[10]
    memory_cell = [c for c in nb.cells if c.cell_type == "code"][10]
    assert any("image/png" in o.get("data", {}) for o in memory_cell.outputs), "the memory plot did not render"
    assert "pool stopped" in texts[-1]
    # In a kernel with ipywidgets each %%on_ranks cell is a live widget view with a text twin.
    first_cell = [c for c in nb.cells if c.cell_type == "code"][1]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in first_cell.outputs)
