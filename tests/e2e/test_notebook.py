"""The quickstart notebook, executed by a real Jupyter kernel through nbclient."""

from __future__ import annotations

import os
import re
import sys
import uuid
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_notebook
from nbtext import outputs_text

from conftest import marked_processes, reap_marked, wait_gone

pytestmark = pytest.mark.slow  # every test here starts processes

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"
MARK = "DISTNB_QUICKSTART_TEST"


def test_quickstart_is_generated_and_saved_without_outputs() -> None:
    """The committed notebook is what notebooks/_make_quickstart.py builds, with outputs cleared."""
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        import _make_quickstart
    finally:
        sys.path.remove(str(ROOT / "notebooks"))
    saved = nbformat.read(str(QUICKSTART), as_version=4)
    nbformat.validate(saved)
    built = _make_quickstart.build()
    assert [(c.cell_type, c.source, dict(c.metadata)) for c in saved.cells] == [(c.cell_type, c.source, dict(c.metadata)) for c in built.cells], (
        "notebooks/quickstart.ipynb is stale: run python notebooks/_make_quickstart.py"
    )
    code = [c for c in saved.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert saved.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.timeout(300)
def test_quickstart_executes(tmp_path: Path) -> None:
    nb = nbformat.read(str(QUICKSTART), as_version=4)
    mark = uuid.uuid4().hex
    seen: dict[str, set[int]] = {"kernel": set(), "pool": set(), "after_shutdown": set()}

    def on_cell_executed(cell, cell_index, execute_reply) -> None:
        provisioner = getattr(client.km, "provisioner", None)
        if getattr(provisioner, "pid", None):
            seen["kernel"].add(provisioner.pid)
        procs = marked_processes(MARK, mark) - seen["kernel"]
        if "%dist_launch" in cell.source:
            seen["pool"] |= procs
        elif cell.source.strip() == "%dist_shutdown":
            seen["after_shutdown"] = procs

    # cwd is a scratch folder, so the kernel imports distnb as installed, not from the checkout.
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", allow_errors=False, resources={"metadata": {"path": str(tmp_path)}},
        on_cell_executed=on_cell_executed,
    )
    client.execute(env={**os.environ, MARK: mark})

    code = [c for c in nb.cells if c.cell_type == "code"]

    def text(source_start: str) -> str:
        """The outputs of the (first) code cell whose source starts with ``source_start``."""
        return outputs_text(next(c for c in code if c.source.startswith(source_start)))

    assert "Out[ranks 0,1]: tensor([3., 3.])" in text("%%on_ranks\nx = torch.full")
    assert "[ranks 0,1] hello from the pool" in text("%%on_ranks\nimport time")
    error = text("%%on_ranks\nif rank == 1")
    assert "ValueError on rank 1 at cell line 2" in error and "Out[rank 0]: 'fine'" in error
    hang = text("%%on_ranks --timeout")
    assert "rank-conditional collective: rank 0 entered all_reduce #" in hang, hang
    # The two cells that fail on purpose raised (tagged raises-exception, so the tour ran on), each
    # as one line under its report; no other cell raised.
    raised = {c.source: [(o.ename, o.evalue, o.traceback) for o in c.outputs if o.output_type == "error"] for c in code}
    # A cell is named by its In[n], as the notebook shows it (distnb's own cell count is another number).
    numbers = {c.source: c.execution_count for c in code}
    bad = next(s for s in raised if s.startswith("%%on_ranks\nif rank == 1"))
    line = f"In[{numbers[bad]}] failed on rank 1: ValueError: rank 1 got a bad batch"
    assert raised.pop(bad) == [("CellFailed", line, [f"CellFailed: {line}"])]
    hung = next(s for s in raised if s.startswith("%%on_ranks --timeout"))
    [(ename, evalue, tb)] = raised.pop(hung)
    assert ename == "CellFailed" and tb == [f"CellFailed: {evalue}"]
    assert re.fullmatch(rf"In\[{numbers[hung]}\] timed out: rank 0 still running after 4\.\d s", evalue), evalue
    assert not any(raised.values()), raised
    assert "in all_reduce" in text("%dist_stacks")  # %dist_stacks annotates the waiting rank
    assert "first divergence" in text("%dist_collectives")
    assert "{0: 0.1, 1: 0.1}" in text("lr = 0.1")
    assert "rank 1 peaks at" in text("%dist_memory")
    assert any("image/png" in o.get("data", {}) for o in next(c for c in code if c.source.startswith("%dist_memory")).outputs), (
        "the memory plot did not render"
    )
    status = text("%dist_status")
    assert "pool ready: 2 ranks, backend gloo" in status
    rows = [line.split() for line in status.splitlines()[2:]]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[1].isdigit() and row[-1] == "idle" for row in rows), status
    assert "pool stopped" in text("%dist_shutdown")
    # Each finished %%on_ranks cell leaves one static output (HTML with its text twin) and no widget,
    # the hang's live view included: saved and reopened without a kernel, the notebook shows every
    # result, and so does nbconvert's HTML.
    for cell in (c for c in code if c.source.startswith("%%on_ranks")):
        kinds = [set(o.get("data", {})) for o in cell.outputs]
        assert {"text/plain", "text/html"} in kinds and not any("application/vnd.jupyter.widget-view+json" in k for k in kinds), kinds
    saved = tmp_path / "saved.ipynb"
    nbformat.write(nb, saved)
    from nbconvert import HTMLExporter

    page, _ = HTMLExporter().from_notebook_node(nbformat.read(saved, as_version=4))
    for shown in ("hello from the pool", "rank 1 of 2 on cpu", "rank-conditional collective", "ValueError on rank 1", "<details>"):
        assert shown in page, shown

    # The pool ran under the kernel, %dist_shutdown left none of its processes, and the kernel
    # itself is gone once nbclient is done.
    assert seen["kernel"] and len(seen["pool"]) >= 5, seen  # torchrun agent, a supervisor and a rank per rank
    assert not seen["after_shutdown"], f"processes left after %dist_shutdown: {seen['after_shutdown']}"
    assert not wait_gone(seen["kernel"] | seen["pool"], 10.0), "the kernel or a pool process outlived the notebook"
    assert not wait_gone(marked_processes(MARK, mark), 5.0)


