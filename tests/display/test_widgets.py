"""Widget state without a browser: the live cell view fed from a background thread, its caps and
batching, its text twin, rank displays; the plain-text printer's bounds; and the fall back to text
in a real kernel where ipywidgets cannot be imported."""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as w
import nbformat
import pytest

from distnb.display import text as text_module
from distnb.display.text import LINE_KEEP, LivePrinter
from distnb.display.widgets import (
    DIFF_START,
    GROUPED_MAX_LINES,
    LIVE_RANK_CHARS,
    CellView,
    widgets_available,
)
from distnb.results import CellResult, RankResult

from conftest import run_notebook

pytestmark = pytest.mark.timeout(120)


def stream_of(output: w.Output, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in output.outputs if o.get("name") == name)


def count_changes(widget: w.Output) -> list[int]:
    """A one-element counter of assignments to ``outputs`` (each one is a full re-send)."""
    changes = [0]

    def seen(_change: Any) -> None:
        changes[0] += 1

    widget.observe(seen, names="outputs")
    return changes


def settle(view: CellView) -> None:
    """Tick once the printer's grouping window (0.15 s) has passed, as the magic's 0.1 s ticks would."""
    time.sleep(0.2)
    view.tick()


def make_result(ranks: list[int], stdout: dict[int, str], error_rank: int | None = None) -> CellResult:
    results = {}
    for r in ranks:
        rr = RankResult(r, status="ok", stdout=stdout.get(r, ""), value={"text/plain": str(r)}, duration=0.1, finished_at=1.0)
        if r == error_rank:
            rr.status, rr.value = "error", None
            rr.error = {"ename": "ValueError", "evalue": "bad batch", "traceback": "Traceback...\nValueError: bad batch\n", "line": 2}
        results[r] = rr
    return CellResult(cell=7, code="print('hello')", ranks=ranks, results=results, elapsed=0.5)


# -- the live view ---------------------------------------------------------------------------------
def test_feed_only_buffers_and_a_tick_assigns_each_output_once() -> None:
    view = CellView(7, [0, 1, 2, 3])
    assert isinstance(view.selector, w.Tab) and len(view.selector.children) == 4
    assert [view.selector.get_title(i) for i in range(4)] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    changes = {r: count_changes(view.rank_outputs[r]) for r in range(4)}
    grouped_changes = count_changes(view.grouped)

    def io_thread() -> None:
        for r in range(4):
            view.feed(r, "stdout", "hel")
            view.feed(r, "stdout", "lo\n")
        for i in range(50):
            view.feed(2, "stdout", f"only two {i}\n")
        view.feed(1, "stderr", "warn\n")

    t = threading.Thread(target=io_thread)
    t.start()
    t.join(10)
    # The I/O thread only buffered: no widget state changed, nothing was sent.
    assert all(c == [0] for c in changes.values()) and grouped_changes == [0]
    assert all(o.outputs == () for o in view.rank_outputs.values())
    settle(view)
    # One assignment per widget for all 52 chunks of rank 2, text merged into one entry per stream.
    assert [changes[r][0] for r in range(4)] == [1, 1, 1, 1] and grouped_changes == [1]
    assert stream_of(view.rank_outputs[2]) == "hello\n" + "".join(f"only two {i}\n" for i in range(50))
    assert len(view.rank_outputs[2].outputs) == 1
    assert [o["text"] for o in view.rank_outputs[1].outputs if o.get("name") == "stderr"] == ["warn\n"]
    grouped = stream_of(view.grouped)
    assert grouped.count("[ranks 0-3] hello") == 1 and "[rank 2] only two 49" in grouped
    view.tick()  # nothing new: nothing re-sent
    assert [changes[r][0] for r in range(4)] == [1, 1, 1, 1] and grouped_changes == [1]


