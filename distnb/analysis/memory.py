"""Per-rank memory: the compact line under each cell, the %dist_memory table, plots, imbalance."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from distnb._text import MiB, size
from distnb.ranks import format_ranks

__all__ = ["Imbalance", "MemoryReport", "figure_png", "imbalance", "imbalances", "memory_line"]

#: A rank is flagged when its peak is this many times the median …
IMBALANCE_RATIO = 1.5
#: … and at least this much above it (small absolute differences are noise).
IMBALANCE_MIN_BYTES = 64 << 20


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

    @property
    def ratio(self) -> float:
        return self.peak / self.median

    def text(self) -> str:
        return (f"rank {self.rank} peaks at {self.ratio:.1f}× the median {self.what} of the others "
                f"({size(self.peak)} vs {size(self.median)})")


def imbalances(samples: dict[int, dict[str, Any]]) -> list[Imbalance]:
    """Ranks whose peak stands out. Each rank is compared with the median of the *other* ranks,
    so one outlier among two ranks is still seen."""
    key = _peak_key(samples)
    peaks: dict[int, float] = {r: s[key] for r, s in samples.items() if s.get(key) is not None}
    if len(peaks) < 2 or max(peaks.values()) - min(peaks.values()) < IMBALANCE_MIN_BYTES:
        return []  # no rank can be that far above a median of the others (every cell asks this)
    what = "CUDA peak" if key == "cuda_peak" else "RSS peak"
    out = []
    for r, p in sorted(peaks.items()):
        med = statistics.median(v for q, v in peaks.items() if q != r)
        if med > 0 and p >= IMBALANCE_RATIO * med and p - med >= IMBALANCE_MIN_BYTES:
            out.append(Imbalance(r, what, p, med))
    return out


def imbalance(samples: dict[int, dict[str, Any]]) -> list[str]:
    """The imbalances in words, e.g. 'rank 3 peaks at 1.9× the median RSS peak of the others …'."""
    return [flag.text() for flag in imbalances(samples)]


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


def _delta(sample: dict[str, Any], key: str) -> str:
    """The change of ``key`` over the cell ("+300 MiB"), from its ``<key>_start`` companion."""
    start, end = sample.get(f"{key}_start"), sample.get(key)
    if start is None or end is None:
        return "-"
    return ("+" if end >= start else "") + size(end - start)


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
        return [flag.text() for flag in self.imbalances()]

    def table(self) -> tuple[list[str], list[tuple[int, list[str]]]]:
        """Column names and each rank's row of cells, shared by :meth:`text` and the HTML view so
        both always carry the same columns. CUDA columns appear once a rank uses CUDA; the device
        column once NVML reported the device."""
        last = self.last_cell()
        ranks = sorted(set(self.current) | set(last))
        samples = list(self.current.values()) + list(last.values())
        cuda = any("cuda_allocated" in s for s in samples)
        device = any("device_used" in s for s in samples)
        cols = ["rank", "RSS now", "RSS peak (last cell)", "Δ RSS (last cell)"]
        if cuda:
            cols += ["CUDA alloc", "Δ CUDA alloc (last cell)", "reserved", "CUDA peak (last cell)"]
        if device:
            cols += ["GPU used/total (NVML)"]
        rows = []
        for r in ranks:
            now, cell = self.current.get(r, {}), last.get(r, {})
            row = [str(r), size(now.get("rss")), size(cell.get("rss_peak")), _delta(cell, "rss")]
            src = now or cell  # "now" when the rank answered, else what its last cell ended with
            if cuda:
                row += [
                    size(src.get("cuda_allocated")),
                    _delta(cell, "cuda_allocated"),
                    size(src.get("cuda_reserved")),
                    size(cell.get("cuda_peak")),
                ]
            if device:
                used = src.get("device_used")
                row.append(f"{size(used)} / {size(src.get('device_total'))}" if used is not None else "-")
            rows.append((r, row))
        return cols, rows

    def text(self) -> str:
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

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    # -- plots (matplotlib, imported only when asked) -------------------------------------------
    def plot_bars(self) -> Any:
        """Bar chart of current and last-cell peak per rank."""
        import matplotlib
        from matplotlib.figure import Figure

        last = self.last_cell()
        ranks = sorted(set(self.current) | set(last))
        key = _peak_key(last) if last else "rss_peak"
        now_key = "cuda_allocated" if key == "cuda_peak" else "rss"
        fig = Figure(figsize=(max(4.0, 0.6 * len(ranks) + 2), 3.0))
        ax = fig.add_subplot()
        xs = range(len(ranks))
        now = [self.current.get(r, {}).get(now_key, 0) / MiB for r in ranks]
        peak = [last.get(r, {}).get(key, 0) / MiB for r in ranks]
        ax.bar([x - 0.2 for x in xs], now, width=0.4, label="now")
        ax.bar([x + 0.2 for x in xs], peak, width=0.4, label="peak (last cell)")
        flagged = {flag.rank for flag in self.imbalances()}
        for x, r in zip(xs, ranks):
            if r in flagged:
                ax.annotate("⚠", (x + 0.2, peak[x]), ha="center", va="bottom", color="red")
        ax.set_xticks(list(xs), [str(r) for r in ranks])
        ax.set_xlabel("rank")
        ax.set_ylabel("MiB (CUDA)" if key == "cuda_peak" else "MiB (RSS)")
        ax.set_title("memory per rank")
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        del matplotlib
        return fig

    def plot_timeline(self) -> Any:
        """Each rank's peak per cell."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.0, 3.0))
        ax = fig.add_subplot()
        key = _peak_key(self.last_cell()) if self.timeline else "rss_peak"
        ranks = sorted({r for _c, s in self.timeline for r in s})
        for r in ranks:
            pts = [(c, s[r][key] / MiB) for c, s in self.timeline if r in s and key in s[r]]
            if pts:
                ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=f"rank {r}")
        ax.set_xlabel("cell")
        ax.set_ylabel("peak MiB (CUDA)" if key == "cuda_peak" else "peak MiB (RSS)")
        ax.set_title("peak memory per cell")
        if ranks:
            ax.legend(loc="best", fontsize="small", ncol=2)
        fig.tight_layout()
        return fig
