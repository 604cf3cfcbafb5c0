"""The rank's device meshes, as data: shape, dimension names, the rank layout, this rank's
coordinates and, per dimension, the group it reduces over.

torch keeps no registry of the meshes a program built (``init_device_mesh`` returns one; slicing
``mesh["tp"]`` makes another that points at its root), so the rank looks for live ``DeviceMesh``
objects among the garbage collector's. That walk costs milliseconds per million objects and runs
only when asked (``%dist_mesh``), on the control thread: it answers while a cell runs.
"""

from __future__ import annotations

import gc
from typing import Any

from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["describe_meshes"]


def _roots() -> list[Any]:
    dm = imported_module("torch.distributed.device_mesh")
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


def _held(namespace: dict[str, Any], cls: type) -> dict[int, Any]:
    """The root meshes the user's namespace holds, by id: a mesh (or a slice of one) bound to a
    name, in a list, tuple or dict bound to one, or under a DTensor, a module's DTensor parameters
    (FSDP2, tensor parallel) or a DTensor bound to a name."""
    out: dict[int, Any] = {}

    def take(obj: Any) -> None:
        if issubclass(type(obj), cls):
            root = getattr(obj, "_root_mesh", None) or obj
            out[id(root)] = root
            return
        mesh = getattr(obj, "device_mesh", None) if type(obj).__name__ in ("DTensor", "Parameter") else None
        if mesh is not None and issubclass(type(mesh), cls):
            take(mesh)

    nn = imported_module("torch.nn")
    module_cls = getattr(nn, "Module", None)
    for value in list(namespace.values()):
        try:
            items = list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, (list, tuple)) else [value]
            for obj in items[:64]:
                take(obj)
                if module_cls is not None and isinstance(obj, module_cls):
                    for param in obj.parameters():
                        take(param)
                        break  # one parameter tells the module's mesh (per-layer meshes are slices of one root)
        except Exception:  # a value that can't be walked (a proxy, a lazy object): not a mesh holder
            continue
    return out


def describe_meshes(namespace: dict[str, Any] | None = None) -> list[dict[str, Any]] | dict[str, str]:
    """The root device meshes of this rank the user's code holds (``namespace``: the cells'; None:
    every live one), oldest layout first; ``{"error": …}`` when they can't be read. torch builds
    meshes of its own (a one-rank mesh per process for DTensor's defaults): those are left out."""
    try:
        dm = imported_module("torch.distributed.device_mesh")
        if namespace is None:
            roots = _roots()
        else:  # what the namespace holds leads to its roots: no walk of every live object (~80 ms)
            roots = list(_held(namespace, dm.DeviceMesh).values()) if dm is not None and hasattr(dm, "DeviceMesh") else []
        meshes = [_one(m) for m in roots]
    except Exception as exc:
        return {"error": f"the rank's meshes could not be read: {type(exc).__name__}: {exc}"}
    # The same mesh seen twice (a cached root and its copy) is one; order by shape and names so
    # every rank lists its meshes in the same order.
    unique = {repr((m["device"], m["shape"], m["names"], m["layout"])): m for m in meshes}
    return sorted(unique.values(), key=lambda m: (len(m["shape"]), m["names"], m["shape"]))
