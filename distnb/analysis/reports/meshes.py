"""The session's device meshes compared across ranks (``%dist_mesh``): shape, dimension names,
rank layout, each rank's coordinates, the groups of each dimension, collectives per dimension per
rank, and the ranks whose mesh disagrees — as text first, with a picture of the grid.

Input is each rank's own account of its meshes (worker/torch_hooks/meshes.py) and, per rank, its collectives
counted by the role of their group (a mesh dimension's name; analysis/groups.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from distnb.analysis.agreement.evidence import odd_ones
from distnb.ranks import format_ranks, group_by

__all__ = ["MeshReport", "dim_groups", "mesh_dims", "nested", "shape_words"]

#: Above this many ranks, the per-rank table gives way to the majority and its outliers.
ROWS_UP_TO = 8


def shape_words(mesh: dict[str, Any]) -> str:
    """``(dp=2, tp=2) on cpu``."""
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(mesh["names"], mesh["shape"])) + f") on {mesh['device']}"


def nested(shape: list[int], layout: list[int]) -> Any:
    """The flat rank layout in the mesh's shape: ``[[0, 1], [2, 3]]``."""
    if len(shape) <= 1:
        return list(layout)
    step = math.prod(shape[1:])
    return [nested(shape[1:], layout[i * step:(i + 1) * step]) for i in range(shape[0])]


