"""Communication per module (``%%on_ranks --comms``): each rank's collectives as PyTorch's
CommDebugMode counted them (worker/torch_hooks/comms.py), merged across ranks — per module, pass (forward or
backward), collective and mesh dimension: calls and bytes, with the ranks that differ from the
majority named — and the DTensor redistributes with their source and target placements."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from distnb._text import mib
from distnb.analysis.agreement.evidence import odd_ones
from distnb.analysis.agreement.groups import GroupInfo
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by

__all__ = ["CommsReport", "CommRow"]

_SHOWN = 40  # rows in the text; the rest are counted


def _over(rec: dict[str, Any]) -> str:
    """The mesh dimension (``dp``), torch's description, or the group's name."""
    if rec.get("group") is None:
        return "?"
    info = GroupInfo(str(rec["group"]), rec.get("desc") or None)
    return info.role()


def _calls(n: int) -> str:
    return f"{n} call" + ("" if n == 1 else "s")


def _size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1 << 20 else mib(n)


@dataclass
class CommRow:
    """One (module, pass, collective, dimension) across ranks."""

    module: str
    phase: str  # fwd · bwd
    op: str
    over: str
    per_rank: dict[int, tuple[int, int]]  # rank → (calls, bytes); ranks without any are (0, 0)

    @property
    def odd(self) -> list[int]:
        odd = odd_ones(self.per_rank)
        return odd if len(odd) < len(self.per_rank) else []

    @property
    def who(self) -> str:
        """``all`` when every rank made the same calls; else who differs."""
        if len(set(self.per_rank.values())) < 2:
            return "all"
        odd = self.odd
        return f"✗ {format_ranks(odd)} differ" if odd else "✗ ranks differ (no majority)"

    @property
    def usual(self) -> tuple[int, int]:
        counts = Counter(self.per_rank.values())
        return counts.most_common(1)[0][0]


@dataclass
class CommsReport:
    cell: int
    per_rank: dict[int, dict[str, Any]]  # rank → its ``comms`` (worker/torch_hooks/comms.py)
    rows: list[CommRow] = field(default_factory=list)
    redistributes: list[tuple[tuple[str, str, str, str, str, str], dict[int, int]]] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, cell: int, per_rank: dict[int, dict[str, Any] | None]) -> CommsReport:
        report = cls(cell, {r: c for r, c in per_rank.items() if c})
        ranks = sorted(per_rank)
        tallies: dict[tuple[str, str, str, str], dict[int, list[int]]] = {}
        moves: dict[tuple[str, str, str, str, str, str], dict[int, int]] = {}
        for r in ranks:
            comms = per_rank[r]
            if not comms:
                report.errors[r] = "no accounting came back (the rank did not finish the cell)"
                continue
            if "error" in comms:
                report.errors[r] = str(comms["error"])
                continue
            for rec in comms.get("records", []):
                key = (rec["module"], "bwd" if rec.get("bw") else "fwd", rec["op"], _over(rec))
                t = tallies.setdefault(key, {}).setdefault(r, [0, 0])
                t[0] += 1
                t[1] += int(rec.get("bytes") or 0)
            for red in comms.get("redistributes", []):
                dims = ",".join(red.get("dims") or []) or "?"
                rkey = (red["module"], "bwd" if red.get("bw") else "fwd", red["src"], red["dst"], str(red.get("shape")), dims)
                moves.setdefault(rkey, {})
                moves[rkey][r] = moves[rkey].get(r, 0) + 1
        reporting = [r for r in ranks if r not in report.errors]
        for key, by_rank in tallies.items():
            report.rows.append(CommRow(*key, {r: tuple(by_rank.get(r, (0, 0))) for r in reporting}))  # type: ignore[misc]
        report.redistributes = [(k, {r: v.get(r, 0) for r in reporting}) for k, v in moves.items()]
        return report

    def odd_ranks(self) -> list[int]:
        return sorted({r for row in self.rows for r in row.odd} | {r for _, v in self.redistributes for r in odd_ones(v) if len(odd_ones(v)) < len(v)})

    def per_dimension(self) -> dict[str, tuple[int, int]]:
        """Per mesh dimension, the majority's calls and bytes summed over modules."""
        out: dict[str, list[int]] = {}
        for row in self.rows:
            calls, nbytes = row.usual
            t = out.setdefault(row.over, [0, 0])
            t[0] += calls
            t[1] += nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def text(self) -> str:
        ranks = sorted(self.per_rank)
        lines = [f"communication of {cell_name(self.cell)} on {format_ranks(ranks)} (PyTorch's CommDebugMode; bytes: what a rank sends in)"]
        if not self.rows and not self.redistributes:
            lines.append("  no collective ran under the accounting.")
        if self.rows:
            width = max(12, *(len(r.module) for r in self.rows[:_SHOWN]))
            lines.append(f"  {'module':<{width}}  pass  {'collective':<26}{'over':<8}{'calls':>6}  {'bytes':>10}  ranks")
            for row in self.rows[:_SHOWN]:
                calls, nbytes = row.usual
                lines.append(f"  {row.module:<{width}}  {row.phase:<4}  {row.op:<26}{row.over:<8}{calls:>6}  {_size(nbytes):>10}  {row.who}")
            if len(self.rows) > _SHOWN:
                lines.append(f"  … and {len(self.rows) - _SHOWN} more rows")
        return "\n".join(lines + self.notes())

    def notes(self) -> list[str]:
        """Everything under the table: totals per dimension, the odd ranks' figures, the
        redistributes, ranks without an account."""
        lines = []
        if self.rows:
            totals = self.per_dimension()
            lines.append("  per dimension: " + " · ".join(f"{d} {_calls(c)} {_size(b)}" for d, (c, b) in sorted(totals.items()) if c))
        for row in self.rows:
            for rs, (calls, nbytes) in group_by((r, v) for r, v in sorted(row.per_rank.items()) if r in row.odd):
                lines.append(f"  ✗ {format_ranks(rs)}: {row.module} {row.phase} {row.op} over {row.over}: {_calls(calls)}, {_size(nbytes)} "
                             f"where the others made {_calls(row.usual[0])}, {_size(row.usual[1])}")
        if self.redistributes:
            lines.append("  redistributes (DTensor), source → target placements:")
            for (module, phase, src, dst, shape, dims), counts in self.redistributes[:_SHOWN]:
                odd = odd_ones(counts)
                usual = Counter(counts.values()).most_common(1)[0][0]
                who = "" if not odd or len(odd) == len(counts) else f"  ✗ {format_ranks(odd)}: " + ", ".join(f"{counts[r]}×" for r in odd)
                lines.append(f"    {module} {phase}: {src} → {dst} of {shape} over ({dims}) ×{usual}{who}")
        for r, why in sorted(self.errors.items()):
            lines.append(f"  rank {r}: {why}")
        dropped = sum(int(c.get("dropped") or 0) for c in self.per_rank.values())
        if dropped:
            lines.append(f"  ({dropped} collectives past the per-cell record limit were counted by CommDebugMode but not itemised)")
        return lines

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def plot(self) -> Any:
        """Bytes per module, stacked by mesh dimension (the majority's)."""
        from matplotlib.figure import Figure

        modules = list(dict.fromkeys(r.module for r in self.rows))
        dims = sorted({r.over for r in self.rows})
        if not modules:
            return None
        fig = Figure(figsize=(6.5, 0.6 + 0.35 * len(modules)), layout="constrained")
        ax = fig.add_subplot()
        left = [0.0] * len(modules)
        for d in dims:
            widths = [sum(r.usual[1] for r in self.rows if r.module == m and r.over == d) / 1024 for m in modules]
            ax.barh(modules, widths, left=left, label=d)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("KiB sent per rank (majority)")
        ax.legend(title="over", fontsize=8)
        ax.set_title(f"communication per module, {cell_name(self.cell)}", fontsize=9)
        return fig
