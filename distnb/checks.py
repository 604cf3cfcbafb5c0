"""Compare checksums across ranks: identical, or which entries differ and which ranks are odd."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distnb.ranks import format_ranks
from distnb.results import group_by

__all__ = ["CheckReport", "compare", "entries"]


def entries(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A rank's checksum as ``{entry path: leaf summary}`` ("" for a bare tensor or value)."""
    kind = summary.get("kind")
    if kind == "module":
        return {f"{part}.{name}": s for part in ("params", "grads", "buffers") for name, s in summary.get(part, {}).items()}
    if kind in ("mapping", "sequence"):
        return dict(summary.get("items", {}))
    return {"": summary}


def _key(leaf: dict[str, Any] | None) -> Any:
    if leaf is None:
        return ("missing",)
    if leaf.get("kind") != "tensor":
        return ("value", leaf.get("repr"))
    if leaf.get("placement") and "Shard" in leaf["placement"]:
        # Shards differ by design; their layout must still agree.
        return ("shard", leaf.get("placement"), tuple(leaf.get("global_shape") or ()), leaf.get("dtype"))
    return ("tensor", tuple(leaf["shape"]), leaf["dtype"], leaf["fingerprint"])


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)


def _describe(leaf: dict[str, Any] | None) -> str:
    if leaf is None:
        return "missing"
    if leaf.get("kind") != "tensor":
        return f"value {leaf.get('repr')}"
    bad = (f" nan {leaf['nan']}" if leaf.get("nan") else "") + (f" inf {leaf['inf']}" if leaf.get("inf") else "")
    return (f"{list(leaf['shape'])} {leaf['dtype']} sum {_fmt(leaf.get('sum'))} norm {_fmt(leaf.get('norm'))}"
            f" min {_fmt(leaf.get('min'))} max {_fmt(leaf.get('max'))}{bad} fp {leaf['fingerprint'][:8]}")


@dataclass
class EntryDiff:
    path: str
    groups: list[tuple[list[int], dict[str, Any] | None]]  # ranks sharing one value, majority first
    sharded: bool = False

    @property
    def odd(self) -> list[int]:
        return sorted(r for ranks, _ in self.groups[1:] for r in ranks)


@dataclass
class CheckReport:
    """The comparison of one name across ranks."""

    name: str
    per_rank: dict[int, dict[str, Any]]
    diffs: list[EntryDiff] = field(default_factory=list)
    total: int = 0
    sharded: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.diffs

    @property
    def differing(self) -> list[str]:
        return [d.path for d in self.diffs]

    @property
    def odd_ranks(self) -> list[int]:
        return sorted({r for d in self.diffs for r in d.odd})

    def text(self) -> str:
        ranks = format_ranks(self.per_rank)
        what = f"{self.total} {'entry' if self.total == 1 else 'entries'}"
        if self.identical:
            lines = [f"check {self.name}: identical on {ranks} ({what})"]
        else:
            odd = self.odd_ranks
            lines = [f"check {self.name}: {len(self.diffs)} of {what} differ — odd {'rank' if len(odd) == 1 else 'ranks'}: {format_ranks(odd).split(' ', 1)[1]}"]
            for d in self.diffs:
                lines.append(f"  {d.path or self.name}:")
                lines.extend(f"    {format_ranks(rs)}: {_describe(leaf)}" for rs, leaf in d.groups)
        if self.sharded:
            lines.append(f"  sharded (compared as shards): {', '.join(self.sharded[:5])}{' …' if len(self.sharded) > 5 else ''}")
        lines.extend(f"  ⚠ {w}" for w in self.warnings)
        return "\n".join(lines)

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per (entry, rank group), for tables."""
        rows = []
        for d in self.diffs:
            for rs, leaf in d.groups:
                leaf = leaf or {}
                rows.append({"entry": d.path or self.name, "ranks": rs, **{k: leaf.get(k) for k in ("shape", "dtype", "sum", "norm", "nan", "inf", "fingerprint")}})
        return rows

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def compare(name: str, per_rank: dict[int, dict[str, Any]]) -> CheckReport:
    flat = {r: entries(s) for r, s in sorted(per_rank.items())}
    paths = sorted({p for e in flat.values() for p in e})
    report = CheckReport(name, per_rank, total=len(paths))
    for path in paths:
        leaves = {r: e.get(path) for r, e in flat.items()}
        keyed = group_by((r, _key(leaf)) for r, leaf in leaves.items())
        if any(k[0] == "shard" for _, k in keyed) and len(keyed) == 1:
            report.sharded.append(path or name)
        if len(keyed) > 1:
            # Majority first; a tie goes to the group holding the lowest rank.
            keyed.sort(key=lambda g: (-len(g[0]), min(g[0])))
            report.diffs.append(EntryDiff(path, [(rs, leaves[rs[0]]) for rs, _ in keyed]))
        for r, leaf in leaves.items():
            if leaf and leaf.get("kind") == "tensor" and (leaf.get("nan") or leaf.get("inf")):
                report.warnings.append(f"rank {r}: {leaf.get('nan', 0)} NaN, {leaf.get('inf', 0)} Inf in {path or name}")
    return report