def dim_groups(shape: list[int], layout: list[int], dim: int) -> list[list[int]]:
    """The rank groups along ``dim`` of a mesh (ranks that differ only in that coordinate)."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    groups: dict[tuple[int, ...], list[int]] = {}
    for flat, rank in enumerate(layout):
        coord = tuple((flat // strides[i]) % shape[i] for i in range(len(shape)))
        key = coord[:dim] + coord[dim + 1:]
        groups.setdefault(key, []).append(rank)
    return [sorted(g) for _, g in sorted(groups.items())]


def mesh_dims(report: MeshReport) -> dict[str, list[list[int]]]:
    """Each named dimension of the ranks' meshes (the majority's) → its rank groups; a name two
    meshes give different groups keeps the first (the larger mesh)."""
    out: dict[str, list[list[int]]] = {}
    for mesh in sorted(report.majority(), key=lambda m: -len(m["layout"])):
        if not mesh.get("named", True):
            continue
        for i, name in enumerate(mesh["names"]):
            out.setdefault(name, dim_groups(mesh["shape"], mesh["layout"], i))
    return out


def _signature(meshes: list[dict[str, Any]]) -> tuple[Any, ...]:
    return tuple((m["device"], tuple(m["shape"]), tuple(m["names"]), tuple(m["layout"])) for m in meshes)


@dataclass
class MeshReport:
    meshes: dict[int, list[dict[str, Any]]]  # rank → its meshes (worker/torch_hooks/meshes.py)
    errors: dict[int, str] = field(default_factory=dict)  # ranks that could not say, and why
    counts: dict[int, dict[str, int]] = field(default_factory=dict)  # rank → mesh dimension → collectives

    def odd(self) -> list[int]:
        """Ranks whose meshes differ from most ranks' (shape, names, device or rank order)."""
        return odd_ones({r: _signature(m) for r, m in self.meshes.items()})

    def majority(self) -> list[dict[str, Any]]:
        odd = set(self.odd())
        rank = next((r for r in sorted(self.meshes) if r not in odd), None)
        return self.meshes[rank] if rank is not None else []

    def _difference(self, rank: int) -> str:
        mine, usual = self.meshes[rank], self.majority()
        if not mine:
            return "built no device mesh"
        if len(mine) != len(usual):
            theirs = {_signature([m]) for m in usual}
            extra = [shape_words(m) for m in mine if _signature([m]) not in theirs]
            missing = [shape_words(m) for m in usual if _signature([m]) not in {_signature([x]) for x in mine}]
            parts = ([f"built {', '.join(extra)}, which the others did not"] if extra else []) + (
                [f"lacks {', '.join(missing)}, which the others built"] if missing else [])
            return "; ".join(parts) or f"built {len(mine)} meshes where the others built {len(usual)}"
        for a, b in zip(mine, usual):
            if (a["shape"], a["names"]) != (b["shape"], b["names"]):
                return f"built {shape_words(a)} where the others built {shape_words(b)}"
            if a["device"] != b["device"]:
                return f"built its {shape_words(a)} mesh on {a['device']} where the others used {b['device']}"
            if a["layout"] != b["layout"]:
                return (f"laid out the ranks of {shape_words(a)} as {nested(a['shape'], a['layout'])} where the others used "
                        f"{nested(b['shape'], b['layout'])}")
        return "built other meshes"

    def text(self) -> str:
        if not self.meshes and not self.errors:
            return "no rank answered."
        lines: list[str] = []
        usual = self.majority()
        if not any(self.meshes.values()):
            lines.append(f"no device mesh on {format_ranks(self.meshes)} (init_device_mesh builds one).")
        for i, mesh in enumerate(usual, 1):
            holders = [r for r, ms in self.meshes.items() if _signature(ms) == _signature(usual)]
            lines.append(f"mesh {i}: {shape_words(mesh)}, ranks laid out {nested(mesh['shape'], mesh['layout'])} — as {format_ranks(holders)} built it")
            dims = []
            for d, name in enumerate(mesh["names"]):
                groups = dim_groups(mesh["shape"], mesh["layout"], d)
                shown = " ".join("(" + ",".join(map(str, g)) + ")" for g in groups[:6]) + (f" … {len(groups)} groups" if len(groups) > 6 else "")
                dims.append(f"{name}: {shown}")
            lines.append("  groups per dimension — " + " · ".join(dims))
            lines.extend(self._ranks_text(mesh, holders))
        for rank in self.odd():
            lines.append(f"  ✗ rank {rank} {self._difference(rank)}")
        for rank, why in sorted(self.errors.items()):
            lines.append(f"  rank {rank}: {why}")
        return "\n".join(lines)

    def _ranks_text(self, mesh: dict[str, Any], holders: list[int]) -> list[str]:
        names = mesh["names"]
        if len(holders) > ROWS_UP_TO:
            out = []
            for name in names:
                per = group_by((r, self.counts.get(r, {}).get(name, 0)) for r in holders)
                out.append(f"  collectives over {name}: " + ", ".join(f"{format_ranks(rs)} {n}" for rs, n in per))
            return out
        width = max(9, *(len(n) + 2 for n in names))
        out = ["  rank  coords    " + "".join(f"{n + ' group':<{width + 8}}" for n in names) + "collectives " + " · ".join(names)]
        for r in holders:
            own = next((m for m in self.meshes[r] if m["names"] == names and m["shape"] == mesh["shape"]), None)
            if own is None:
                continue
            coord = "(" + ",".join(map(str, own["coord"])) + ")" if own["coord"] is not None else "—"
            groups = "".join(f"{'ranks ' + ','.join(map(str, own['groups'].get(n, {}).get('ranks', []))):<{width + 8}}" for n in names)
            counts = " · ".join(str(self.counts.get(r, {}).get(n, 0)) for n in names)
            out.append(f"  {r:>4}  {coord:<8}  {groups}{counts}")
        return out

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())

    def plot(self) -> Any:
        """The first mesh's grid (two dimensions; more are folded into rows), odd ranks in red."""
        from matplotlib.figure import Figure

        usual = self.majority()
        if not usual:
            return None
        mesh = usual[0]
        shape = mesh["shape"]
        cols = shape[-1]
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        odd = set(self.odd())
        fig = Figure(figsize=(min(max(3.6, 1.2 + 0.7 * cols), 10), min(max(2.6, 1.2 + 0.6 * rows), 8)), layout="constrained")
        ax = fig.add_subplot()
        for flat, rank in enumerate(mesh["layout"]):
            y, x = divmod(flat, cols)
            ax.add_patch(_square(x, y, "#e8a0a0" if rank in odd else "#cfe3f5"))
            ax.text(x + 0.5, y + 0.5, str(rank), ha="center", va="center", fontsize=9)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_xticks([c + 0.5 for c in range(cols)], [str(c) for c in range(cols)])
        ax.set_yticks([r + 0.5 for r in range(rows)], [str(r) for r in range(rows)])
        ax.set_xlabel(mesh["names"][-1])
        ax.set_ylabel(" × ".join(mesh["names"][:-1]) or "")
        ax.set_title(f"mesh {shape_words(mesh)}" + (f"\nodd: {format_ranks(sorted(odd))} (red)" if odd else ""), fontsize=9)
        ax.set_aspect("equal")
        return fig


def _square(x: float, y: float, color: str) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1, 1, facecolor=color, edgecolor="white", linewidth=2)
