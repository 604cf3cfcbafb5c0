"""HTML views of distnb's reports, registered as IPython formatters by ``%load_ext distnb``.

Each view is the richer twin of the report's ``text()``, which IPython keeps as text/plain:
tables with the rows that matter highlighted (dead or hung ranks, the first divergence, differing
tensors or variables, memory outliers).
"""

from __future__ import annotations

import html
from typing import Any, Iterable, Sequence

from distnb.analysis.agreement.collective_table import MAX_MINORITIES, cell_text
from distnb.analysis.agreement.collectives import CollectiveReport
from distnb.analysis.reports.checks import CheckReport
from distnb.analysis.reports.comms import CommsReport
from distnb.analysis.reports.env import EnvReport
from distnb.analysis.reports.memory import MemoryReport
from distnb.analysis.reports.numerics import NumericsReport
from distnb.analysis.verdicts.stacks import StackReport
from distnb.cell_names import cell_name
from distnb.ranks import SUMMARY_ABOVE, format_ranks
from distnb.states import RankState
from distnb.status import PoolStatus

__all__ = ["register", "status_html", "stacks_html", "collectives_html", "check_html", "comms_html", "env_html", "memory_html",
           "numerics_html"]

BAD = "background:#ffebe9"
WARN = "background:#fff8c5"
BUSY = "background:#ddf4ff"


def _esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def table(headers: Sequence[str], rows: Iterable[tuple[Sequence[Any], str]], caption: str = "") -> str:
    """An HTML table; each row is (cells, css style for the row)."""
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{_esc(h)}</th>" for h in headers)
    body = "".join(
        f"<tr style='{style}'>" + "".join(f"<td style='text-align:left;padding:2px 8px;vertical-align:top'>{c}</td>" for c in cells) + "</tr>"
        for cells, style in rows
    )
    cap = f"<caption style='text-align:left;font-weight:bold;padding:4px 0'>{_esc(caption)}</caption>" if caption else ""
    return f"<table style='border-collapse:collapse;font-family:monospace;font-size:12px'>{cap}<tr>{head}</tr>{body}</table>"


def status_html(status: PoolStatus) -> str:
    def style(state: RankState) -> str:
        return BAD if state == RankState.DEAD else BUSY if state == RankState.RUNNING else ""

    caption = f"pool {status.state}: {status.world_size} ranks, backend {status.backend or '?'}, {status.cells_run} cells run"
    if len(status.ranks) > SUMMARY_ABOVE and not status.every_rank:
        return f"<b>{_esc(caption)}</b><pre>{_esc(chr(10).join(status.text().splitlines()[1:]))}</pre>"
    rows = [([_esc(r.rank), _esc(r.pid), _esc(r.host), _esc(r.device), _esc(r.describe())], style(r.state)) for r in status.ranks]
    return table(["rank", "pid", "host", "device", "state"], rows, caption)


def stacks_html(report: StackReport) -> str:
    rows = []
    for ranks, rs in report.groups():
        frames = "<br>".join(_esc(line.strip()) for line in rs.body())
        style = BUSY if rs.annotation else (BAD if rs.source != "control thread" else "")
        rows.append(([_esc(format_ranks(ranks)), _esc(rs.state_text) + (f"<br><b>{_esc(rs.annotation_text)}</b>" if rs.annotation else ""), frames], style))
    return table(["ranks", "state", "stack (most recent call last)"], rows, "stacks")


def collectives_html(report: CollectiveReport) -> str:
    if report.log.unavailable or not report.group_names():
        return f"<pre>{_esc(report.text())}</pre>"
    divs = {d.group: d for d in report.divergences()}
    parts = [f"<pre style='margin:0'>{_esc(report.headline())}</pre>"]
    for group in report.group_names():
        t = report.table(group, divs.get(group))
        style = lambda row: BAD if row.divergence else (WARN if row.open else "")  # noqa: E731
        if t.summarised and report.page is None:
            rows = []
            for row in t.rows:
                (most, words), others = row.sides()[0], row.sides()[1:]
                differ = "<br>".join(f"{_esc(format_ranks(rs))}: {_esc(w)}" for rs, w in others[:MAX_MINORITIES])
                if len(others) > MAX_MINORITIES:
                    differ += f"<br>… {sum(len(rs) for rs, _ in others[MAX_MINORITIES:])} more ranks (--per-rank shows each)"
                rows.append(([_esc(row.seq), _esc(words), _esc(format_ranks(most)) if others else "all", differ], style(row)))
            parts.append(table(["#", "most ranks", "which", "the ranks that differ"], rows, t.header()[3:]))
            continue
        columns = t.members if report.page is None else t.page(report.page)
        rows = [([_esc(row.seq), *(_esc(cell_text(row.by_rank.get(r), row.divergence and r in row.odd)) for r in columns)], style(row))
                for row in t.rows]
        caption = t.header()[3:] + (f" · page {report.page} of {t.pages}" if report.page is not None else "")
        parts.append(table(["#", *[f"rank {r}" for r in columns]], rows, caption))
    return "".join(parts)


