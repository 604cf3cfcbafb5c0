"""Ranks chosen by device-mesh coordinates in the debugger console: ``attach dp=0``, ``ranks
tp=1: p x``, ``dp=0,tp=1``, ``dp=0-1`` — resolved against the pool's meshes (``Pool.meshes()``,
each rank's own account of its meshes: worker/torch_hooks/meshes.py), with errors that name the dimensions
there are when none match."""

from __future__ import annotations

import math

from distnb.analysis.reports.meshes import MeshReport, shape_words
from distnb.ranks import parse_ranks

__all__ = ["mesh_ranks"]


def _wanted(spec: str) -> dict[str, str]:
    wanted: dict[str, str] = {}
    for part in spec.split(","):
        dim, eq, value = part.partition("=")
        if not eq or not dim.strip() or not value.strip():
            raise ValueError(f"can't read {spec!r} as mesh coordinates: write dimension=coordinate, e.g. dp=0, tp=1 or dp=0,tp=1.")
        wanted[dim.strip()] = value.strip()
    return wanted


def mesh_ranks(spec: str, report: MeshReport, world_size: int) -> list[int]:
    """The ranks whose coordinates match ``spec`` in the mesh that has every dimension it names;
    ValueError (naming the meshes' dimensions) when none has them, none sits there, or two meshes
    that have them disagree."""
    wanted = _wanted(spec)
    meshes = report.majority()
    if not meshes:
        said = f" ({'; '.join(f'rank {r}: {e}' for r, e in sorted(report.errors.items())[:2])})" if report.errors else ""
        raise ValueError(f"{spec} names mesh coordinates, but the ranks hold no device mesh{said}: init_device_mesh builds one; "
                         "choose ranks by number instead (attach 1,3).")
    fits = [m for m in meshes if set(wanted) <= set(m["names"])]
    if not fits:
        dims = sorted({n for m in meshes for n in m["names"]})
        raise ValueError(f"no mesh has {'dimension' if len(wanted) == 1 else 'dimensions'} {', '.join(wanted)}: the "
                         f"{'mesh is' if len(meshes) == 1 else 'meshes are'} {'; '.join(shape_words(m) for m in meshes)} "
                         f"(dimensions {', '.join(dims)}).")
    found: dict[tuple[int, ...], str] = {}
    for mesh in fits:
        shape, names = mesh["shape"], mesh["names"]
        picks = {}
        for dim, value in wanted.items():
            i = names.index(dim)
            try:
                picks[i] = set(parse_ranks(value, shape[i]))
            except ValueError:
                raise ValueError(f"{dim}={value}: {dim} has coordinates 0-{shape[i] - 1} in mesh {shape_words(mesh)}.") from None
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        ranks = tuple(sorted(rank for flat, rank in enumerate(mesh["layout"])
                             if all((flat // strides[i]) % shape[i] in allowed for i, allowed in picks.items()) and rank < world_size))
        found.setdefault(ranks, shape_words(mesh))
    if len(found) > 1:
        raise ValueError(f"{spec} means different ranks in different meshes: "
                         + "; ".join(f"ranks {','.join(map(str, rs))} in {words}" for rs, words in found.items())
                         + ". Choose ranks by number instead.")
    chosen = list(next(iter(found)))
    if not chosen:
        raise ValueError(f"no rank sits at {spec}.")
    return chosen
