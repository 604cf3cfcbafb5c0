"""Two runs of a cell compared op by op, rank by rank (``%dist_numerics diff A B``): the same cell
before and after a change, eager against compiled, two seeds. Each rank's records of the two runs
(worker/torch_hooks/numerics.py) are walked side by side; the first op that is another op, or
whose outputs differ (bit for bit, or sums and sampled elements beyond a tolerance), is that rank's
answer, with the size of the difference."""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass
from typing import Any

from distnb.analysis.reports.numerics_gap import Gap, gap, within
from distnb.analysis.reports.numerics_text import op_words, size_words
from distnb.cell_names import cell_name
from distnb.ranks import format_ranks, group_by
from distnb.wire.record_types import NumericsRecord, OpRecord

__all__ = ["RankDiff", "RunsDiff", "diff_runs"]


@dataclass(frozen=True)
class RankDiff:
    """Where one rank's two runs first differ."""

    rank: int
    position: int  # the op's number in both runs' order (in run A's, once the runs' ops parted)
    how: str  # "value" (same op, other outputs), "op" (another op), "ended" (one run has no more ops)
    a: OpRecord | None
    b: OpRecord | None
    # When the runs' ops part (a compiled run fuses ops; changed code takes another path), the ops
    # both made are paired (:func:`_anchors`) and compared: ``position_b`` is the op's number in
    # run B, ``compared`` how many pairs were (all of them agreeing, for how="op").
    position_b: int | None = None
    compared: int = 0

    @property
    def diff(self) -> float:
        if self.a is None or self.b is None or not self.a.outputs or not self.b.outputs:
            return math.nan
        return abs(self.a.outputs[0].total - self.b.outputs[0].total)

    @property
    def size(self) -> Gap | None:
        """The largest element difference of the first outputs (see numerics.py's ``Gap``)."""
        if self.a is None or self.b is None or not self.a.outputs or not self.b.outputs:
            return None
        return gap(self.a.outputs[0], self.b.outputs[0])


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
        within_tolerance = f" (sums and sampled elements within rtol={self.tolerance[0]:g}, atol={self.tolerance[1]:g})"
        lines = [f"{cell_name(self.a)} against {cell_name(self.b)}, op by op on each rank"
                 + ("" if self.tolerance == (0.0, 0.0) else within_tolerance) + ":"]
        keyed = [(r, (d.position, d.how, d.a.op if d.a else None, d.b.op if d.b else None) if d else None)
                 for r, d in sorted(self.per_rank.items())]
        for ranks, _key in group_by(keyed):
            d = self.per_rank[ranks[0]]
            who = format_ranks(ranks)
            if d is None:
                lines.append(f"  {who}: the same on every op recorded.")
            elif d.how == "value" and d.a is not None and d.b is not None:
                sizes = "; ".join(f"rank {r}: {size_words(size, rd.a.outputs[0].total, rd.b.outputs[0].total)}"
                                  for r in ranks[:4] if (rd := self.per_rank[r]) is not None and rd.a and rd.b and (size := rd.size))
                at = f"op #{d.position}" if d.position_b is None else f"op #{d.position} of {cell_name(self.a)} (#{d.position_b} of {cell_name(self.b)})"
                lines.append(f"  {who}: first difference at {at}, {op_words(d.a.op, d.a.module, d.a.cell, d.a.line, d.a.phase)}"
                             + (f" ({sizes})" if sizes else "") + "." + self._parted(d))
            elif d.how == "op":
                after = (f"the {d.compared} ops both made (paired by op, output shapes and named tensors read, look-alikes left out) agree"
                         if d.compared else "no op of one run has a counterpart alike in op, output shapes and named tensors read in the other")
                lines.append(f"  {who}: the ops part at #{d.position}: {_words(d.a)} in {cell_name(self.a)}, {_words(d.b)} in {cell_name(self.b)}; "
                             f"{after}.")
            else:
                lines.append(f"  {who}: the same for {d.position} ops, then only {cell_name(self.a if d.a else self.b)} ran more "
                             f"(first {_words(d.a or d.b)}).")
        if self.missing:
            lines.append(f"  {format_ranks(self.missing)}: no record in one of the runs (not run with --numerics, or no result).")
        return "\n".join(lines)

    def _parted(self, d: RankDiff) -> str:
        if d.position_b is None:
            return ""
        return (f" Likely, not certain: the two runs' ops had parted before it (a compiled run fuses ops, changed code takes another "
                f"path); the ops were paired in order by op, output shapes and the named tensors they read, look-alikes left out, and "
                f"the {d.compared} pair{'s' if d.compared != 1 else ''} before it agreed.")

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def _words(op: OpRecord | None) -> str:
    return op_words(op.op, op.module, op.cell, op.line, op.phase) if op is not None else "nothing"