def check_html(report: CheckReport) -> str:
    """The checksum table: one row per entry and group of ranks holding the same thing. An entry
    that differs has its odd ranks' rows red and its majority (reference) rows yellow; identical,
    sharded and partial entries stay uncoloured."""
    checks = {c.path or report.name: c for c in report.checks}
    rows = []
    for row in report.to_rows():
        check = checks.get(str(row.get("entry")))
        ranks = row.get("ranks", [])
        style = ""
        if row.get("status") == "differs":
            odd = set(check.odd) if check is not None else set()
            style = BAD if ranks and set(ranks) <= odd else WARN
        shape = row.get("shape") if row.get("shape") is not None else row.get("value")
        rows.append(([_esc(row.get("entry")), _esc(format_ranks(ranks)), _esc(shape), _esc(row.get("dtype")),
                      _esc(row.get("sum")), _esc(row.get("norm")), _esc(row.get("nan")), _esc(row.get("inf")),
                      _esc(str(row.get("fingerprint") or "")[:12])], style))
    head = f"<pre style='margin:0'>{_esc(report.text().splitlines()[0])}</pre>"
    if not rows:
        return head
    return head + table(["entry", "ranks", "shape", "dtype", "sum", "norm", "NaN", "Inf", "fingerprint"], rows)


def env_html(report: EnvReport) -> str:
    differing = set(report.differing())
    ranks = sorted(report.env)
    rows = [([_esc(n), *[_esc(report.env[r].get(n, "<unset>")) for r in ranks]], BAD if n in differing else "") for n in report.names()]
    return table(["variable", *[f"rank {r}" for r in ranks]], rows, report.text().splitlines()[0])


def memory_html(report: MemoryReport) -> str:
    """The memory table with the text form's columns (``MemoryReport.table``: RSS, its change over
    the last cell, CUDA allocated with its change, reserved and peak, NVML device used/total);
    ranks flagged for imbalance are highlighted."""
    if report.summarised:
        # A row per column (min, median, max with the ranks at the extremes), not a row per rank.
        cols, dist_rows = report.summary()
        notes = "".join(f"<div style='color:#cf222e'>⚠ {_esc(line)}</div>" for line in report.imbalance())
        return table(cols, [([_esc(c) for c in cells], "") for cells in dist_rows], report.text().splitlines()[0]) + notes
    cols, rows = report.table()
    flags = report.imbalances()
    flagged = {flag.rank for flag in flags}
    body = [([_esc(c) for c in cells], BAD if r in flagged else "") for r, cells in rows]
    notes = "".join(f"<div style='color:#cf222e'>⚠ {_esc(flag.text())}</div>" for flag in flags)
    return table(cols, body, f"memory of {format_ranks([r for r, _ in rows])}") + notes


def comms_html(report: CommsReport) -> str:
    """``--comms``: the per-module table (rows where ranks differ highlighted), then the
    redistributes and the text form's notes."""
    rows = []
    for row in report.rows:
        calls, nbytes = row.usual
        rows.append(([_esc(row.module), row.phase, _esc(row.op), _esc(row.over), str(calls), _esc(f"{nbytes:,} B"), _esc(row.who)],
                     BAD if row.who != "all" else ""))
    body = table(["module", "pass", "collective", "over", "calls", "bytes", "ranks"], rows,
                 f"communication of {cell_name(report.cell)} on {format_ranks(sorted(report.per_rank))}")
    return body + "<pre style='font-size:12px'>" + _esc("\n".join(report.notes())) + "</pre>"


def numerics_html(report: NumericsReport) -> str:
    """``--numerics``: the text's findings, then the ops around the first divergence, a column per rank
    (up to 16) with each rank's output sum; the ranks apart from their group highlighted."""
    rows = report.table()
    ranks = sorted(report.records)[:SUMMARY_ABOVE]
    body = []
    for row in rows:
        cells = [str(row["position"]), _esc(row["op"]), _esc(row["module"]), _esc(f"{row['cell']}:{row['line']}" if row["cell"] else ""),
                 _esc(row["phase"]), _esc(row["must_agree"])]
        for r in ranks:
            s = row["sums"].get(r)
            text = "" if s is None else f"{s:.6g}"
            cells.append(f"<span style='{BAD};font-weight:bold'>{_esc(text)}</span>" if r in row["odd"] else _esc(text))
        body.append((cells, WARN if row["divergence"] else ""))
    lines = report.text().splitlines()
    head = "".join(f"<div>{_esc(line)}</div>" for line in lines)
    return head + table(["#", "op", "module", "cell:line", "pass", "must agree"] + [f"rank {r}" for r in ranks], body,
                        "ops around the first divergence (output sums)" if report.first else "the first ops (output sums)")


def register(ipython: Any) -> None:
    formatter = ipython.display_formatter.formatters["text/html"]
    for cls, fn in ((PoolStatus, status_html), (StackReport, stacks_html), (CollectiveReport, collectives_html),
                    (CheckReport, check_html), (EnvReport, env_html), (MemoryReport, memory_html), (CommsReport, comms_html),
                    (NumericsReport, numerics_html)):
        formatter.for_type(cls, fn)
