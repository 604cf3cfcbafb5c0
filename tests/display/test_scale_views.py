"""Views at 1,024 ranks lead with the majority and name the outliers (issue 27, item 2): output
lines that differ only in numbers merged into one with their range, a nan/far/failed/slow rank
named, every rank still accounted for, the saved cell bounded whatever the world size, the live
widget view a few widgets, %dist_memory a distribution. Up to SUMMARY_ABOVE ranks the views are
today's. Nothing here is timed: benchmarks/bench_scale.py times these views."""

from __future__ import annotations

import io
import random
import re
import statistics

import pytest

from distnb._text import MERGED_NOTE, merge_lines
from distnb.analysis.reports.memory import MemoryReport, _median_without, imbalances, memory_line
from distnb.display.static import MAX_RANK_SECTIONS, SCALED_DISPLAYS, SCALED_SAVED_BYTES, StaticCell
from distnb.display.text import LivePrinter
from distnb.ranks import SUMMARY_ABOVE, group_by, parse_ranks
from distnb.results import CellResult, RankResult

from synthetic import SyntheticPool

pytestmark = pytest.mark.timeout(120)

N = 1024
MB = 1 << 20


def loss_line(r: int) -> str:
    return f"step 1 loss {2.31 + (r % 97) / 2000:.4f} on node{r // 8}\n"


def ranks_in(label: str) -> list[int]:
    """The ranks a ``[ranks 0-16,18-1023]`` (or ``rank 17``) label names."""
    spec = label.removeprefix("ranks ").removeprefix("rank ")
    return parse_ranks(spec, 1 << 20)


def error(message: str) -> dict[str, object]:
    return {"ename": "ValueError", "evalue": message, "traceback": f"Traceback (most recent call last):\n  File \"<cell-1>\", line 3\nValueError: {message}\n",
            "line": 3}


# -- output lines ---------------------------------------------------------------------------------
def test_lines_that_differ_in_numbers_are_one_line_with_their_range_and_the_odd_ranks_named() -> None:
    outputs = [(r, loss_line(r)) for r in range(N)]
    outputs[17] = (17, "step 1 loss nan on node2\n")
    outputs[40] = (40, "step 1 loss 97.5000 on node5\n")  # far outside the others' spread
    rows = merge_lines(outputs)
    assert rows == [(list(range(N)), "step 1 loss ⟨2.3100 … 2.3580⟩ on node⟨0 … 127⟩, except rank 17: loss nan; rank 40: loss 97.5000")]
    assert rows.merged and set(rows.odd) == {17, 40}
    # A number that is each rank's own reads as such; one all ranks share stays as printed.
    rows = merge_lines([(r, f"rank {r} of 1024 says hi\n") for r in range(N)])
    assert rows == [(list(range(N)), "rank ⟨rank⟩ of 1024 says hi")]


def test_few_distinct_lines_stay_as_printed_and_many_of_their_own_are_counted_not_dropped() -> None:
    rows = merge_lines([(r, f"leader {int(r == 0)}\nloss {'nan' if r == 5 else '2.31'}\n") for r in range(N)])
    assert rows == [(list(range(1, N)), "leader 0"), ([0], "leader 1"), ([r for r in range(N) if r != 5], "loss 2.31"), ([5], "loss nan")]
    assert rows.odd == [0, 5]
    # Rank 0 prints one more line: outputs grouped by their template, the majority first.
    rows = merge_lines([(r, f"rank {r} ready\n" + ("config lr=0.1\n" if r == 0 else "")) for r in range(N)])
    assert rows == [(list(range(1, N)), "rank ⟨rank⟩ ready"), ([0], "rank 0 ready"), ([0], "config lr=0.1")]
    # Every rank a line of its own making: a bounded view whose last row names every rank left out.
    rows = merge_lines([(r, f"host gpu-{chr(97 + r // 676)}{chr(97 + r // 26 % 26)}{chr(97 + r % 26)}\n") for r in range(N)])
    assert len(rows) <= 20 and "other lines" in rows[-1][1] and "_dist[rank].stdout" in rows[-1][1]
    assert sorted(r for ranks, _ in rows for r in ranks) == list(range(N))
    assert rows.odd == []  # no line has a majority: nobody is odd


@pytest.mark.parametrize("world", [1, 2, 4, SUMMARY_ABOVE])
def test_up_to_sixteen_ranks_every_distinct_line_is_listed_as_before(world: int) -> None:
    outputs = [(r, f"step 1 loss {2.31 + r / 100:.4f} on node{r // 2}\nsame\n") for r in range(world)]
    split = [(r, text.splitlines()) for r, text in outputs]
    before = [row for i in range(2) for row in group_by((r, ls[i]) for r, ls in split)]  # the rule until now
    rows = merge_lines(outputs)
    assert rows == before and not rows.merged