def _same(x: OpRecord, y: OpRecord, rtol: float, atol: float) -> bool:
    """The same outputs: bit for bit, or (a tolerance) sums and sampled elements within it."""
    if [(o.shape, o.dtype) for o in x.outputs] != [(o.shape, o.dtype) for o in y.outputs]:
        return False
    if rtol == 0 and atol == 0:
        return [(o.hash, repr(o.total)) for o in x.outputs] == [(o.hash, repr(o.total)) for o in y.outputs]
    return all(within(a, b, rtol, atol) for o, p in zip(x.outputs, y.outputs) for a, b in zip((o.total, *o.sample), (p.total, *p.sample)))


def _key(op: OpRecord) -> tuple[str, tuple[tuple[int, ...], ...], str]:
    """An op as both runs would name it: without its overload (a compiled run calls ``addmm.out``
    where eager called ``addmm.default``), with its outputs' shapes and the first named tensor it
    read, without the model's own name (``model.0.bias`` and a compiled ``cmodel._orig_mod.0.bias``
    are both ``0.bias``): two ops alike in all three can still be paired wrongly."""
    label = next((i.label for i in op.inputs if i.label), "")
    return (op.op.rsplit(".", 1)[0] if op.op.count(".") >= 2 else op.op, tuple(o.shape for o in op.outputs),
            label.replace("._orig_mod.", ".").partition(".")[2])


def _anchors(keys_a: list[Any], keys_b: list[Any]) -> list[tuple[int, int]]:
    """The ops both runs made, paired as patience diff pairs lines: only keys that occur once in
    each run (two look-alikes, the same activation at one shape in two layers, may be paired
    wrongly, and a difference claimed from a wrong pair would be false), and of those the longest
    run of pairs in the same order in both."""
    count_a, count_b = collections.Counter(keys_a), collections.Counter(keys_b)
    where_b = {k: j for j, k in enumerate(keys_b) if count_b[k] == 1}
    pairs = [(i, where_b[k]) for i, k in enumerate(keys_a) if count_a[k] == 1 and k in where_b]
    # The longest increasing subsequence of the B positions (patience sorting, O(n log n)).
    tails: list[int] = []
    tail_at: list[int] = []
    before = [-1] * len(pairs)
    for n, (_, j) in enumerate(pairs):
        k = bisect.bisect_left(tails, j)
        if k == len(tails):
            tails.append(j)
            tail_at.append(n)
        else:
            tails[k], tail_at[k] = j, n
        before[n] = tail_at[k - 1] if k else -1
    chain, n = [], tail_at[-1] if tail_at else -1
    while n >= 0:
        chain.append(pairs[n])
        n = before[n]
    return chain[::-1]


def _matched(ops_a: list[OpRecord], ops_b: list[OpRecord], rank: int, rtol: float, atol: float) -> RankDiff:
    """Runs whose ops part: the first pair of ops both made (:func:`_anchors`) whose outputs
    differ; else where they parted, with how many pairs agreed."""
    keys_a, keys_b = [_key(o) for o in ops_a], [_key(o) for o in ops_b]
    pairs = _anchors(keys_a, keys_b)
    for n, (i, j) in enumerate(pairs):
        if not _same(ops_a[i], ops_b[j], rtol, atol):
            return RankDiff(rank, i, "value", ops_a[i], ops_b[j], j, n)
    parted = next((i for i, (x, y) in enumerate(zip(keys_a, keys_b)) if x != y), min(len(ops_a), len(ops_b)))
    return RankDiff(rank, parted, "op", ops_a[parted] if parted < len(ops_a) else None, ops_b[parted] if parted < len(ops_b) else None,
                    compared=len(pairs))


def _first(ops_a: list[OpRecord], ops_b: list[OpRecord], rank: int, rtol: float, atol: float) -> RankDiff | None:
    n = min(len(ops_a), len(ops_b))
    if [_key(o) for o in ops_a[:n]] != [_key(o) for o in ops_b[:n]]:
        return _matched(ops_a, ops_b, rank, rtol, atol)
    # The same ops in the same order (one run may have gone on): compared one to one, certain.
    for i, (x, y) in enumerate(zip(ops_a, ops_b)):
        if not _same(x, y, rtol, atol):
            return RankDiff(rank, i, "value", x, y)
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
