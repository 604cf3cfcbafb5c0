"""A long notebook session in a real kernel: finished cells hand their widgets back, and the
kernel's GC-tracked objects grow only by the small record each cell keeps for replay and export."""

from __future__ import annotations

import json
from pathlib import Path

import kernels
import pytest

pytestmark = pytest.mark.slow  # a kernel and a pool

MARK = "DISTNB_SESSION_TEST"
#: Every live widget in the kernel: a module's dict from ipywidgets 8.0.5, the class's before.
INSTANCES = ("from ipywidgets.widgets import widget as _w\n"
             "_instances = _w._instances if hasattr(_w, '_instances') else _w.Widget._active_widgets\n")
PROBE = ("import gc, json\n" + INSTANCES + "gc.collect()\n"
         "print(json.dumps({'widgets': len(_instances), 'objects': len(gc.get_objects())}))")


@pytest.mark.timeout(300)
def test_hundreds_of_cells_leave_no_widget_and_little_else(leak_check, tmp_path: Path) -> None:
    kernel = kernels.Kernel(tmp_path, MARK)
    try:
        kernel.run("%load_ext distnb\n%dist_launch -n 2 --backend gloo")
        for i in range(120):  # past the session log's 100 full results: older cells shrink to records
            kernel.run(f"%%on_ranks\nx = {i}")  # distinct cells: the compiled-cell cache (32) is full before, as after
        before = json.loads(kernel.run(PROBE))
        # A slow cell goes live (widgets), a failing one and one with output stay static.
        kernel.run("%%on_ranks\nimport time\ntime.sleep(1.0)\nprint('slow', rank)")
        assert json.loads(kernel.run(INSTANCES + "print(len(_instances))")) == before["widgets"]
        # A failing cell, in a Run All: its report, then one line of error (no second traceback), and
        # the cell queued behind it is aborted by the kernel, as JupyterLab's Run All relies on.
        # ipykernel 7 aborts only the requests that have reached it when the error is replied (its
        # shell-channel thread forwards them; stop_on_error_timeout is not used there), so the
        # rank fails after a pause that the queued request's delivery on loopback cannot outlast: a
        # rank that raised at once failed before it arrived, 1 time in 30 under load.
        (failed, shown), (queued, queued_shown) = kernel.run_all(
            ["%%on_ranks\nif rank == 1:\n    import time\n    time.sleep(2.0)\n    raise ValueError('x')", "print('ran anyway')"])
        errors = [o for o in shown if o["output_type"] == "error"]
        assert failed["status"] == "error" and failed["ename"] == "CellFailed", failed
        assert [e["traceback"] for e in errors] == [[f"CellFailed: {failed['evalue']}"]] and failed["evalue"].endswith("failed on rank 1: ValueError: x")
        assert any("ValueError on rank 1" in o.get("data", {}).get("text/plain", "") + o.get("text", "") for o in shown), shown
        assert queued["status"] == "aborted" and not queued_shown, (queued, queued_shown)
        # A background cell is live at once; once it ends, its follower hands the widgets back too.
        assert "running in the background" in kernel.run("%%on_ranks --bg\nimport time\ntime.sleep(1.0)")
        assert "ok" in kernel.run("%dist_wait")
        kernel.run("import time\n" + INSTANCES + "t = time.monotonic()\n"
                   f"while len(_instances) != {before['widgets']} and time.monotonic() - t < 5:\n    time.sleep(0.05)")
        assert json.loads(kernel.run("print(len(_instances))")) == before["widgets"]
        # What a failed cell leaves once (IPython keeps its traceback, and so its frames: ~250
        # objects on 3.12) is not growth per cell: the count starts here.
        before = json.loads(kernel.run(PROBE))
        cells = 300
        for i in range(cells):
            kernel.run(f"%%on_ranks\nx = {i}\nprint(x) if x % 50 == 0 else None")
        after = json.loads(kernel.run(PROBE))
        assert after["widgets"] == before["widgets"], (before, after)
        for i in range(cells):  # the kernel's own floor: the same cells, run in the notebook
            kernel.run(f"x = {i}\nprint(x) if x % 50 == 0 else None")
        floor = json.loads(kernel.run(PROBE))
        # Beyond the kernel's own history (a tuple and a list per cell), distnb keeps one CellRecord
        # per cell (for %dist_restart --replay and %dist_export), and nothing else.
        extra = (after["objects"] - before["objects"]) - (floor["objects"] - after["objects"])
        assert extra <= cells + 30, (before, after, floor)
        kernel.run("%dist_shutdown")
    finally:
        assert not kernel.close()