def test_100k_lines_stay_capped_batched_and_noted() -> None:
    ranks = [0, 1]
    view = CellView(3, ranks)
    changes = {r: count_changes(view.rank_outputs[r]) for r in ranks}
    grouped_changes = count_changes(view.grouped)
    n = 100_000
    done = threading.Event()

    def io_thread() -> None:
        for i in range(n):
            view.feed(0, "stdout", f"step {i} loss 0.{i:05d}\n")
            view.feed(1, "stdout", f"step {i} loss 0.{i:05d}\n" if i % 10 else f"rank one says {i}\n")
        done.set()

    t = threading.Thread(target=io_thread)
    t.start()
    ticks = 0
    while not done.is_set() and ticks < 10_000:
        view.tick()  # the waiting thread, as the magic drives it
        ticks += 1
        time.sleep(0.01)
    t.join(60)
    assert done.is_set()
    view.finish(make_result(ranks, {}))
    ticks += 1
    for r in ranks:
        outs = view.rank_outputs[r].outputs
        body = "".join(o.get("text", "") for o in outs if o.get("output_type") == "stream")
        assert len(body) <= LIVE_RANK_CHARS and len(outs) <= 3  # one stream entry and the note
        assert changes[r][0] <= ticks
        note = outs[-1]["data"]["text/plain"]
        assert "more characters" in note and f"_dist[{r}].stdout" in note and "not shown" in note
    grouped_lines = stream_of(view.grouped).count("\n")
    assert grouped_lines <= GROUPED_MAX_LINES + 5 and len(view.grouped.outputs) <= 4 and grouped_changes[0] <= ticks
    note = view.grouped.outputs[-1]["data"]["text/plain"]
    assert "more output lines were not shown" in note and "_dist" in note
    # The text twin carries the cap note and stays bounded like the view.
    twin = view.text()
    assert "more output lines were not shown" in twin and len(twin) < 2 * (1 << 20)
    # After finishing, late output is dropped instead of piling up.
    for _ in range(1000):
        view.feed(0, "stdout", "late\n" * 100)
    assert all(not b.pending for b in view._rank_bufs.values()) and view.printer._raw == []


def test_a_progress_bar_in_a_tab_keeps_its_latest_state() -> None:
    view = CellView(8, [0])
    for step in range(20_000):  # 1.4 MB of "\r" updates: far past the tab's cap if kept
        view.feed(0, "stderr", f"\rtraining {step:6d}/20000 [{'#' * (step // 1000):20s}] loss={1 / (step + 1):.6f}")
        if step % 2000 == 1999:
            settle(view)
    view.feed(0, "stderr", "\ndone\n")
    view.finish(make_result([0], {}))
    tab = stream_of(view.rank_outputs[0], "stderr")
    assert tab == f"training  19999/20000 [{'#' * 19:20s}] loss=0.000050\ndone\n"
    assert not view._rank_bufs[0].full and len(view.rank_outputs[0].outputs) == 1  # no cap note
    assert "[rank 0 stderr] training  19999/20000" in stream_of(view.grouped, "stderr")


def test_diff_lines_are_marked_in_the_grouped_view_only() -> None:
    view = CellView(2, [0, 1, 2])
    for r in range(3):
        view.feed(r, "stdout", "same everywhere\n")
        view.feed(r, "stdout", f"parity {r % 2}\n")
    settle(view)
    grouped = stream_of(view.grouped)
    assert "[ranks 0-2] same everywhere\n" in grouped and DIFF_START + "[ranks 0-2]" not in grouped
    assert DIFF_START + "[ranks 0,2] parity 0" in grouped and DIFF_START + "[rank 1] parity 1" in grouped
    # The plain twin keeps the labels, without colour codes.
    assert "[rank 1] parity 1" in view.printer.plain and not any("\x1b" in line for line in view.printer.plain)
    # A dead rank's silence is no difference: the survivors' shared lines are not marked.
    view.rank_done(RankResult(2, status="dead", returncode=-9))
    for r in (0, 1):
        view.feed(r, "stdout", "after the death\n")
    settle(view)
    assert "\n[ranks 0,1] after the death\n" in stream_of(view.grouped)