def test_the_live_printer_merges_many_ranks_and_says_once_how_to_read_it() -> None:
    out, err = io.StringIO(), io.StringIO()
    printer = LivePrinter(out=out, err=err, hold=0.0, ranks=range(N))
    for step in (1, 2):
        for r in range(N):
            printer.feed(r, "stdout", loss_line(r).replace("step 1", f"step {step}") if r != 17 else f"step {step} loss nan on node2\n")
        printer.flush()
    printer.flush(final=True)
    lines = out.getvalue().splitlines()
    assert lines == [f"[ranks 0-1023] step {s} loss ⟨2.3100 … 2.3580⟩ on node⟨0 … 127⟩, except rank 17: loss nan" for s in (1, 2)]
    assert err.getvalue().count("⟨lo … hi⟩") == 1 and list(printer.odd) == [17]


# -- the finished cell ----------------------------------------------------------------------------
def scale_cell(world: int = N) -> CellResult:
    """A 1,024-rank cell through the real tracker: rank 17's loss is nan, rank 99 is slow, rank 500
    raises, every other rank prints its loss and node."""
    pool = SyntheticPool(world)
    result = pool.cell("print(f'step 1 loss {loss:.4f} on {host}')")
    for r in range(world):
        pool.output(r, "step 1 loss nan on node2\n" if r == 17 else loss_line(r))
        if r == 500:
            pool.done(r, result, status="error", error=error("bad batch 500"), duration=0.2)
        else:
            pool.done(r, result, duration=5.0 if r == 99 else 0.1 + (r % 7) / 1000)
    return result


def test_a_1024_rank_cell_reads_as_the_majority_and_names_the_nan_failed_and_slow_ranks() -> None:
    result = scale_cell()
    view = StaticCell(result)
    text, page = view.text(), view.html()
    lines = text.splitlines()
    assert lines[0] == "cell 1 on ranks 0-1023: failed, 1024/1024 done, 100.01 s" or lines[0].startswith("cell 1 on ranks 0-1023: failed, 1024/1024 done")
    assert lines[1] == "[ranks 0-1023] step 1 loss ⟨2.3100 … 2.3580⟩ on node⟨0 … 127⟩, except rank 17: loss nan"
    assert MERGED_NOTE in lines
    spread = next(line for line in lines if line.startswith("per rank (1,024 ranks): "))
    assert spread == "per rank (1,024 ranks): ok 1,023 (ranks 0-499,501-1023) · error 1 (rank 500)"
    # Every rank accounted for, once, in the statuses the summary names.
    named = [r for part in spread.split(": ", 1)[1].split(" · ") for r in ranks_in(re.search(r"\((.*)\)", part).group(1))]
    assert sorted(named) == list(range(N))
    assert any(line.startswith("  duration  min 100 ms (rank 0 and ") and "max 5.00 s (rank 99)" in line for line in lines)
    stand = next(line for line in lines if line.startswith("  stand out: "))
    assert stand.startswith("  stand out: rank 500 (raised ValueError) · rank 17 (odd output) · rank 99 (slowest")
    assert "── ValueError on rank 500 at cell line 3 ──" in text
    assert len(lines) < 30 and len(text.encode()) <= SCALED_SAVED_BYTES
    # The HTML: bounded, a section only for the ranks that stand out, and where the others are.
    assert len(page.encode()) <= SCALED_SAVED_BYTES
    sections = re.findall(r"<details><summary>rank (\d+) · (\w+) · [\d.]+ s — ([^<]*)</summary>", page)
    assert [(int(r), status) for r, status, _ in sections][:3] == [(500, "error"), (17, "ok"), (99, "ok")]
    assert 3 <= len(sections) <= MAX_RANK_SECTIONS
    assert "per rank: 1,024 ranks" in page and "ranks&#x27; own output is not in this saved view: _dist[rank].stdout" in page
    # The result itself keeps every rank's own line.
    assert result[17].stdout == "step 1 loss nan on node2\n" and result[3].stdout == loss_line(3)


