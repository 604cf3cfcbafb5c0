"""Per-rank memory: the compact line under each cell, the %dist_memory table, plots, imbalance.

Up to :data:`~distnb.ranks.SUMMARY_ABOVE` ranks the table has a row per rank and the bar chart a
bar per rank. Above, a row per rank is no view (1,024 of them): the text gives each column's
distribution — min, median, max, with the ranks at the extremes named — and the plots draw the
distribution (a box, a band) with bars or lines only for the ranks named (the extremes, the ranks
flagged for imbalance). :meth:`MemoryReport.table` keeps every rank's row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from distnb._text import MiB, size
from distnb.cell_names import cell_tag
from distnb.ranks import SUMMARY_ABOVE, format_ranks

__all__ = ["Imbalance", "MemoryReport", "figure_png", "imbalance", "imbalances", "memory_line"]

#: A rank is flagged when its peak is this many times the median …
IMBALANCE_RATIO = 1.5
#: … and at least this much above it (small absolute differences are noise). CUDA peaks are the
#: caching allocator's exact counts of live tensors.
IMBALANCE_MIN_BYTES = 64 << 20
#: RSS peaks also hold what the C allocator kept of freed blocks, which depends on each process's
#: history: a healthy cell freeing ten-MB tensors 50 times peaked 86 MiB higher on one of two
#: identical ranks (a 2-core CI machine). Twice that noise before RSS counts as evidence.
RSS_IMBALANCE_MIN_BYTES = 160 << 20
#: Imbalances named one by one before the rest are counted (and their ranks listed).
MAX_FLAGS = 5
#: Ranks the summarised plots draw on their own (the extremes and the flagged).
PLOT_RANKS = 8

_Sample = dict[str, Any]
#: A table column: its name, its number from a rank's samples (now, now-or-last, last cell), how a number reads.
_Column = tuple[str, Callable[[_Sample, _Sample, _Sample], float | None], Callable[[float | None], str]]


def figure_png(fig: Any) -> bytes:
    """A matplotlib Figure as PNG bytes (shown inline without needing %matplotlib inline)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _peak_key(samples: dict[int, dict[str, Any]]) -> str:
    """Compare CUDA peaks when the ranks use CUDA, else process RSS peaks."""
    return "cuda_peak" if any("cuda_peak" in s for s in samples.values()) else "rss_peak"


@dataclass(frozen=True)
class Imbalance:
    """A rank whose peak stands out from the median of the others."""

    rank: int
    what: str  # "RSS peak" or "CUDA peak"
    peak: float  # bytes
    median: float  # bytes, of the other ranks
    # What every rank holds before its code does anything (an RSS floor: the interpreter, torch,
    # its CUDA libraries — ~0.5 GiB for a CUDA build): the ratio is of what lies above it.
    floor: float = 0.0

    @property
    def ratio(self) -> float:
        base = self.median - self.floor
        return (self.peak - self.floor) / base if base > 0 else float("inf")

    def text(self) -> str:
        if self.floor:
            return (f"rank {self.rank} peaks at {size(self.peak)}, {size(self.peak - self.median)} above the median {self.what} "
                    f"of the others ({size(self.median)})")
        return (f"rank {self.rank} peaks at {self.ratio:.1f}× the median {self.what} of the others "
                f"({size(self.peak)} vs {size(self.median)})")


def imbalances(samples: dict[int, dict[str, Any]]) -> list[Imbalance]:
    """Ranks whose peak stands out. Each rank is compared with the median of the *other* ranks,
    so one outlier among two ranks is still seen. RSS peaks are compared above the lowest RSS a
    rank of the cell started it with: the part every process holds alike is no evidence, and
    would hide a rank that allocates 200 MiB more on a CUDA build of torch."""
    key = _peak_key(samples)
    peaks: dict[int, float] = {r: s[key] for r, s in samples.items() if s.get(key) is not None}
    least = IMBALANCE_MIN_BYTES if key == "cuda_peak" else RSS_IMBALANCE_MIN_BYTES
    if len(peaks) < 2 or max(peaks.values()) - min(peaks.values()) < least:
        return []  # no rank can be that far above a median of the others (every cell asks this)
    what = "CUDA peak" if key == "cuda_peak" else "RSS peak"
    starts = [s["rss_start"] for r, s in samples.items() if r in peaks and s.get("rss_start") is not None]
    floor = float(min(starts)) if key == "rss_peak" and len(starts) == len(peaks) else 0.0
    ordered = sorted(peaks.values())
    index = {v: i for i, v in enumerate(ordered)}  # a value's last place: which one is left out doesn't matter
    out = []
    for r, p in sorted(peaks.items()):
        med = _median_without(ordered, index[p])
        if p - med < least:
            continue
        flag = Imbalance(r, what, p, med, floor)
        if flag.ratio >= IMBALANCE_RATIO:
            out.append(flag)
    return out