def test_dropdown_beyond_eight_ranks() -> None:
    view = CellView(1, list(range(9)))
    assert isinstance(view.selector, w.Dropdown) and view.selector.value == 0
    view.feed(5, "stdout", "five\n")
    view.tick()
    view.selector.value = 5
    shown = view.widget.children[3].children[0].children[1]
    assert shown.children[0] is view.rank_outputs[5] and stream_of(view.rank_outputs[5]) == "five\n"


def test_header_diagnosis_outcome_and_text_twin() -> None:
    view = CellView(7, [0, 1])
    assert "0/2 ranks done" in view.header.value and "running" in view.header.value
    assert view.text().startswith("cell 7 on ranks 0,1: running, 0/2 done")
    view.rank_done(RankResult(0, status="ok"))
    view.update_header()
    assert "1/2 ranks done" in view.header.value
    for r in (0, 1):
        view.feed(r, "stdout", "hello\n")
    view.set_diagnosis("[distnb] rank 1 raised ValueError\n  rank 0: waiting in all_reduce")
    assert view.diagnosis.layout.display is None and "rank 1 raised ValueError" in view.diagnosis.value
    result = make_result([0, 1], {0: "hello\n", 1: "hello\n"}, error_rank=1)
    view.finish(result)
    assert "failed" in view.header.value and "2/2 ranks done" in view.header.value
    assert "ValueError on rank 1 at cell line 2" in view.outcome.value
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    twin = bundle["text/plain"]
    assert twin.startswith("[distnb] rank 1 raised ValueError\n  rank 0: waiting in all_reduce\n" + result.header())
    assert "[ranks 0,1] hello" in twin and result.outcome_text() in twin


def test_twin_groups_over_the_whole_cell_and_stays_within_the_caps() -> None:
    view = CellView(9, [0, 1])
    view.feed(0, "stdout", "hello\n")
    settle(view)  # rank 1 prints the same line only after the live grouping window
    view.feed(1, "stdout", "hello\n")
    settle(view)
    assert "[rank 0] hello" in stream_of(view.grouped) and "[rank 1] hello" in stream_of(view.grouped)
    view.finish(make_result([0, 1], {0: "hello\n", 1: "hello\n"}))
    assert "[ranks 0,1] hello" in view.text()  # the result's grouping: nothing was left out
    # A huge line per rank is clipped in the view; the twin then shows what the view showed.
    big = CellView(10, [0, 1])
    huge = {r: f"{r}" * (600 << 10) + "\n" for r in (0, 1)}
    for r in (0, 1):
        big.feed(r, "stdout", huge[r])
    big.finish(make_result([0, 1], huge))
    twin = big.text()
    assert "characters not shown" in twin and len(twin) < 64 << 10
    tab = stream_of(big.rank_outputs[1])  # the tab shows the line's start, up to its cap, and says so
    assert tab == "1" * LIVE_RANK_CHARS and "more characters" in big.rank_outputs[1].outputs[-1]["data"]["text/plain"]


def test_quiet_cell_keeps_output_out_of_the_twin() -> None:
    # --quiet wires no on_output: the view, its twin included, shows only the outcome.
    view = CellView(4, [0, 1])
    result = make_result([0, 1], {0: "secret noise\n", 1: "secret noise\n"})
    view.finish(result)
    twin = view.text()
    assert "secret noise" not in twin and "Out[rank 0]: 0" in twin and twin.startswith(result.header())
    assert stream_of(view.grouped) == ""


def test_twin_is_refreshed_at_a_diagnosis_and_at_finish() -> None:
    view = CellView(5, [0, 1])

    class Handle:
        def __init__(self) -> None:
            self.texts: list[str] = []

        def update(self, obj: Any) -> None:
            self.texts.append(obj._repr_mimebundle_()["text/plain"])

    view._handle = handle = Handle()
    view.set_diagnosis("[distnb] rank-conditional collective: rank 0 entered all_reduce")
    view.set_diagnosis("[distnb] rank-conditional collective: rank 0 entered all_reduce (still)")  # within 1 s: not re-sent
    assert len(handle.texts) == 1 and "rank-conditional collective" in handle.texts[0] and ": running" in handle.texts[0]
    result = make_result([0, 1], {})
    result.timed_out = True
    result.results[1].status = "running"
    view.finish(result)
    assert len(handle.texts) == 2 and "timed out" in handle.texts[1] and "(still)" in handle.texts[1]


