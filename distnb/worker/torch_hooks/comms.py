"""``%%on_ranks --comms``: run a cell under PyTorch's own communication accounting and bring back,
per module, every collective with its mesh dimension and bytes, and every DTensor redistribute with
its source and target placements.

PyTorch's ``CommDebugMode`` (torch/distributed/tensor/debug/_comm_mode.py) is a dispatch mode
with a module tracker: it counts each collective op under the module that ran it, forward and
backward apart, whether the call came from DTensor, FSDP2, DDP's Python side or the user. It keeps
counts only; distnb subclasses it to note, for the same calls, the process group (its mesh
dimension, from torch's ``mesh_<dim>`` description) and the bytes moved. Redistributes are seen
where DTensor performs them, ``redistribute_local_tensor``, wrapped for the cell's duration in
the modules that bound it by name.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from distnb.wire.record_types import CellOutcome

__all__ = ["OUTPUT_FIRST", "process_group_of", "run_with_comms"]

#: Modules that import ``redistribute_local_tensor`` by name (each must be wrapped).
_REDISTRIBUTE_USERS = ("torch.distributed.tensor._redistribute", "torch.distributed.tensor._dispatch", "torch.distributed.tensor._api")
_KEEP = 20000  # records per cell: a long training loop under --comms is summarised, not stored whole


def process_group_of(args: Any) -> Any:
    """The process group among a collective op's arguments (None when none is found)."""
    import torch
    from torch.distributed import distributed_c10d as c10d
    from torch.utils._pytree import tree_flatten

    for a in tree_flatten(args)[0]:
        pg = None
        if isinstance(a, str):
            try:
                pg = c10d._resolve_process_group(a)  # type: ignore[arg-type]  # a GroupName is a str
            except Exception:
                continue
        elif isinstance(a, torch.ScriptObject):
            # c10d ops carry the group boxed; ProcessGroup.unbox gives it back (other boxed
            # arguments, e.g. a ReduceOp, are not groups).
            try:
                if "ProcessGroup" in str(a._type()):
                    pg = torch.distributed.ProcessGroup.unbox(a)
            except Exception:
                continue
        elif hasattr(a, "group_name") and not hasattr(a, "shape"):
            pg = a
        if pg is not None:
            return pg
    return None


def _group_of(args: Any) -> tuple[str | None, str | None]:
    """(group name, torch's description) of the process group among a collective op's arguments."""
    pg = process_group_of(args)
    if pg is None:
        return None, None
    try:
        return str(pg.group_name), str(getattr(pg, "group_desc", "") or "")
    except Exception:
        return None, None


#: c10d ops whose first argument is the output: the input (what the rank sends) comes second.
OUTPUT_FIRST = {"_allgather_base", "_reduce_scatter_base", "allgather", "reduce_scatter", "allgather_into_tensor_coalesced",
                 "reduce_scatter_tensor_coalesced", "alltoall_base", "alltoall", "gather"}


#: c10d op names as the user knows the functions (funcol's already read so).
_NAMES = {"allreduce": "all_reduce", "_allgather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
          "allgather": "all_gather", "alltoall_base": "all_to_all_single", "alltoall": "all_to_all",
          "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced", "allreduce_coalesced": "all_reduce_coalesced"}


def _module(tracker: Any) -> str:
    """The module running now. The tracker's ``name`` keeps the last module after it returns, so
    a call made then — in the module's output hook (tensor parallel's Partial → Replicate), or at
    the top level after ``loss.backward()`` — reads ``after <module>``, not as inside it."""
    name = str(tracker.name)
    parents = getattr(tracker, "parents", None)
    return name if parents is None or name in parents or name == "Global" else f"after {name}"


def _nbytes(op: str, args: Any) -> int:
    """Bytes of the input tensor (or list of tensors): what the rank sends in."""
    import torch

    first = (args[1] if len(args) > 1 else None) if op in OUTPUT_FIRST else (args[0] if args else None)
    tensors = first if isinstance(first, (list, tuple)) else [first]
    return sum(int(t.numel() * t.element_size()) for t in tensors if isinstance(t, torch.Tensor))


def _placements(spec: Any) -> str:
    return ", ".join(str(p) for p in getattr(spec, "placements", ()))


def _mode_class() -> Any:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug import _comm_mode as cm

    class Accounting(CommDebugMode):
        """CommDebugMode, noting group and bytes for each collective it counts."""

        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict[str, Any]] = []
            self.dropped = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and packet is not None and (packet in self.comm_registry or packet in cm.c10d_collective_ops):
                if len(self.records) < _KEEP:
                    group, desc = _group_of(args)
                    op = str(getattr(packet, "__name__", packet)).rstrip("_")
                    self.records.append({"module": _module(self.advanced_module_tracker), "bw": bool(self.advanced_module_tracker.is_bw),
                                         "op": _NAMES.get(op, op), "group": group, "desc": desc, "bytes": _nbytes(op, args)})
                else:
                    self.dropped += 1
            return out

    return Accounting


def run_with_comms(run: Callable[[], CellOutcome]) -> CellOutcome:
    """``run()`` (the cell) under the accounting; its reply gains ``comms``."""
    try:
        mode = _mode_class()()
    except Exception as exc:  # a torch without DTensor's debug tools: the cell still runs
        reply = run()
        reply["comms"] = {"error": f"this torch has no CommDebugMode ({type(exc).__name__}: {exc})"}
        return reply
    redistributes: list[dict[str, Any]] = []
    originals = _wrap_redistribute(mode, redistributes)
    try:
        with mode:
            reply = run()
    finally:
        for mod, fn in originals:
            mod.redistribute_local_tensor = fn
    # The records carry what CommDebugMode's own per-module counts hold, and the group and bytes
    # besides: only they travel.
    reply["comms"] = {"records": mode.records, "dropped": mode.dropped, "redistributes": redistributes}  # capped as they came
    return reply


def _wrap_redistribute(mode: Any, into: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    originals = []
    for name in _REDISTRIBUTE_USERS:
        mod: Any = sys.modules.get(name)
        fn = getattr(mod, "redistribute_local_tensor", None)
        if mod is None or fn is None:
            continue

        def wrapped(local: Any, current: Any, target: Any, *args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            if len(into) < _KEEP:
                mesh = getattr(current, "mesh", None)
                into.append({"module": _module(mode.advanced_module_tracker), "bw": bool(mode.advanced_module_tracker.is_bw),
                             "src": _placements(current), "dst": _placements(target),
                             "shape": list(getattr(current, "shape", ()) or ()),
                             "dims": list(getattr(mesh, "mesh_dim_names", None) or ()), "explicit": bool(kwargs.get("is_explicit"))})
            return _fn(local, current, target, *args, **kwargs)

        mod.redistribute_local_tensor = wrapped
        originals.append((mod, fn))
    return originals