def _median_without(ordered: list[float], i: int) -> float:
    """The median of the sorted values less the one at ``i``, in O(1): a rank's "median of the
    others" for every rank costs one sort, not a median per rank (quadratic at 1,024 ranks)."""
    n = len(ordered) - 1

    def at(j: int) -> float:  # the j-th of the others
        return ordered[j if j < i else j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def imbalance(samples: dict[int, dict[str, Any]]) -> list[str]:
    """The imbalances in words, e.g. 'rank 3 peaks at 1.9× the median RSS peak of the others …';
    past :data:`MAX_FLAGS`, the highest ones and a line that counts and lists the rest."""
    return _flag_words(imbalances(samples))


def _flag_words(flags: list[Imbalance]) -> list[str]:
    if len(flags) <= MAX_FLAGS:
        return [flag.text() for flag in flags]
    top = sorted(flags, key=lambda f: -f.ratio)
    rest = sorted(f.rank for f in top[MAX_FLAGS:])
    return [f.text() for f in top[:MAX_FLAGS]] + [f"{len(rest):,} more ranks peak that far above the others' median: {format_ranks(rest)}"]


def memory_line(samples: dict[int, dict[str, Any]]) -> str:
    """One line for a cell: the peak range across ranks, CUDA when in use, and any imbalance."""
    if not samples:
        return ""
    parts = []
    for label, key in (("RSS peak", "rss_peak"), ("CUDA peak", "cuda_peak")):
        values = [s[key] for s in samples.values() if key in s]
        if values:
            lo, hi = size(min(values)), size(max(values))
            parts.append(f"{label} {lo}" + (f"–{hi}" if hi != lo else ""))
    dev = [(s["device_used"], s["device_total"]) for s in samples.values() if "device_used" in s]
    if dev:
        parts.append(f"GPU (NVML) {size(max(u for u, _ in dev))} / {size(dev[0][1])}")
    flags = imbalance(samples)
    return "memory: " + " · ".join(parts) + ("  ⚠ " + "; ".join(flags) if flags else "")


def _delta_bytes(sample: dict[str, Any], key: str) -> float | None:
    """The change of ``key`` over the cell, from its ``<key>_start`` companion."""
    start, end = sample.get(f"{key}_start"), sample.get(key)
    return None if start is None or end is None else end - start


def _signed(n_bytes: float | None) -> str:
    """A change in words: "+300 MiB", "-12 MiB", "-" for none."""
    return "-" if n_bytes is None else ("+" if n_bytes >= 0 else "") + size(n_bytes)


def _who(ranks: list[int], of: int) -> str:
    """The rank at an extreme: ``rank 3``, ``rank 3 and 1,020 others`` where many share it, or
    ``every rank`` where all ``of`` do."""
    if len(ranks) == of > 1:
        return "every rank"
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" + (f" and {len(ranks) - 1:,} others" if len(ranks) > 1 else "")


@dataclass
class MemoryReport:
    """Each rank's memory now and its peak per cell."""

    current: dict[int, dict[str, Any]]
    timeline: list[tuple[int, dict[int, dict[str, Any]]]] = field(default_factory=list)

    def last_cell(self) -> dict[int, dict[str, Any]]:
        """Each rank's sample from the most recent cell it ran."""
        out: dict[int, dict[str, Any]] = {}
        for _cell, samples in self.timeline:
            out.update(samples)
        return out

    def imbalances(self) -> list[Imbalance]:
        return imbalances(self.last_cell() or self.current)

    def imbalance(self) -> list[str]:
        return _flag_words(self.imbalances())

    def _ranks(self) -> list[int]:
        return sorted(set(self.current) | set(self.last_cell()))

    @property
    def summarised(self) -> bool:
        """More ranks than a table lists (SUMMARY_ABOVE): :meth:`text` gives each column's distribution."""
        return len(self._ranks()) > SUMMARY_ABOVE

    def _columns(self) -> list[_Column]:
        """Each column: its name, its number from a rank's samples (now, now-or-last, last cell)
        and how a number reads. CUDA columns appear once a rank uses CUDA; the device column once
        NVML reported the device."""
        samples = list(self.current.values()) + list(self.last_cell().values())
        cols: list[_Column] = [
            ("RSS now", lambda now, src, cell: now.get("rss"), size),
            ("RSS peak (last cell)", lambda now, src, cell: cell.get("rss_peak"), size),
            ("Δ RSS (last cell)", lambda now, src, cell: _delta_bytes(cell, "rss"), _signed),
        ]
        if any("cuda_allocated" in s for s in samples):
            cols += [
                ("CUDA alloc", lambda now, src, cell: src.get("cuda_allocated"), size),
                ("Δ CUDA alloc (last cell)", lambda now, src, cell: _delta_bytes(cell, "cuda_allocated"), _signed),
                ("reserved", lambda now, src, cell: src.get("cuda_reserved"), size),
                ("CUDA peak (last cell)", lambda now, src, cell: cell.get("cuda_peak"), size),
            ]
        if any("device_used" in s for s in samples):
            cols.append(("GPU used/total (NVML)", lambda now, src, cell: src.get("device_used"), size))
        return cols

    def _values(self) -> tuple[list[str], dict[int, list[float | None]]]:
        """Column names and each rank's numbers (None where the rank has none)."""
        last = self.last_cell()
        cols = self._columns()
        out: dict[int, list[float | None]] = {}
        for r in self._ranks():
            now, cell = self.current.get(r, {}), last.get(r, {})
            src = now or cell  # "now" when the rank answered, else what its last cell ended with
            out[r] = [get(now, src, cell) for _, get, _ in cols]
        return [name for name, _, _ in cols], out

    def table(self) -> tuple[list[str], list[tuple[int, list[str]]]]:
        """Column names and each rank's row of cells, shared by :meth:`text` and the HTML view so
        both always carry the same columns (every rank's row, however many)."""
        names, values = self._values()
        shows = [show for _, _, show in self._columns()]
        last = self.last_cell()
        rows = []
        for r, numbers in values.items():
            row = [str(r)] + [show(v) for show, v in zip(shows, numbers)]
            if names[-1] == "GPU used/total (NVML)":
                src = self.current.get(r) or last.get(r, {})
                used = src.get("device_used")
                row[-1] = f"{size(used)} / {size(src.get('device_total'))}" if used is not None else "-"
            rows.append((r, row))
        return ["rank", *names], rows

    def summary(self) -> tuple[list[str], list[list[str]]]:
        """Each column's distribution over the ranks: ``min (rank 3) · median · max (rank 17)``,
        a row per column — what :meth:`text` shows above SUMMARY_ABOVE ranks."""
        names, values = self._values()
        shows = [show for _, _, show in self._columns()]
        rows = []
        for i, (name, show) in enumerate(zip(names, shows)):
            per_rank = {r: x for r, v in values.items() if (x := v[i]) is not None}
            if name == "GPU used/total (NVML)":
                totals = sorted({s["device_total"] for s in self.current.values() if s.get("device_total")})
                name = "GPU used (NVML)" + (f", of {size(totals[0])}" if len(totals) == 1 else "")
            if not per_rank:
                rows.append([name, "-", "-", "-"])
                continue
            ordered = sorted(per_rank.values())
            lo, hi = ordered[0], ordered[-1]
            rows.append([name, f"{show(lo)} ({_who([r for r, v in per_rank.items() if v == lo], len(per_rank))})",
                         show(ordered[len(ordered) // 2]), f"{show(hi)} ({_who([r for r, v in per_rank.items() if v == hi], len(per_rank))})"])
        return ["", "min", "median", "max"], rows

    def text(self) -> str:
        if self.summarised:
            return self._summary_text()
        cols, rows = self.table()
        cells = [cols] + [row for _, row in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
        lines = [f"memory of {format_ranks([r for r, _ in rows])}"]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        lines += [f"  ⚠ {flag}" for flag in self.imbalance()]
        if "CUDA alloc" in cols:
            lines.append("  (CUDA columns: PyTorch's caching allocator; GPU used (NVML): everything on the device — the CUDA "
                         "context, NCCL's buffers, other libraries and processes)")
        return "\n".join(lines)

    def _summary_text(self) -> str:
        cols, rows = self.summary()
        cells = [cols] + rows
        widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
        ranks = self._ranks()
        lines = [f"memory of {format_ranks(ranks)} ({len(ranks):,} ranks): each column's min, median and max, with the ranks at the extremes"]
        lines += ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
        lines += [f"  ⚠ {flag}" for flag in self.imbalance()]
        if any(name.startswith("CUDA") for name, *_ in rows):
            lines.append("  (CUDA rows: PyTorch's caching allocator; GPU used (NVML): everything on the device)")
        lines.append("  a rank's own row: %dist_memory <rank>; every rank's: pool.memory().table()")
        return "\n".join(lines)

    def named(self, count: int = PLOT_RANKS) -> list[int]:
        """The ranks a summarised plot draws on their own: the flagged (highest first), then the
        ranks at the top and bottom of the last cell's peaks, ``count`` in all."""
        last = self.last_cell()
        key = _peak_key(last) if last else "rss_peak"
        peaks = {r: s[key] for r, s in last.items() if s.get(key) is not None}
        order = [f.rank for f in sorted(self.imbalances(), key=lambda f: -f.ratio)]
        if peaks:
            by_peak = sorted(peaks, key=lambda r: (-peaks[r], r))
            order += [by_peak[0], min(peaks, key=lambda r: (peaks[r], r)), *by_peak[1:3]]
        return list(dict.fromkeys(order))[:count]

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    # -- plots (matplotlib, imported only when asked) -------------------------------------------
    def plot_bars(self) -> Any:
        """Bar chart of current and last-cell peak per rank; above SUMMARY_ABOVE ranks, a box of
        each over all ranks, then bars for the ranks :meth:`named` (flagged ones marked ⚠)."""
        import matplotlib
        from matplotlib.figure import Figure

        last = self.last_cell()
        ranks = self._ranks()
        key = _peak_key(last) if last else "rss_peak"
        now_key = "cuda_allocated" if key == "cuda_peak" else "rss"
        every, many = ranks, len(ranks) > SUMMARY_ABOVE
        if many:
            ranks = self.named()
        fig = Figure(figsize=(max(4.0, 0.6 * (len(ranks) + 2 * many) + 2), 3.0))
        ax = fig.add_subplot()
        first = 2 if many else 0  # the boxes of all ranks take the first places
        xs = range(first, first + len(ranks))
        now = [self.current.get(r, {}).get(now_key, 0) / MiB for r in ranks]
        peak = [last.get(r, {}).get(key, 0) / MiB for r in ranks]
        if many:
            boxes = [[v / MiB for r in every if (v := self.current.get(r, {}).get(now_key)) is not None],
                     [v / MiB for r in every if (v := last.get(r, {}).get(key)) is not None]]
            kept = [(x, b) for x, b in zip((0.3, 0.7), boxes) if b]
            if kept:
                ax.boxplot([b for _, b in kept], positions=[x for x, _ in kept], widths=0.3)
            ax.axvline(1.5, color="grey", linewidth=0.5)
        ax.bar([x - 0.2 for x in xs], now, width=0.4, label="now")
        ax.bar([x + 0.2 for x in xs], peak, width=0.4, label="peak (last cell)")
        flagged = {flag.rank for flag in self.imbalances()}
        for x, r, p in zip(xs, ranks, peak):
            if r in flagged:
                ax.annotate("⚠", (x + 0.2, p), ha="center", va="bottom", color="red")
        ticks = ([0.5], [f"all {len(every):,}\n(now · peak)"]) if many else ([], [])
        ax.set_xticks([*ticks[0], *xs], [*ticks[1], *(str(r) for r in ranks)])
        ax.set_xlabel("rank")
        ax.set_ylabel("MiB (CUDA)" if key == "cuda_peak" else "MiB (RSS)")
        ax.set_title(f"memory of {len(every):,} ranks: the extremes and the flagged" if many else "memory per rank")
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        del matplotlib
        return fig

    def plot_timeline(self) -> Any:
        """Each rank's peak per cell; above SUMMARY_ABOVE ranks, the band all ranks' peaks span,
        their median, and the lines of the ranks :meth:`named`."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.0, 3.0))
        ax = fig.add_subplot()
        key = _peak_key(self.last_cell()) if self.timeline else "rss_peak"
        ranks = sorted({r for _c, s in self.timeline for r in s})
        if len(ranks) > SUMMARY_ABOVE:
            cells = [(c, sorted(v[key] / MiB for v in s.values() if key in v)) for c, s in self.timeline]
            cells = [(c, vs) for c, vs in cells if vs]
            xs = [c for c, _ in cells]
            ax.fill_between(xs, [vs[0] for _, vs in cells], [vs[-1] for _, vs in cells], alpha=0.25, label=f"all {len(ranks):,} ranks")
            ax.plot(xs, [vs[len(vs) // 2] for _, vs in cells], color="grey", linewidth=1, label="median")
            ranks = self.named(5)
        for r in ranks:
            pts = [(c, s[r][key] / MiB) for c, s in self.timeline if r in s and key in s[r]]
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=f"rank {r}")
        ax.set_xlabel("cell")
        if 0 < len(self.timeline) <= 16:  # named as the notebook names them; more would not fit
            ax.set_xticks([c for c, _ in self.timeline], [cell_tag(c) for c, _ in self.timeline], fontsize=7)
        ax.set_ylabel("peak MiB (CUDA)" if key == "cuda_peak" else "peak MiB (RSS)")
        ax.set_title("peak memory per cell")
        if ranks:
            ax.legend(loc="best", fontsize="small", ncol=2)
        fig.tight_layout()
        return fig