def test_death_is_announced_in_the_grouped_view() -> None:
    view = CellView(3, [0, 1])
    view.rank_done(RankResult(1, status="dead", returncode=-9, stderr_tail="oom\n", first_death=True))
    view.tick()
    err = stream_of(view.grouped, "stderr")
    assert "rank 1 died first: killed (SIGKILL" in err


def test_rank_displays_render_in_the_view_once() -> None:
    view = CellView(6, [0, 1])
    table = {"text/plain": "<table 3x2>", "text/html": "<table><tr><td>3</td></tr></table>"}
    view.display_bundle(0, dict(table))
    view.display_bundle(1, {**table, "application/vnd.jupyter.widget-view+json": "{}"})  # a rank's widget: not ours
    settle(view)
    for r in (0, 1):
        shown = [o for o in view.rank_outputs[r].outputs if o["output_type"] == "display_data"]
        assert [o["data"] for o in shown] == [table]
    grouped = view.grouped.outputs
    assert [o["data"] for o in grouped if o["output_type"] == "display_data"] == [table]  # identical: once
    assert "[display ranks 0,1]" in stream_of(view.grouped)
    result = make_result([0, 1], {})
    for r in (0, 1):
        result.results[r].displays.append(dict(table))
    view.finish(result)
    # Shown live, so not repeated in the outcome; the twin has it once.
    assert "display" not in view.outcome.value
    assert view.text().count("[display ranks 0,1] <table 3x2>") == 1
    assert "[display ranks 0,1] <table 3x2>" in result.outcome_text()  # the block that was removed


@pytest.mark.parametrize("n", [1, 8])
def test_small_pools_use_tabs(n: int) -> None:
    assert isinstance(CellView(0, list(range(n))).selector, w.Tab)


# -- the plain-text printer ------------------------------------------------------------------------
def test_a_100mb_line_stays_bounded_and_linear() -> None:
    out = io.StringIO()
    printer = LivePrinter(out=out, hold=0.0)
    chunk = "x" * (64 << 10)
    start = time.monotonic()
    for i in range(1600):  # 100 MB in pipe-sized chunks, no newline, flushed as the magic would
        printer.feed(0, "stdout", chunk)
        if i % 16 == 0:
            printer.flush()
            buf = printer._partial[(0, "stdout")]
            kept = sum(map(len, buf.head)) + sum(map(len, buf.tail))
            assert kept <= 2 * LINE_KEEP + len(chunk)
    printer.feed(0, "stdout", "END\n")
    printer.flush(final=True)
    elapsed = time.monotonic() - start
    line = out.getvalue()
    assert line.startswith("[rank 0] xxx") and line.endswith("xxxEND\n")
    assert "characters not shown" in line and len(line) < 2 * LINE_KEEP + 100
    assert f"{1600 * len(chunk) + 3 - 2 * LINE_KEEP:,} characters" in line
    # Linear by construction: what the printer holds stayed bounded at every flush (asserted in the
    # loop); a quadratic += took minutes. The time is reported, not asserted (it is this machine's).
    print(f"100 MB through one line: {elapsed:.1f} s")


def test_a_trickle_of_tiny_chunks_does_not_pile_up() -> None:
    printer = LivePrinter(out=io.StringIO(), hold=0.0)
    for i in range(200_000):
        printer.feed(1, "stderr", "y")
        if i % 5000 == 0:
            printer.flush()
    printer.flush()
    buf = printer._partial[(1, "stderr")]
    assert len(buf.tail) <= 2 * LINE_KEEP // text_module._MERGE_BELOW + 2 and buf.total == 200_000


