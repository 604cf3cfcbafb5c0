"""Widget state without a browser: the live cell view fed from a background thread."""

from __future__ import annotations

import threading

import ipywidgets as w
import pytest

from distnb.display.widgets import CellView, widgets_available
from distnb.results import CellResult, RankResult


def stdout_of(output: w.Output) -> str:
    return "".join(o.get("text", "") for o in output.outputs if o.get("name") == "stdout")


def make_result(ranks: list[int], stdout: dict[int, str], error_rank: int | None = None) -> CellResult:
    results = {}
    for r in ranks:
        rr = RankResult(r, status="ok", stdout=stdout.get(r, ""), value={"text/plain": str(r)}, duration=0.1, finished_at=1.0)
        if r == error_rank:
            rr.status, rr.value = "error", None
            rr.error = {"ename": "ValueError", "evalue": "bad batch", "traceback": "Traceback...\nValueError: bad batch\n", "line": 2}
        results[r] = rr
    return CellResult(cell=7, code="print('hello')", ranks=ranks, results=results, elapsed=0.5)


def test_widgets_unavailable_outside_a_kernel() -> None:
    assert widgets_available() is False


def test_tabs_per_rank_fed_from_a_background_thread() -> None:
    view = CellView(7, [0, 1, 2, 3])
    assert isinstance(view.selector, w.Tab) and len(view.selector.children) == 4
    assert [view.selector.get_title(i) for i in range(4)] == ["rank 0", "rank 1", "rank 2", "rank 3"]

    def io_thread() -> None:
        for r in range(4):
            view.feed(r, "stdout", "hello\n")
        view.feed(2, "stdout", "only two\n")
        view.feed(1, "stderr", "warn\n")

    t = threading.Thread(target=io_thread)
    t.start()
    t.join()
    assert stdout_of(view.rank_outputs[2]) == "hello\nonly two\n"
    assert [o["text"] for o in view.rank_outputs[1].outputs if o.get("name") == "stderr"] == ["warn\n"]
    view.printer.flush(final=True)
    grouped = stdout_of(view.grouped)
    assert grouped.count("[ranks 0-3] hello") == 1 and "[rank 2] only two" in grouped


def test_dropdown_beyond_eight_ranks() -> None:
    view = CellView(1, list(range(9)))
    assert isinstance(view.selector, w.Dropdown) and view.selector.value == 0
    view.feed(5, "stdout", "five\n")
    view.selector.value = 5
    shown = view.widget.children[3].children[0].children[1]
    assert shown.children[0] is view.rank_outputs[5]


def test_header_diagnosis_outcome_and_text_twin() -> None:
    view = CellView(7, [0, 1])
    assert "0/2 ranks done" in view.header.value and "running" in view.header.value
    view.rank_done(RankResult(0, status="ok"))
    view.update_header()
    assert "1/2 ranks done" in view.header.value
    view.set_diagnosis("[distnb] rank 1 raised ValueError\n  rank 0: waiting in all_reduce")
    assert view.diagnosis.layout.display is None and "rank 1 raised ValueError" in view.diagnosis.value
    result = make_result([0, 1], {0: "hello\n", 1: "hello\n"}, error_rank=1)
    view.finish(result)
    assert "failed" in view.header.value and "2/2 ranks done" in view.header.value
    assert "ValueError on rank 1 at cell line 2" in view.outcome.value
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"].startswith("[distnb] rank 1 raised ValueError")
    assert result.text() in bundle["text/plain"]


def test_death_is_announced_in_the_grouped_view() -> None:
    view = CellView(3, [0, 1])
    view.rank_done(RankResult(1, status="dead", returncode=-9, stderr_tail="oom\n", first_death=True))
    view.tick()
    err = "".join(o.get("text", "") for o in view.grouped.outputs if o.get("name") == "stderr")
    assert "rank 1 died first: killed (SIGKILL" in err


@pytest.mark.parametrize("n", [1, 8])
def test_small_pools_use_tabs(n: int) -> None:
    assert isinstance(CellView(0, list(range(n))).selector, w.Tab)