def test_the_saved_view_is_bounded_however_much_every_rank_prints_and_says_what_it_left_out() -> None:
    results = {}
    for r in range(N):
        rr = RankResult(r, status="error", duration=0.1 + r / 1e4, finished_at=1.0 + r,
                        stdout="".join(f"rank {r} line {i} <{'x' * (r % 5)}> {'q' * (r % 3)}\n" for i in range(40)),
                        stderr=f"warning {r}: '{chr(65 + r % 26) * 30}'\n" * 5)
        rr.error = error(f"bad batch {r} on host {'abcdef'[r % 6]}{r}\n" + "detail & <more> 'quoted'\n" * (r % 4))
        results[r] = rr
    results[3].status, results[3].error = "dead", None
    results[3].returncode, results[3].stderr_tail = -9, "Killed\n" * 40
    result = CellResult(cell=9, code="x", ranks=list(range(N)), results=results, elapsed=3.0)
    view = StaticCell(result, diagnosis="[distnb] hang: " + "rank r waits in all_reduce <#7> & 'more'\n" * 3000)
    text, page = view.text(), view.html()
    assert len(page.encode()) <= SCALED_SAVED_BYTES and len(text.encode()) <= SCALED_SAVED_BYTES
    for left_out in ("of the diagnosis are not in this saved view", "of grouped output are not in this saved view",
                     "of the outcome are not in this saved view"):
        assert left_out in text and left_out in page
    assert len(re.findall(r"<details><summary>rank \d+ ·", page)) == MAX_RANK_SECTIONS


def test_scattered_ranks_and_many_displays_stay_bounded_too() -> None:
    ranks = list(range(0, 2 * N, 2))  # every other rank of 2,048: "ranks 0,2,4,…" would run to 5,000 characters
    results = {r: RankResult(r, status="ok", duration=0.1, displays=[{"text/plain": f"<Figure {r}>", "image/png": "iVBORw0KGgo" + "A" * 200}])
               for r in ranks}
    view = StaticCell(CellResult(cell=2, code="x", ranks=ranks, results=results, elapsed=1.0))
    text, page = view.text(), view.html()
    assert text.startswith("cell 2 on 1,024 ranks (0,2,4,") and len(text.splitlines()[0]) < 300
    assert page.count("<img ") == SCALED_DISPLAYS and f"{N - SCALED_DISPLAYS:,} more displays (of ranks " in page
    assert "_dist[rank].displays" in page and len(page.encode()) <= SCALED_SAVED_BYTES


def test_values_errors_and_deaths_of_many_ranks_are_summarised() -> None:
    results = {r: RankResult(r, status="ok", value={"text/plain": "nan" if r == 17 else f"{2.31 + (r % 50) / 1000:.3f}"}, duration=0.1)
               for r in range(N)}
    for r in range(100, 140):  # a node lost: its ranks died, the first one first
        results[r] = RankResult(r, status="dead", returncode=-9, first_death=r == 100, duration=None)
    for r in range(200, 300):  # their neighbours raised with their own device in the message
        results[r] = RankResult(r, status="error", error=error(f"NCCL error on cuda:{r % 8}"), finished_at=float(r))
    text = CellResult(cell=4, code="x", ranks=list(range(N)), results=results).outcome_text()
    assert "Out[ranks 0-99,140-199,300-1023]: ⟨2.310 … 2.359⟩, except rank 17: nan" in text
    assert text.count(" died first: ") == 1 and "ranks 103-139 died too: " in text and "_dist[rank].death_text()" in text
    assert "── ValueError on ranks 200-299 at cell line 3 ──" in text and "[ranks 200-299] NCCL error on cuda:⟨0 … 7⟩" in text
    assert len(text.splitlines()) < 40


def test_four_ranks_look_as_they_did() -> None:
    results = {r: RankResult(r, status="ok", stdout=f"step 1 loss {2.31 + r / 100:.4f} on node{r // 2}\nsame\n", value={"text/plain": f"{0.5 + r:.2f}"},
                             duration=0.25, finished_at=1.0 + r) for r in range(4)}
    results[3].stdout = "step 1 loss nan on node1\nsame\n"
    view = StaticCell(CellResult(cell=3, code="x", ranks=list(range(4)), results=results, elapsed=0.5))
    assert view.text() == ("cell 3 on ranks 0-3: ok, 4/4 done, 0.50 s\n[rank 0] step 1 loss 2.3100 on node0\n[rank 1] step 1 loss 2.3200 on node0\n"
                           "[rank 2] step 1 loss 2.3300 on node1\n[rank 3] step 1 loss nan on node1\n[ranks 0-3] same\n"
                           "Out[rank 0]: 0.50\nOut[rank 1]: 1.50\nOut[rank 2]: 2.50\nOut[rank 3]: 3.50")
    assert re.findall(r"<details><summary>[^<]*</summary>", view.html()) == [
        "<details><summary>per rank</summary>", *(f"<details><summary>rank {r} · ok · 0.25 s</summary>" for r in range(4))]


