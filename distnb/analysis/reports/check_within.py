"""A check inside the groups of a mesh dimension (``%dist_check NAME --within tp``).

Across a whole (dp, tp) mesh, most tensors differ by design: data-parallel replicas see other
batches, so their activations differ. What must agree is narrower — tensor-parallel peers see the
same batch, so ``inp`` must be identical inside each ``tp`` group, whatever it is across them.
:func:`compare_within` compares a name inside each group of a dimension and says which groups
disagree and who stands out in each; :func:`agreement_by_dim` says, for a name that differs
across the world, along which dimensions it agrees (a note, never a verdict).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distnb.analysis.reports.checks import CheckReport, compare
from distnb.ranks import format_ranks

__all__ = ["WithinReport", "agreement_by_dim", "compare_within"]

#: What ranks of a dimension share, by its usual name: said when they do not.
_MEANS = {"tp": "tensor-parallel peers must see the same batch and hold the same replicated values",
          "cp": "context-parallel peers must see the same batch",
          "pp": "pipeline stages hold different layers: compare inside dp or tp instead",
          "dp": "data-parallel replicas must hold the same parameters (their activations differ by design)",
          "ep": "expert-parallel peers hold different experts: compare inside dp instead"}


@dataclass
class WithinReport:
    """One name compared inside each group of a mesh dimension."""

    name: str
    dim: str
    groups: list[tuple[list[int], CheckReport]]

    @property
    def identical(self) -> bool:
        return all(report.identical for _, report in self.groups)

    @property
    def differing(self) -> list[list[int]]:
        return [ranks for ranks, report in self.groups if not report.identical]

    @property
    def odd_ranks(self) -> list[int]:
        """In each differing group, its odd ranks (every rank of a group of two that differ)."""
        out: set[int] = set()
        for ranks, report in self.groups:
            if not report.identical:
                tie = any(c.tie for c in report.checks)  # two ranks apart: nothing says which is wrong
                out.update(ranks if tie or not report.odd_ranks else report.odd_ranks)
        return sorted(out)

    def header(self) -> str:
        names = " and ".join(f"({','.join(map(str, rs))})" for rs, _ in self.groups)
        if self.identical:
            return f"check {self.name} within {self.dim}: identical inside every {self.dim} group {names}"
        bad = " and ".join(f"({','.join(map(str, rs))})" for rs in self.differing)
        why = _MEANS.get(self.dim, f"ranks of one {self.dim} group must agree on it")
        return (f"check {self.name} within {self.dim}: differs inside {self.dim} group{'s' * (len(self.differing) > 1)} {bad}: {why}"
                f" — odd {format_ranks(self.odd_ranks).replace(' ', ': ', 1)}")

    def text(self) -> str:
        lines = [self.header()]
        for ranks, report in self.groups:
            if not report.identical:
                lines.append(f"  {self.dim} group ({','.join(map(str, ranks))}):")
                lines.extend("  " + line for line in report.text().splitlines()[1:])
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def compare_within(name: str, per_rank: dict[int, dict[str, Any]], dim: str, groups: list[list[int]]) -> WithinReport:
    """Compare ``name``'s checksums inside each of ``groups`` (the rank groups of mesh dimension ``dim``)."""
    out = []
    for ranks in groups:
        mine = {r: per_rank[r] for r in ranks if r in per_rank}
        if len(mine) > 1:
            out.append((sorted(mine), compare(name, mine)))
    return WithinReport(name, dim, out)


def agreement_by_dim(name: str, per_rank: dict[int, dict[str, Any]], dims: dict[str, list[list[int]]]) -> str:
    """``inp: identical inside each tp group, differs across them (normal across data parallel)``
    for a name that differs across the world; ``""`` when no dimension's groups agree."""
    agree = [dim for dim, groups in dims.items() if compare_within(name, per_rank, dim, groups).identical]
    if not agree:
        return ""
    others = [d for d in dims if d not in agree]
    across = f", differs across them (along {', '.join(others)})" if others else ""
    return f"{name}: identical inside each {' and each '.join(agree)} group{across}"
