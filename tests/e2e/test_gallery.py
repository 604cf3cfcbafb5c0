"""The failure gallery: every notebook runs top to bottom in a real kernel, and its checked cells show
what they should (notebooks/gallery/_make.py puts the checks in each cell's metadata:
``distnb_expect`` text that must appear, ``distnb_reject`` text that must not, ``distnb_expect_re``
patterns a line must match, ``distnb_mime`` output types that must be produced). A cell that fails on
purpose carries Jupyter's ``raises-exception`` tag, which nbclient honours: it must fail, with distnb's
one-line error; an error in any other cell stops the notebook there, and the test with it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbtext import outputs_text

from conftest import run_notebook

pytestmark = pytest.mark.slow  # every test here starts processes

GALLERY = Path(__file__).resolve().parents[2] / "notebooks" / "gallery"
NOTEBOOKS = sorted(GALLERY.glob("[0-9]*.ipynb"))


def test_gallery_is_complete() -> None:
    assert len(NOTEBOOKS) >= 9, [p.name for p in NOTEBOOKS]
    index = (GALLERY / "README.md").read_text()
    assert all(p.name in index for p in NOTEBOOKS), "README.md does not list every notebook"
    for path in NOTEBOOKS:
        nb = nbformat.read(str(path), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), f"{path.name} is saved with outputs"
        assert code[0].source.startswith("%load_ext distnb\n%dist_launch"), path.name
        assert code[-1].source.strip() == "%dist_shutdown", f"{path.name} must end with %dist_shutdown"
        assert nb.cells[0].cell_type == "markdown" and "(0" in nb.cells[0].source.splitlines()[0], f"{path.name}: title without a seed reference"


def test_gallery_is_what_make_builds() -> None:
    """The committed notebooks are what notebooks/gallery/_make.py writes (edit the script, not them)."""
    sys.path.insert(0, str(GALLERY))
    try:
        import _make
    finally:
        sys.path.remove(str(GALLERY))
    assert sorted(f"{n.name}.ipynb" for n in _make.GALLERY) == [p.name for p in NOTEBOOKS]
    for nb_def in _make.GALLERY:
        saved = nbformat.read(str(GALLERY / f"{nb_def.name}.ipynb"), as_version=4)
        built = _make.build(nb_def)
        assert [(c.cell_type, c.source, dict(c.metadata)) for c in saved.cells] == \
            [(c.cell_type, c.source, dict(c.metadata)) for c in built.cells], (
            f"{nb_def.name}.ipynb is stale: run python notebooks/gallery/_make.py")


# A bound on a notebook gone wrong, not on how fast a machine is: its healthy cells end when done
# (37 s for the longest quiet), each bounded by its own --timeout (120 s, 180 s building DDP).
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook(path: Path, tmp_path: Path) -> None:
    # nbclient's bound per cell: past the longest --timeout a cell has (180 s), so distnb ends it first.
    nb = run_notebook(nbformat.read(str(path), as_version=4), str(tmp_path), "DISTNB_GALLERY_NOTEBOOK", timeout=240)

    checked = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        text = outputs_text(cell)
        where = f"{path.name}, cell:\n{cell.source}\n--- output:\n{text}"
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        if "raises-exception" in cell.metadata.get("tags", []):
            # It failed as meant to, shown as one line under its report (not a second traceback).
            assert [(e["ename"], len(e["traceback"])) for e in errors] == [("CellFailed", 1)], f"no CellFailed line in {where}"
            assert re.match(r"CellFailed: In\[\d+\] ", errors[0]["traceback"][0]), where  # named by its In[n]
            checked += 1
        else:  # nbclient stopped at it already; this says which cell
            assert not errors, f"the kernel raised in {where}"
        for expected in cell.metadata.get("distnb_expect", []):
            assert expected in text, f"{expected!r} missing from {where}"
            checked += 1
        for rejected in cell.metadata.get("distnb_reject", []):
            assert rejected not in text, f"{rejected!r} should not be in {where}"
            checked += 1
        for pattern in cell.metadata.get("distnb_expect_re", []):
            assert re.search(pattern, text, re.MULTILINE), f"no line matches {pattern!r} in {where}"
            checked += 1
        for mime in cell.metadata.get("distnb_mime", []):
            assert any(mime in o.get("data", {}) for o in cell.outputs), f"no {mime} output in {where}"
            checked += 1
    assert checked >= 8, f"{path.name}: only {checked} checks"
