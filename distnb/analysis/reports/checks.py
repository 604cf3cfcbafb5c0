"""Compare checksums across ranks (controller side; imports no torch).

``compare(name, {rank: checksum(...)})`` flattens each rank's summary into entries ("layer.weight",
"layer.weight.grad", "state.0.exp_avg", "" for a bare tensor), groups ranks by what they hold and
reports: identical, or which entries differ and which ranks are the odd ones out by majority.
Sharded DTensor entries differ by design and are compared by layout, except that on a mesh that
also replicates (e.g. ``[Shard(0), Replicate()]``) the replicas of each shard must match bitwise;
NaN/Inf are always named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from distnb.ranks import format_ranks, group_by

__all__ = ["CheckReport", "EntryCheck", "compare", "entries"]

_MAX_SHOWN = 20  # differing entries shown in the text; .differing has them all
_MAX_NOTES = 10  # NaN/Inf lines shown
_FP_PREFIX = 8
_SHARDED = re.compile(r"Shard|\bS\(")  # "Shard(0)", "StridedShard(0)", torch's short "S(0)"
_PARTIAL = re.compile(r"Partial|\bP\(")


def entries(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A rank's checksum as ``{entry path: leaf summary}`` ("" for a bare tensor or value).

    Module entries read like ``state_dict()`` keys; gradients add ``.grad``.
    """
    kind = summary.get("kind")
    if kind == "module":
        out = dict(summary.get("params", {}))
        out.update({f"{name}.grad": s for name, s in summary.get("grads", {}).items()})
        out.update(summary.get("buffers", {}))
        return out
    if kind in ("mapping", "sequence"):
        return dict(summary.get("items", {}))
    return {"": summary}


def _layout(leaf: dict[str, Any]) -> str | None:
    """"sharded" / "partial" for DTensor entries whose local values legitimately differ."""
    placement = leaf.get("placement") or ""
    if _SHARDED.search(placement):
        return "sharded"
    if _PARTIAL.search(placement):
        return "partial"
    return None


def _shard_id(leaf: dict[str, Any]) -> tuple[int, ...] | None:
    """Which piece a rank holds of a DTensor that is sharded (or partial) on some mesh dimensions
    and replicated on others: its mesh coordinates on the non-replicated dimensions. Ranks with
    the same id hold replicas of one piece, which must be bitwise identical. None when the
    placement is not mixed (or the rank's coordinate is unknown)."""
    placements = list(leaf.get("placements") or [])
    coord = leaf.get("mesh_coord")
    if coord is None or len(coord) != len(placements) or "Replicate()" not in placements:
        return None
    return tuple(c for c, p in zip(coord, placements) if p != "Replicate()")


def _replica_groups(leaves: dict[int, dict[str, Any] | None]) -> list[tuple[list[int], Any]] | None:
    """For a mixed-placement DTensor: ranks grouped by (piece, fingerprint), or None if not mixed."""
    ids = {r: _shard_id(leaf) for r, leaf in leaves.items() if leaf is not None}
    if not ids or any(i is None for i in ids.values()):
        return None
    return group_by((r, (ids[r], leaves[r].get("fingerprint"))) for r in sorted(ids))  # type: ignore[union-attr]


def _key(leaf: dict[str, Any] | None) -> tuple[Any, ...]:
    """What must be equal across ranks for an entry to count as identical."""
    if leaf is None:
        return ("missing",)
    kind = leaf.get("kind")
    if kind != "tensor":
        return (kind, leaf.get("repr"), leaf.get("error"))
    shape, dtype, placement = tuple(leaf.get("shape") or ()), leaf.get("dtype"), leaf.get("placement")
    if _layout(leaf):  # each rank holds its own piece: only the layout has to agree
        return ("tensor", shape, dtype, placement)
    return ("tensor", shape, dtype, placement, leaf.get("fingerprint"), leaf.get("error"))


def _row_key(leaf: dict[str, Any] | None) -> tuple[Any, ...]:
    # Rows of the table: ranks holding the very same thing, shards included.
    return _key(leaf) + ((leaf.get("fingerprint"),) if leaf and _layout(leaf) else ())