def test_carriage_returns_keep_the_last_progress_state() -> None:
    err = io.StringIO()
    printer = LivePrinter(err=err, hold=0.0)
    for pct in range(0, 101, 10):  # a progress bar: each state overwrites the last, no newline
        printer.feed(0, "stderr", f"\r{pct:3d}%|{'#' * (pct // 10):10s}|")
        printer.flush()
        assert err.getvalue() == ""
        assert printer._partial[(0, "stderr")].total == 16  # only the latest state ("100%|##########|") is kept
    printer.feed(0, "stderr", "\n")
    printer.flush(final=True)
    assert err.getvalue() == "[rank 0 stderr] 100%|##########|\n"
    err2 = io.StringIO()
    printer2 = LivePrinter(err=err2, hold=0.0)
    printer2.feed(0, "stderr", "\r 10%|#\r 20%|##\r\n")
    printer2.flush(final=True)
    assert err2.getvalue() == "[rank 0 stderr]  20%|##\n"


def test_printer_bounds_output_nobody_flushes_and_after_it_closed() -> None:
    printer = LivePrinter(out=io.StringIO(), max_lines=100, max_chars=1 << 20)
    block = "z" * 99 + "\n"
    for _ in range(50_000):  # 5 MB while the waiting thread is gone: the backlog stops at the cap
        printer.feed(0, "stdout", block)
    assert printer._raw_chars <= 1 << 20 and printer.capped >= 50_000 - (1 << 20) // 100
    printer.flush(final=True)
    assert printer.lines_printed == 100 and printer.capped == 50_000 - 100
    assert "49,900 more output lines were not shown" in printer.cap_note() and "_dist" in printer.cap_note()
    printer.feed(0, "stdout", block * 1000)
    printer.display_bundle(0, {"text/plain": "late"})
    assert printer._raw == [] and printer._displays == []


def test_text_path_prints_rank_displays_and_does_not_repeat_them() -> None:
    out = io.StringIO()
    printer = LivePrinter(out=out, hold=0.0)
    printer.display_bundle(1, {"text/plain": "Figure(640x480)", "image/png": "iVBOR"})
    printer.flush()
    assert out.getvalue() == "[display rank 1] Figure(640x480)\n"
    result = make_result([0, 1], {})
    result.results[1].displays.append({"text/plain": "Figure(640x480)", "image/png": "iVBOR"})
    assert "Figure(640x480)" in result.outcome_text() and "Figure(640x480)" not in printer.outcome_text(result)


# -- falling back to text --------------------------------------------------------------------------
def test_widgets_available_needs_a_kernel_and_an_importable_ipywidgets(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython

    assert widgets_available() is False  # no kernel under pytest
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("KernelShell", (), {"kernel": object()})())
    assert widgets_available() is True
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # what a failed import leaves
    assert widgets_available() is False


BLOCK_IPYWIDGETS = '''\
import sys
class _NoIpywidgets:
    """ipywidgets is "not installed": its import fails, and so does asking for its spec."""
    def find_spec(self, name, path=None, target=None):
        if name == "ipywidgets" or name.startswith("ipywidgets."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _NoIpywidgets())
for _name in [m for m in sys.modules if m == "ipywidgets" or m.startswith("ipywidgets.")]:
    del sys.modules[_name]
from distnb.display.widgets import widgets_available
print("in a kernel:", get_ipython().kernel is not None, "| widgets:", widgets_available())'''


@pytest.mark.slow  # a real kernel
@pytest.mark.timeout(240)
def test_a_kernel_without_ipywidgets_uses_the_text_path(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        BLOCK_IPYWIDGETS,
        "%load_ext distnb",
        "%dist_launch -n 1 --backend gloo",
        "%%on_ranks\nprint('hello from the text path')",
        "%dist_shutdown",
    )]
    ran = run_notebook(nb, str(tmp_path), "DISTNB_NO_WIDGETS_TEST", timeout=180)
    first = "".join(o.get("text", "") for o in ran.cells[0].outputs)
    assert "in a kernel: True | widgets: False" in first
    cell = ran.cells[3]
    mimes = {k for o in cell.outputs for k in o.get("data", {})}
    streamed = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    assert "application/vnd.jupyter.widget-view+json" not in mimes
    assert "[rank 0] hello from the text path" in streamed
