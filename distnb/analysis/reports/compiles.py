"""``torch.compile`` across ranks: each rank's compile record (worker/torch_hooks/compile_record.py) compared.

Ranks that run the same code with the same shapes compile the same frames the same number of
times. A rank whose guard fails (another input shape, a Python value that changed) recompiles,
and while it compiles the others wait at their next collective; a rank that graph-breaks where the
others don't, or whose graph holds other collectives, runs another program. Per compiled code
object the ranks are grouped by what they did; the odd ones are named, with the guard that failed.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from distnb.cell_names import cell_name
from distnb.ranks import SUMMARY_ABOVE, format_ranks, group_by

__all__ = ["CompileReport"]

_ID = re.compile(r"^\[?\d+/\d+\]?:\s*")


def _reason(text: str | None) -> str:
    """A guard failure without its compile id and user stack: ``tensor 'x' size mismatch …``."""
    return _ID.sub("", (text or "").split("\n")[0]).strip()


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


@dataclass
class CompileReport:
    """Every rank's compile events of some cells, compared code object by code object."""

    events: dict[int, list[dict[str, Any]]]  # rank -> compile events (compile_record's), in order
    breaks: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> graph break reason -> count
    cells: list[int] = field(default_factory=list)
    sources: dict[int, str] = field(default_factory=dict)  # cell -> code, to name a cell's functions

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)

    def codes(self) -> dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]]:
        """(name, file, line) of each compiled code object -> each rank's compiles of it."""
        return self._codes

    # A report is built for one look at records that do not change: grouped and compared once,
    # however many of summary(), differences(), odd_ranks() and text() ask.
    @functools.cached_property
    def _codes(self) -> dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]]:
        out: dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]] = {}
        for r, events in self.events.items():
            for e in events:
                if str(e.get("name", "")).startswith("torch_dynamo_resume_in_"):
                    continue  # the rest of a frame after a graph break: counted with its frame's breaks
                key = (str(e.get("name")), str(e.get("file")), int(e.get("line") or 0))
                out.setdefault(key, {}).setdefault(r, []).append(e)
        return out

    def _name(self, key: tuple[str, str, int]) -> str:
        name, file, line = key
        m = re.fullmatch(r"<cell-(\d+)>", file)
        where = f"{cell_name(m.group(1))} line {line}" if m else f"{file.rsplit('/', 1)[-1]}:{line}"
        return f"`{name}` ({where})"

    def differences(self) -> list[str]:
        """Sentences, one per thing ranks did differently: compiles, graph breaks, collectives in graphs."""
        return list(self._differences)

    @functools.cached_property
    def _differences(self) -> list[str]:
        out = []
        ranks = self.ranks
        for key, by_rank in self.codes().items():
            counts = {r: len(by_rank.get(r, [])) for r in ranks}
            sides = sorted(group_by(sorted(counts.items())), key=lambda g: -len(g[0]))
            if len(sides) > 1:
                odd = [(rs, n) for rs, n in sides[1:]]
                words = []
                for rs, n in odd:
                    reasons = Counter(_reason(e.get("recompile")) for r in rs for e in by_rank.get(r, []) if e.get("recompile"))
                    why = f" (guard failed: {reasons.most_common(1)[0][0]})" if reasons else ""
                    verb = "recompiled" if n > 1 else "compiled"
                    words.append(f"{format_ranks(rs)} {verb} {self._name(key)} {_times(n)}{why}" if n else f"{format_ranks(rs)} did not compile it")
                major, n = sides[0]
                words.append(f"{format_ranks(major)} compiled it {_times(n)}" if n else f"{format_ranks(major)} did not compile it")
                out.append("; ".join(words))
            graphs = {r: tuple(tuple(e.get("collectives") or ()) for e in by_rank.get(r, []) if e.get("collectives") is not None) for r in ranks}
            graphs = {r: g for r, g in graphs.items() if g}
            if len({g for g in graphs.values()}) > 1:
                gsides = sorted(group_by(sorted(graphs.items())), key=lambda g: -len(g[0]))
                out.append(f"the graphs of {self._name(key)} hold other collectives: " + "; ".join(
                    f"{format_ranks(rs)}: {self._collectives(g)}" for rs, g in gsides))
        brk = {r: sum(self.breaks.get(r, {}).values()) for r in ranks}
        if len(set(brk.values())) > 1:
            bsides = sorted(group_by(sorted(brk.items())), key=lambda g: -len(g[0]))
            first = next((reason for r in bsides[-1][0] for reason in self.breaks.get(r, {})), "")
            out.append("graph breaks differ: " + "; ".join(f"{format_ranks(rs)} {n}" for rs, n in bsides)
                       + (f" (e.g. {first.splitlines()[0].strip()})" if first else ""))
        return out

    @staticmethod
    def _collectives(graphs: tuple[tuple[str, ...], ...]) -> str:
        ops = Counter(op for g in graphs for op in g)
        return ", ".join(f"{op} ×{n}" for op, n in sorted(ops.items())) or "none"

    @property
    def graphs_recorded(self) -> bool:
        """Whether any rank's compiles carry their graphs' collectives (recorded with --paths)."""
        return any(e.get("collectives") is not None for by_rank in self.codes().values() for es in by_rank.values() for e in es)

    def odd_ranks(self) -> list[int]:
        """Ranks that compiled something differently from the majority, or whose graphs hold
        other collectives, for a diagnosis."""
        ranks = self.ranks
        odd: set[int] = set()
        for by_rank in self.codes().values():
            counts = {r: len(by_rank.get(r, [])) for r in ranks}
            sides = sorted(group_by(sorted(counts.items())), key=lambda g: -len(g[0]))
            for rs, _ in sides[1:]:
                odd.update(rs)
            graphs = {r: g for r in ranks if (g := tuple(tuple(e.get("collectives") or ()) for e in by_rank.get(r, [])
                                                         if e.get("collectives") is not None))}
            gsides = sorted(group_by(sorted(graphs.items())), key=lambda g: -len(g[0]))
            for rs, _ in gsides[1:]:
                odd.update(rs)
        return sorted(odd)

    def summary(self) -> str:
        diffs = self.differences()
        where = f" (cell{'s' if len(self.cells) > 1 else ''} {', '.join(map(str, self.cells))})" if self.cells else ""
        if not self.codes() and not any(self.breaks.values()):
            return f"torch.compile compiled nothing on {format_ranks(self.ranks)}{where}."
        if not diffs and not self.graphs_recorded:
            # Counts alike say nothing of what the graphs issue: a branch taken inside one rank's
            # graph issues another collective with the same compile count.
            return (f"torch.compile compiled the same frames as often on {format_ranks(self.ranks)}{where}; what their graphs "
                    "issue was not recorded (run the cell with --paths to compare the graphs' collectives).")
        if not diffs:
            return f"torch.compile did the same on {format_ranks(self.ranks)}{where}: the same frames as often, graphs with the same collectives."
        return f"torch.compile differs across ranks{where}: " + "; ".join(diffs) + "."

    def text(self) -> str:
        lines = [f"[distnb] {self.summary()}"]
        ranks = self.ranks
        for key, by_rank in self.codes().items():
            counts = {r: len(by_rank.get(r, [])) for r in ranks}
            seconds = {r: sum(e.get("seconds") or 0.0 for e in by_rank.get(r, [])) for r in ranks}
            if len(ranks) <= SUMMARY_ABOVE:
                cells = ", ".join(f"rank {r} {counts[r]}×" + (f" {seconds[r]:.1f} s" if seconds[r] >= 0.05 else "") for r in ranks)
            else:
                sides = sorted(group_by(sorted(counts.items())), key=lambda g: -len(g[0]))
                cells = "; ".join(f"{format_ranks(rs)} {n}×" for rs, n in sides)
            lines.append(f"  {self._name(key)}: compiled {cells}")
            reasons = group_by(sorted((r, _reason(e.get("recompile"))) for r in ranks for e in by_rank.get(r, []) if e.get("recompile")))
            for rs, why in reasons[:4]:
                lines.append(f"    recompiled on {format_ranks(sorted(set(rs)))}: {why}")
            fails = {str(e["fail"]) for r in ranks for e in by_rank.get(r, []) if e.get("fail")}
            lines.extend(f"    failed: {f}" for f in sorted(fails)[:2])
        for r in ranks[: SUMMARY_ABOVE]:
            for reason, n in list(self.breaks.get(r, {}).items())[:2]:
                lines.append(f"  graph break on rank {r} ×{n}: {reason.splitlines()[0].strip()}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())
