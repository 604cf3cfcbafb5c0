"""The cell display's lifecycle without a browser: a quick cell makes no widget at all, a slow one
goes live with everything it printed so far, every finished cell closes its widgets and leaves one
static output (HTML and text) built from the result."""

from __future__ import annotations

import threading
import time
from typing import Any

import ipywidgets as w
import pytest
from ipywidgets.widgets import widget as _widget_module

from distnb.display.cell_display import CellDisplay, close_tree
from distnb.display.static import SAVED_GROUPED_CHARS, SAVED_RANK_CHARS, StaticCell
from distnb.display.widgets import CellView
from distnb.results import CellResult, RankResult

pytestmark = pytest.mark.timeout(60)

# Every live widget, by id: a module's dict from ipywidgets 8.0.5, the class's before.
_instances: dict[str, Any] = _widget_module._instances if hasattr(_widget_module, "_instances") else w.Widget._active_widgets


def stream_of_widget(output: w.Output, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in output.outputs if o.get("name") == name)


def result_of(stdout: dict[int, str], *, failing: int | None = None, displays: dict[int, list[dict[str, str]]] | None = None) -> CellResult:
    results = {}
    for r, out in stdout.items():
        rr = RankResult(r, status="ok", stdout=out, value={"text/plain": f"'v{r}'"}, duration=0.25, finished_at=1.0,
                        displays=list((displays or {}).get(r, [])))
        if r == failing:
            rr.status, rr.value = "error", None
            rr.error = {"ename": "ValueError", "evalue": "bad batch", "traceback": "Traceback...\nValueError: bad batch\n", "line": 2}
        results[r] = rr
    return CellResult(cell=7, code="print(rank)", ranks=sorted(stdout), results=results, elapsed=0.3)


