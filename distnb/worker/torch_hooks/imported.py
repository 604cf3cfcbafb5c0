"""A module as this process has already imported it; never an import of its own.

A rank's own threads (the control thread, the job-records watch, timers) read torch while the
main thread may be importing it. An import from such a thread takes the module's import lock and
may run the module itself: the control thread, asked for collectives while a fresh rank's main
thread was importing torch, ran ``from torch._C import _distributed_c10d``, initialised
``torch._C`` there, and the main thread's ``import torch`` raised ``_DeadlockError: deadlock
detected by _ModuleLock('torch._C')`` — the rank failed to start (CI, torch 2.15). A module still
being imported counts as absent too: the names read from it may not exist yet, and a reader that
took their absence for "this torch has no such name" would stop looking for good.
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["imported_module"]


def imported_module(name: str) -> ModuleType | None:
    """``sys.modules[name]`` once it and each package above it have finished importing; else None."""
    module = None
    dot = 0
    while dot != -1:
        dot = name.find(".", dot + 1)
        module = sys.modules.get(name if dot == -1 else name[:dot])
        # importlib sets the spec's _initializing while the module's code runs (3.11–3.14).
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            return None
    return module
