"""The rank's device meshes, as data: shape, dimension names, the rank layout, this rank's
coordinates and, per dimension, the group it reduces over.

torch keeps no registry of the meshes a program built (``init_device_mesh`` returns one; slicing
``mesh["tp"]`` makes another that points at its root), so the rank looks for live ``DeviceMesh``
objects among the garbage collector's. That walk costs milliseconds per million objects and runs
only when asked (``%dist_mesh``), on the control thread: it answers while a cell runs.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

__all__ = ["describe_meshes"]


def _roots() -> list[Any]:
    dm = sys.modules.get("torch.distributed.device_mesh")  # never import torch from here
    cls = getattr(dm, "DeviceMesh", None)
    if cls is None:
        return []
    found = []
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): that would read __class__ of every object, and some warn when
            # touched (torch's deprecated reduce_op prints a FutureWarning into the running cell).
            if issubclass(type(obj), cls) and getattr(obj, "_root_mesh", None) in (None, obj):
                found.append(obj)
        except Exception:  # an object whose __class__ lookup fails (proxies): not a mesh
            continue
    return found


def _one(mesh: Any) -> dict[str, Any]:
    import torch.distributed as dist

    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{i}" for i in range(mesh.ndim)]
    out: dict[str, Any] = {
        "device": str(mesh.device_type),
        "shape": list(mesh.mesh.shape),
        "names": names,
        "named": bool(mesh.mesh_dim_names),
        "layout": mesh.mesh.flatten().tolist(),
        "coord": None,
        "groups": {},
    }
    coord = mesh.get_coordinate()
    out["coord"] = list(coord) if coord is not None else None
    if coord is not None:
        for i, name in enumerate(names):
            try:
                pg = mesh.get_group(i)
                out["groups"][name] = {"name": str(pg.group_name), "ranks": sorted(dist.get_process_group_ranks(pg))}
            except Exception as exc:  # a dimension whose group this torch can't give back
                out["groups"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def describe_meshes() -> list[dict[str, Any]] | dict[str, str]:
    """Every root device mesh of this rank, oldest layout first; ``{"error": …}`` when they can't be read."""
    try:
        meshes = [_one(m) for m in _roots()]
    except Exception as exc:
        return {"error": f"the rank's meshes could not be read: {type(exc).__name__}: {exc}"}
    # The same mesh seen twice (a cached root and its copy) is one; order by shape and names so
    # every rank lists its meshes in the same order.
    unique = {repr((m["device"], m["shape"], m["names"], m["layout"])): m for m in meshes}
    return sorted(unique.values(), key=lambda m: (len(m["shape"]), m["names"], m["shape"]))