# -- the live widget view -------------------------------------------------------------------------
def test_the_live_view_of_1024_ranks_is_a_few_widgets_with_a_tab_for_each_rank_that_stands_out() -> None:
    from ipywidgets import Widget
    from ipywidgets.widgets import widget as widget_module

    from distnb.display.widgets import LIVE_SECTIONS, CellView

    _instances = widget_module._instances if hasattr(widget_module, "_instances") else Widget._active_widgets  # a module's dict from ipywidgets 8.0.5

    before = len(_instances)
    view = CellView(1, list(range(N)))
    assert len(_instances) - before < 40  # not a widget per rank
    result = CellResult(cell=1, code="x", ranks=list(range(N)), results={r: RankResult(r) for r in range(N)})
    for r in range(N):
        text = "step 1 loss nan on node2\n" if r == 17 else loss_line(r)
        result.results[r].add_output("stdout", text)
        view.feed(r, "stdout", text)
    result.results[500].status, result.results[500].error = "error", error("bad batch 500")
    view.rank_done(result.results[500])
    import time

    time.sleep(0.2)  # the printer's grouping window
    view.tick(result)
    assert "[ranks 0-1023] step 1 loss ⟨2.3100 … 2.3580⟩ on node⟨0 … 127⟩, except rank 17: loss nan" in view.printer.plain
    titles = list(view.selector.titles)
    assert titles[:3] == ["rank 0", "rank 500 · raised ValueError", "rank 17 · odd output"] and len(titles) <= LIVE_SECTIONS
    assert view.selector.children[1].outputs[0]["text"] == loss_line(500)
    assert "running 1,023" in view.spread.value and "error 1 (rank 500)" in view.spread.value
    for r in range(N):
        if r != 500:
            result.results[r].status, result.results[r].duration = "ok", 0.1
    view.finish(result)
    assert len(_instances) - before < 40


# -- %dist_memory -------------------------------------------------------------------------------
def memory_samples(world: int) -> dict[int, dict[str, float]]:
    samples = {r: {"rss": 900 * MB, "rss_start": 600 * MB, "rss_peak": 950 * MB + r, "cuda_allocated": (300 + r % 7) * MB,
                   "cuda_allocated_start": 100 * MB, "cuda_reserved": 1024 * MB, "cuda_peak": (4000 + r % 11) * MB,
                   "device_used": 5000 * MB, "device_total": 80 << 30} for r in range(world)}
    samples[min(17, world - 1)]["cuda_peak"] = 9000 * MB
    return samples


def test_memory_of_1024_ranks_is_each_columns_distribution_with_the_extremes_named() -> None:
    samples = memory_samples(N)
    report = MemoryReport({r: dict(s) for r, s in samples.items()}, [(3, samples)])
    lines = report.text().splitlines()
    assert lines[0] == "memory of ranks 0-1023 (1,024 ranks): each column's min, median and max, with the ranks at the extremes"
    peak = next(line for line in lines if line.lstrip().startswith("CUDA peak (last cell)"))
    assert "3.91 GiB (rank 0 and 93 others)" in peak and peak.endswith("8.79 GiB (rank 17)")
    assert any(line.lstrip().startswith("reserved") and "(every rank)" in line for line in lines)
    assert "  ⚠ rank 17 peaks at 2.2× the median CUDA peak of the others (8.79 GiB vs 3.91 GiB)" in lines
    assert len(lines) < 20 and len(report.table()[1]) == N  # the table keeps every rank's row
    assert report.named()[0] == 17
    bars = report.plot_bars()
    assert len(bars.axes[0].patches) == 2 * len(report.named())  # bars only for the ranks named, beside the boxes
    report.plot_timeline()
    # Up to SUMMARY_ABOVE ranks: a row per rank, as before.
    small = memory_samples(4)
    assert MemoryReport(small, [(3, small)]).text().splitlines()[2].lstrip().startswith("0 ")


def test_many_imbalances_name_the_highest_and_list_the_rest() -> None:
    samples = {r: {"cuda_peak": (9000 if r % 3 == 0 else 4000) * MB} for r in range(64)}
    line = memory_line(samples)
    assert line.count("peaks at") == 5 and "17 more ranks peak that far above the others' median: ranks 15,18," in line


def test_the_median_of_the_others_is_the_median_without_the_rank() -> None:
    rng = random.Random(7)
    for n in (2, 3, 4, 9, 10):
        values = sorted(rng.choice([1.0, 2.0, 5.0, 9.0, rng.random()]) for _ in range(n))
        for i in range(n):
            assert _median_without(values, i) == statistics.median(values[:i] + values[i + 1:])
    samples = {r: {"rss_peak": (100 + 500 * (r == 3)) * MB} for r in range(40)}
    assert [f.rank for f in imbalances(samples)] == [3]