RUN_ALL = ["%load_ext distnb\n%dist_launch -n 2 --backend gloo", "%%on_ranks\nif rank == 1:\n    raise ValueError('stop here')",
           "print('after the failure')", "%dist_shutdown"]


def _run_all(tags: list[str], cwd: Path) -> tuple[nbformat.NotebookNode, CellExecutionError | None]:
    """RUN_ALL executed by nbclient as CI runs a notebook (errors not allowed), the failing cell
    tagged ``tags``; the notebook and what stopped it. Nothing the kernel started may be left."""
    nb = new_notebook(cells=[new_code_cell(source) for source in RUN_ALL])
    nb.cells[1].metadata["tags"] = tags
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    token, stopped = uuid.uuid4().hex, None
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute(env={**os.environ, MARK: token})
    except CellExecutionError as exc:
        stopped = exc
    finally:
        left = reap_marked(MARK, token)
    assert not left, "the notebook left processes behind:\n  " + "\n  ".join(left)
    return nb, stopped


@pytest.mark.timeout(300)
def test_a_failed_cell_stops_run_all_unless_tagged(tmp_path: Path) -> None:
    nb, stopped = _run_all([], tmp_path)
    failed = nb.cells[1]
    errors = [o for o in failed.outputs if o.output_type == "error"]
    # The report first, then one line: the kernel's error output, whose traceback is that line alone.
    assert "ValueError on rank 1 at cell line 2" in outputs_text(failed) and failed.outputs[-1].output_type == "error"
    assert [(e.ename, e.evalue, e.traceback) for e in errors] == [
        ("CellFailed", "In[2] failed on rank 1: ValueError: stop here", ["CellFailed: In[2] failed on rank 1: ValueError: stop here"])]
    # nbclient stopped there, as CI does, and says why in one line; the cells after it never ran.
    assert stopped is not None and "CellFailed: In[2] failed on rank 1: ValueError: stop here" in str(stopped)
    assert all(not c.outputs and c.execution_count is None for c in nb.cells[2:])

    # Tagged raises-exception: the same error, and the notebook runs through to its shutdown.
    nb, stopped = _run_all(["raises-exception"], tmp_path)
    assert stopped is None and [o.ename for o in nb.cells[1].outputs if o.output_type == "error"] == ["CellFailed"]
    assert "after the failure" in outputs_text(nb.cells[2]) and "pool stopped" in outputs_text(nb.cells[3])
