"""Every gallery notebook runs in a real kernel; each checked cell's output shows what it should."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from conftest import run_processes
from nbtext import outputs_text


GALLERY = Path(__file__).resolve().parent.parent / "notebooks" / "gallery"
NOTEBOOKS = sorted(GALLERY.glob("[0-9]*.ipynb"))


def test_gallery_is_complete() -> None:
    assert len(NOTEBOOKS) >= 9
    index = (GALLERY / "README.md").read_text()
    assert all(nb.name in index for nb in NOTEBOOKS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook(path: Path, tmp_path: Path) -> None:
    before = set(run_processes())
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=150, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    checked = 0
    for cell in nb.cells:
        for expected in cell.metadata.get("distnb_expect", []):
            assert expected in outputs_text(cell), f"{path.name}: {expected!r} not in the output of\n{cell.source}\n---\n{outputs_text(cell)}"
            checked += 1
    assert checked >= 3
    assert set(run_processes()) - before == set(), "the notebook left worker processes behind"
