"""Two runs of a cell compared op by op, rank by rank (``%dist_numerics diff A B``): the same cell
before and after a change, eager against compiled, two seeds. Each rank's records of the two runs
(worker/torch_hooks/numerics.py) are walked side by side; the first op that is another op, or
whose outputs differ (bit for bit, or sums beyond a tolerance), is that rank's answer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from distnb.analysis.reports.numerics_text import op_words
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by
from distnb.wire.records import NumericsRecord, OpRecord

__all__ = ["RankDiff", "RunsDiff", "diff_runs"]


@dataclass(frozen=True)
class RankDiff:
    """Where one rank's two runs first differ."""

    rank: int
    position: int  # the op's number in both runs' order
    how: str  # "value" (same op, other outputs), "op" (another op), "ended" (one run has no more ops)
    a: OpRecord | None
    b: OpRecord | None

    @property
    def diff(self) -> float:
        if self.a is None or self.b is None or not self.a.outputs or not self.b.outputs:
            return math.nan
        return abs(self.a.outputs[0].total - self.b.outputs[0].total)


@dataclass
class RunsDiff:
    a: int
    b: int
    per_rank: dict[int, RankDiff | None]  # None: the two runs agree on every op recorded
    tolerance: tuple[float, float]
    missing: list[int]  # ranks without a record in one of the runs

    @property
    def identical(self) -> bool:
        return all(d is None for d in self.per_rank.values()) and not self.missing

    def text(self) -> str:
        lines = [f"{cell_name(self.a)} against {cell_name(self.b)}, op by op on each rank"
                 + ("" if self.tolerance == (0.0, 0.0) else f" (sums within rtol={self.tolerance[0]:g}, atol={self.tolerance[1]:g})") + ":"]
        keyed = [(r, (d.position, d.how, d.a.op if d.a else None, d.b.op if d.b else None) if d else None)
                 for r, d in sorted(self.per_rank.items())]
        for ranks, _key in group_by(keyed):
            d = self.per_rank[ranks[0]]
            who = format_ranks(ranks)
            if d is None:
                lines.append(f"  {who}: the same on every op recorded.")
            elif d.how == "value" and d.a is not None and d.b is not None:
                sums = ", ".join(f"rank {r}: {self.per_rank[r].a.outputs[0].total:.6g} against {self.per_rank[r].b.outputs[0].total:.6g}"  # type: ignore[union-attr]
                                 for r in ranks[:4] if self.per_rank[r] and self.per_rank[r].a.outputs and self.per_rank[r].b.outputs)  # type: ignore[union-attr]
                lines.append(f"  {who}: first difference at op #{d.position}, {op_words(d.a.op, d.a.module, d.a.cell, d.a.line, d.a.phase)}"
                             + (f" (sum {sums})" if sums else "") + ".")
            elif d.how == "op":
                lines.append(f"  {who}: the ops part at #{d.position}: {_words(d.a)} in {cell_name(self.a)}, {_words(d.b)} in {cell_name(self.b)}.")
            else:
                lines.append(f"  {who}: the same for {d.position} ops, then only {cell_name(self.a if d.a else self.b)} ran more "
                             f"(first {_words(d.a or d.b)}).")
        if self.missing:
            lines.append(f"  {format_ranks(self.missing)}: no record in one of the runs (not run with --numerics, or no result).")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def _words(op: OpRecord | None) -> str:
    return op_words(op.op, op.module, op.cell, op.line, op.phase) if op is not None else "nothing"


def _same(x: OpRecord, y: OpRecord, rtol: float, atol: float) -> bool:
    if [(o.shape, o.dtype) for o in x.outputs] != [(o.shape, o.dtype) for o in y.outputs]:
        return False
    if rtol == 0 and atol == 0:
        return [(o.hash, repr(o.total)) for o in x.outputs] == [(o.hash, repr(o.total)) for o in y.outputs]
    for o, p in zip(x.outputs, y.outputs):
        if math.isnan(o.total) != math.isnan(p.total) or (not math.isnan(o.total) and abs(o.total - p.total) > atol + rtol * max(abs(o.total), abs(p.total))):
            return False
    return True


def _first(ops_a: list[OpRecord], ops_b: list[OpRecord], rank: int, rtol: float, atol: float) -> RankDiff | None:
    for i, (x, y) in enumerate(zip(ops_a, ops_b)):
        if x.op != y.op:
            return RankDiff(rank, i, "op", x, y)
        if not _same(x, y, rtol, atol):
            return RankDiff(rank, i, "value", x, y)
    n = min(len(ops_a), len(ops_b))
    if len(ops_a) != len(ops_b):
        return RankDiff(rank, n, "ended", ops_a[n] if n < len(ops_a) else None, ops_b[n] if n < len(ops_b) else None)
    return None


def diff_runs(a: int, records_a: dict[int, NumericsRecord | None], b: int, records_b: dict[int, NumericsRecord | None],
              rtol: float = 0.0, atol: float = 0.0) -> RunsDiff:
    """Cells ``a`` and ``b`` (their per-rank records) compared rank by rank."""
    ranks = sorted(set(records_a) | set(records_b))
    per_rank: dict[int, RankDiff | None] = {}
    missing = []
    for r in ranks:
        ra, rb = records_a.get(r), records_b.get(r)
        if not ra or not rb or "ops" not in ra or "ops" not in rb:
            missing.append(r)
            continue
        per_rank[r] = _first(list(ra["ops"]), list(rb["ops"]), r, rtol, atol)
    return RunsDiff(a, b, per_rank, (rtol, atol), missing)
