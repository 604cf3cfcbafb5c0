"""The objects in a rank's namespace that hold a process group: a DDP or FSDP module, a device
mesh, a group the user made. A regroup closes the groups they hold; the rank remembers which
names held them, so a later cell that fails on a closed group can say which object it likely
used, and what to make again.

Read from the namespace's top-level names only (no walk of containers): cheap, and those are the
names a user would rebuild.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["StaleHolders", "holders"]

def _kinds() -> list[tuple[type, str]]:
    out: list[tuple[type, str]] = []
    for module, name in (("torch.nn.parallel", "DistributedDataParallel"), ("torch.distributed.fsdp", "FullyShardedDataParallel"),
                         ("torch.distributed.fsdp", "FSDPModule"), ("torch.distributed.device_mesh", "DeviceMesh"),
                         ("torch.distributed", "ProcessGroup")):
        cls = getattr(sys.modules.get(module), name, None)  # never import torch from here: only what the cells loaded
        if isinstance(cls, type):
            out.append((cls, name))
    return out


def holders(ns: dict[str, Any]) -> dict[str, str]:
    """Top-level names bound to an object that holds a process group: name → its kind."""
    kinds = _kinds()
    if not kinds:
        return {}
    found = {}
    for name, value in list(ns.items()):
        if name.startswith("_"):
            continue
        try:
            kind = next((k for cls, k in kinds if isinstance(value, cls)), None)
        except Exception:  # a proxy whose isinstance fails: not a holder
            kind = None
        if kind is not None:
            found[name] = kind
    return found


class StaleHolders:
    """What held the groups a regroup closed: a name counts while it is bound to the same object."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[int, str]] = {}

    def remember(self, ns: dict[str, Any]) -> dict[str, str]:
        """Before a regroup: the holders of the groups it is about to close."""
        found = holders(ns)
        self._held = {name: (id(ns[name]), kind) for name, kind in found.items()}
        return found

    def still_held(self, ns: dict[str, Any]) -> dict[str, str]:
        """The names still bound to an object that holds a closed group: name → kind."""
        return {name: kind for name, (oid, kind) in self._held.items() if name in ns and id(ns[name]) == oid}