@dataclass
class EntryCheck:
    """One entry across ranks: its status and the rank groups, majority (reference) first."""

    path: str
    status: str  # identical · differs · sharded · partial
    groups: list[tuple[list[int], dict[str, Any] | None]]
    leaves: dict[int, dict[str, Any] | None] = field(default_factory=dict)  # each rank's own summary
    tie: bool = False  # no strict majority: the group holding the lowest rank is the reference
    # Set for a DTensor sharded on some mesh dims and replicated on others: the ranks whose piece
    # differs from the majority of that piece's replicas (the groups then list each piece's majority first).
    odd_ranks: list[int] | None = None

    @property
    def odd(self) -> list[int]:
        if self.status != "differs":
            return []
        if self.odd_ranks is not None:
            return list(self.odd_ranks)
        return sorted(r for ranks, _ in self.groups[1:] for r in ranks)

    @property
    def is_tensor(self) -> bool:
        return any(leaf is not None and leaf.get("kind") == "tensor" for _, leaf in self.groups)


@dataclass
class CheckReport:
    """The comparison of one name across ranks; ``text()`` stands alone."""

    name: str
    per_rank: dict[int, dict[str, Any]]
    checks: list[EntryCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # NaN/Inf call-outs
    layout_notes: list[str] = field(default_factory=list)  # DTensors: Partial left unreduced, uneven shards

    @property
    def ranks(self) -> list[int]:
        return sorted(self.per_rank)

    @property
    def identical(self) -> bool:
        return not any(c.status == "differs" for c in self.checks)

    @property
    def differing(self) -> list[str]:
        return [c.path for c in self.checks if c.status == "differs"]

    @property
    def odd_ranks(self) -> list[int]:
        return sorted({r for c in self.checks for r in c.odd})

    @property
    def sharded(self) -> list[str]:
        return [c.path or self.name for c in self.checks if c.status in ("sharded", "partial")]

    # -- text -----------------------------------------------------------------------------------
    def _noun(self, n: int) -> str:
        tensors = all(c.is_tensor for c in self.checks)
        word = ("tensor" if tensors else "entry") if n == 1 else ("tensors" if tensors else "entries")
        return f"{n} {word}"

    def header(self) -> str:
        if not self.per_rank:
            return f"check {self.name}: no rank answered"
        total = len(self.checks)
        if self.identical:
            n_tensors = sum(c.is_tensor for c in self.checks)
            what = [f"{n_tensors} tensor{'s' * (n_tensors != 1)}"] if n_tensors else []
            if total - n_tensors:
                what.append(f"{total - n_tensors} value{'s' * (total - n_tensors != 1)}")
            # Say exactly what was compared: a shard held by several ranks (a mesh dimension it is
            # replicated over) bitwise across them; a shard nobody else holds, its layout alone.
            replicated = sum(c.status == "sharded" and _replica_groups(c.leaves) is not None for c in self.checks)
            alone = sum(c.status == "sharded" for c in self.checks) - replicated
            partial = sum(c.status == "partial" for c in self.checks)
            extra = (f"; {replicated} sharded, each shard compared bitwise across its replicas" if replicated else "") + (
                f"; {alone} sharded with no replica to compare, layout (global shape, dtype, placement) compared only" if alone else "") + (
                f"; {partial} partial (pending a reduction), layout compared only" if partial else "")
            return f"check {self.name}: identical on {format_ranks(self.ranks)} ({', '.join(what) or 'empty'}{extra})"
        diffs = [c for c in self.checks if c.status == "differs"]
        odd = self.odd_ranks
        who = f"odd {format_ranks(odd).replace(' ', ': ', 1)}"
        if len(self.ranks) > 2 and all(len(c.groups) == len(self.ranks) for c in diffs):
            who = "no majority: every rank differs"
        elif any(c.odd_ranks is not None for c in diffs):
            who = f"replicas of one shard differ, odd {format_ranks(odd).replace(' ', ': ', 1)}"
            if any(c.tie for c in diffs):
                who += " (a tie: each shard's lowest rank taken as the reference)"
        elif any(c.tie for c in diffs):
            who += f" (a tie: rank {self.ranks[0]}'s group taken as the reference)"
        verb = "differs" if len(diffs) == 1 else "differ"
        if total == 1 and diffs[0].path == "":
            return f"check {self.name}: {verb} between ranks — {who}"
        return f"check {self.name}: {len(diffs)} of {self._noun(total)} {verb} — {who}"

    def text(self) -> str:
        lines = [self.header()]
        diffs = [c for c in self.checks if c.status == "differs"]
        if diffs:
            lines.extend(_table(diffs[:_MAX_SHOWN], self.name))
            if len(diffs) > _MAX_SHOWN:
                lines.append(f"  … and {len(diffs) - _MAX_SHOWN} more differing entries (report.differing lists them all)")
        shards = self.sharded
        if shards and not self.identical:
            lines.append(f"  sharded (layout compared, and each shard across its replicas where any): {', '.join(shards[:5])}"
                         f"{' …' if len(shards) > 5 else ''}")
        lines.extend(f"  {n}" for n in self.layout_notes[:_MAX_NOTES])
        lines.extend(f"  ⚠ {n}" for n in self.notes[:_MAX_NOTES])
        if len(self.notes) > _MAX_NOTES:
            lines.append(f"  ⚠ … and {len(self.notes) - _MAX_NOTES} more entries with NaN/Inf")
        return "\n".join(lines)

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per (entry, group of ranks holding the same thing), every entry included."""
        rows = []
        for c in self.checks:
            for ranks, _ in group_by((r, _row_key(leaf)) for r, leaf in sorted(c.leaves.items())):
                leaf = c.leaves[ranks[0]] or {}
                row: dict[str, Any] = {"entry": c.path or self.name, "ranks": ranks, "status": c.status}
                row.update({k: leaf.get(k) for k in ("shape", "dtype", "sum", "norm", "nan", "inf", "fingerprint", "placement")})
                if leaf.get("kind") != "tensor":
                    row["value"] = leaf.get("repr") or leaf.get("error") or ("missing" if not leaf else None)
                rows.append(row)
        return rows

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, list) and len(x) == 2 and all(isinstance(v, float) for v in x):  # complex sum
        return f"{x[0]:.4g}{x[1]:+.4g}j"
    return str(x)


def _cells(leaf: dict[str, Any] | None) -> list[str]:
    """shape, dtype, sum, norm, nan/inf, fingerprint — or one cell saying what is there instead."""
    if leaf is None:
        return ["missing on these ranks"]
    if leaf.get("kind") != "tensor":
        return [f"{leaf.get('kind')}: {leaf.get('repr') or leaf.get('error')}"]
    bad = ", ".join(f"{leaf[k]} {label}" for k, label in (("nan", "NaN"), ("inf", "Inf")) if leaf.get(k)) or "-"
    shape = str(list(leaf.get("shape") or []))
    if leaf.get("placement"):
        shape += f" {leaf['placement']}"
    fp = leaf.get("fingerprint")
    last = f"unreadable: {leaf['error']}" if leaf.get("error") else (fp[:_FP_PREFIX] if fp else "-")
    return [shape, str(leaf.get("dtype")), _fmt(leaf.get("sum")), _fmt(leaf.get("norm")), bad, last]


def _table(diffs: list[EntryCheck], name: str) -> list[str]:
    rows = [["entry", "ranks", "shape", "dtype", "sum", "norm", "nan/inf", "fingerprint"]]
    for c in diffs:
        for i, (ranks, leaf) in enumerate(c.groups):
            rows.append([(c.path or name) if i == 0 else "", format_ranks(ranks), *_cells(leaf)])
    # A row's last cell is never padded, so a one-cell "missing"/value row does not widen columns.
    widths = [max((len(r[i]) for r in rows if i < len(r) - 1), default=0) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c if i == len(r) - 1 else c.ljust(widths[i]) for i, c in enumerate(r)) for r in rows]


def _nan_notes(path: str, leaves: dict[int, dict[str, Any] | None]) -> list[str]:
    counts = []
    for r, leaf in leaves.items():
        if leaf and leaf.get("kind") == "tensor" and (leaf.get("nan") or leaf.get("inf")):
            counts.append((r, (leaf.get("nan") or 0, leaf.get("inf") or 0)))
    notes = []
    for ranks, (nan, inf) in group_by(counts):
        what = " and ".join(p for p in (f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else "") if p)
        notes.append(f"{format_ranks(ranks)}: {what} in {path}")
    return notes


def compare(name: str, per_rank: dict[int, dict[str, Any]]) -> CheckReport:
    """Compare one name's checksums (``{rank: checksum(obj)}``) across ranks."""
    flat = {r: entries(s) for r, s in sorted(per_rank.items())}
    paths: list[str] = []
    seen: set[str] = set()
    for e in flat.values():  # first rank's order (state_dict order), then anything only others have
        for p in e:
            if p not in seen:
                seen.add(p)
                paths.append(p)
    report = CheckReport(name, dict(sorted(per_rank.items())))
    for path in paths:
        leaves = {r: e.get(path) for r, e in flat.items()}
        groups = group_by((r, _key(leaf)) for r, leaf in leaves.items())
        # Majority first; a tie goes to the group holding the lowest rank (group_by keeps first-seen order).
        groups.sort(key=lambda g: (-len(g[0]), min(g[0])))
        tie = len(groups) > 1 and len(groups[0][0]) == len(groups[1][0])
        placed = [_layout(leaf) for leaf in leaves.values() if leaf and leaf.get("kind") == "tensor"]
        replicas = _replica_groups(leaves) if len(groups) == 1 and placed and placed[0] else None
        if replicas is not None and len({piece for _, (piece, _) in replicas}) < len(replicas):
            # Replicas of one shard disagree: within each piece, the majority is the reference.
            majorities, minorities = [], []
            for piece in dict.fromkeys(piece for _, (piece, _) in replicas):
                mine = sorted(([rs for rs, (p, _) in replicas if p == piece]), key=lambda rs: (-len(rs), min(rs)))
                majorities.append(mine[0])
                minorities.extend(mine[1:])
                tie = tie or (len(mine) > 1 and len(mine[0]) == len(mine[1]))
            groups = [(rs, None) for rs in majorities + minorities]
            odd = sorted(r for rs in minorities for r in rs)
        else:
            odd = None
        if len(groups) > 1:
            status = "differs"
        elif placed and placed[0]:
            status = placed[0]
        else:
            status = "identical"
        report.checks.append(EntryCheck(path, status, [(ranks, leaves[ranks[0]]) for ranks, _ in groups], leaves,
                                        tie and status == "differs", odd))
        report.notes.extend(_nan_notes(path or name, leaves))
        if status in ("partial", "sharded"):
            report.layout_notes.extend(_layout_notes(path or name, status, leaves))
    return report


def _layout_notes(path: str, status: str, leaves: dict[int, dict[str, Any] | None]) -> list[str]:
    """A DTensor left ``Partial`` (values not reduced yet), and uneven shards named as what they
    are: torch gives the last shards fewer rows when a dimension does not divide."""
    sample = next((leaf for leaf in leaves.values() if leaf), None)
    if sample is None:
        return []
    if status == "partial":
        return [f"⚠ {path} is {sample.get('placement')}: each rank holds an unreduced part, so its local values are not the "
                "tensor's; .full_tensor() or .redistribute(mesh, [Replicate()]) reduces it"]
    local = group_by((r, tuple(leaf.get("local_shape") or ())) for r, leaf in sorted(leaves.items()) if leaf)
    if len(local) < 2:
        return []
    shapes = "; ".join(f"{list(shape)} on {format_ranks(rs)}" for rs, shape in local)
    return [f"· {path} is {sample.get('placement')} of {sample.get('shape')}, sharded unevenly: local shards {shapes} — the "
            "dimension does not divide by the mesh, so torch gives the last shards fewer rows (expected, not a mismatch)"]