class Shown:
    """Stands in for IPython's display(): records what a cell display shows and updates."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.items: list[Any] = []
        import IPython.display

        monkeypatch.setattr(IPython.display, "display", self.display)
        monkeypatch.setattr(IPython.display, "publish_display_data", self.publish)

    def publish(self, data: dict[str, str]) -> None:
        self.items.append(data)

    def display(self, obj: Any, display_id: bool = False) -> Any:
        self.items.append(obj)
        shown = self

        class Handle:
            def update(self, new: Any) -> None:
                shown.items[shown.items.index(obj)] = new

        return Handle() if display_id else None


def test_a_quick_cell_makes_no_widget_and_shows_one_static_output(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = Shown(monkeypatch)
    before = len(_instances)
    view = CellDisplay([0, 1])
    view.cell = 7
    view.feed(0, "stdout", "same\n")
    view.feed(1, "stdout", "same\n")
    view.tick()
    assert not view.live and len(_instances) == before
    static = view.finish(result_of({0: "same\n", 1: "same\n"}))
    bundle = static._repr_mimebundle_()
    assert shown.items == [bundle] and len(_instances) == before
    assert "[ranks 0,1] same" in bundle["text/plain"] and "cell 7 on ranks 0,1: ok" in bundle["text/plain"]
    assert "<details><summary>rank 1 · ok · 0.25 s</summary>" in bundle["text/html"]
    assert "Out[ranks 0,1]" not in bundle["text/plain"] and "Out[rank 0]: 'v0'" in bundle["text/plain"]
    view.feed(0, "stdout", "late\n")  # after the end: the result keeps it, the view drops it
    assert not view.live


def test_a_slow_cell_goes_live_with_what_it_printed_then_hands_its_widgets_back(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = Shown(monkeypatch)
    before = len(_instances)
    view = CellDisplay([0, 1], live_after=0.05)
    view.cell = 3
    view.feed(0, "stdout", "first\n")
    view.feed(1, "stderr", "warn\n")
    time.sleep(0.06)
    view.tick()
    assert view.live and len(_instances) > before + 10
    live = shown.items[0]
    assert isinstance(live, CellView)
    view.feed(0, "stdout", "second\n")
    time.sleep(0.2)
    view.tick()
    assert stream_of_widget(live.rank_outputs[0]) == "first\nsecond\n"  # replayed, then live, in order
    assert stream_of_widget(live.rank_outputs[1], "stderr") == "warn\n"
    view.set_diagnosis("[distnb] hang: rank 1 never arrived\n  rank 0: waiting")
    static = view.finish(result_of({0: "first\nsecond\n", 1: ""}))
    assert shown.items == [static]  # the live view's place now holds the static one
    assert len(_instances) == before, "the finished cell kept widgets alive"
    assert static.text().startswith("[distnb] hang: rank 1 never arrived") and "hang: rank 1 never arrived" in static.html()


def test_what_healthy_ranks_are_doing_is_shown_live_and_never_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = Shown(monkeypatch)
    view = CellDisplay([0, 1], live_after=60)
    view.cell = 4
    view.set_diagnosis("ranks 0,1 still running Python code (no rank is in a collective).", keep=False)
    live = shown.items[0]
    assert isinstance(live, CellView) and "still running Python code" in live.text()
    static = view.finish(result_of({0: "", 1: ""}))
    assert "still running" not in static.text() and "still running" not in static.html()
    # A problem seen meanwhile stays, whatever healthy activity was shown after it.
    again = CellDisplay([0, 1], live_after=60)
    again.cell = 5
    again.set_diagnosis("[distnb] hang: rank 1 never arrived")
    again.set_diagnosis("ranks 0,1 wait in all_reduce: slow, not a hang yet", keep=False)
    assert again.finish(result_of({0: "", 1: ""})).text().startswith("[distnb] hang: rank 1 never arrived")


def test_going_live_loses_no_output_fed_from_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    Shown(monkeypatch)
    view = CellDisplay([0], live_after=60)
    sent = [f"{i}\n" for i in range(3000)]  # within a tab's 5,000 lines

    def feeder() -> None:
        for i, line in enumerate(sent):
            view.feed(0, "stdout", line)
            if i % 100 == 0:
                time.sleep(0.001)

    thread = threading.Thread(target=feeder)
    thread.start()
    time.sleep(0.005)
    view.go_live()  # while the feeder is mid-way
    thread.join()
    live = view._view
    time.sleep(0.2)
    live.tick()
    assert stream_of_widget(live.rank_outputs[0]) == "".join(sent)
    view.finish(result_of({0: "".join(sent)}))


def test_close_tree_closes_children_layouts_and_styles() -> None:
    before = len(_instances)
    box = w.VBox([w.HTML("a"), w.Tab(children=[w.Output()]), w.Dropdown(options=["x"])])
    assert len(_instances) > before + 4
    closed = close_tree(box)
    assert closed >= 5 and len(_instances) == before


def test_static_view_caps_what_the_notebook_keeps_and_says_where_the_rest_is() -> None:
    big = "x" * 99 + "\n"
    result = result_of({0: big * (SAVED_RANK_CHARS // 50), 1: "other\n" * (SAVED_GROUPED_CHARS // 3)}, failing=1)
    static = StaticCell(result)
    page, text = static.html(), static.text()
    assert len(page) < SAVED_GROUPED_CHARS * 2 + SAVED_RANK_CHARS * 2 + 20_000
    assert "more characters of grouped output not shown here" in text and "_dist[rank].stdout" in text
    assert "more characters not shown here: _dist[0].stdout" in page
    assert "ValueError on rank 1 at cell line 2" in text and "color:#cf222e" in page  # failed: the outcome in red
    quiet = StaticCell(result, output=False)
    assert "other" not in quiet.text() and "<details>" not in quiet.html() and "ValueError" in quiet.text()


def test_static_view_embeds_displays_grouped_and_escapes_output() -> None:
    png = {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}
    result = result_of({0: "<script>alert(1)</script>\x1b[31mred\x1b[0m\n", 1: ""}, displays={0: [png], 1: [png]})
    page = StaticCell(result).html()
    assert page.count("data:image/png;base64,iVBORw0KGgo=") == 1 and "display ranks 0,1" in page
    assert "<script>" not in page and "&lt;script&gt;" in page and "\x1b" not in page
    assert "display ranks 0,1" not in StaticCell(result)._outcome()  # shown as the image, not repeated as text
