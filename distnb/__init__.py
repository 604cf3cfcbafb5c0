"""distnb: debug distributed PyTorch from a Jupyter notebook.

``%load_ext distnb`` registers the magics; everything they do is available from Python::

    import distnb
    pool = distnb.launch(nproc=4)
    print(pool.run("x = torch.ones(1); dist.all_reduce(x); x"))
    pool.shutdown()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from distnb import config as _config

__version__ = _config.VERSION

# The public names load on first use: a rank and its supervisor import ``distnb.worker…``, which
# runs this file first, and must not pay for the controller (pool, launch, IPython glue: ~130 ms
# of every launch) that they never use.
_PUBLIC = {
    "CellFailed": "distnb.errors", "DistnbError": "distnb.errors", "LaunchError": "distnb.errors", "NoAnswerError": "distnb.errors",
    "NoCellError": "distnb.errors", "NoPoolError": "distnb.errors", "PoolBrokenError": "distnb.errors",
    "PoolBusyError": "distnb.errors", "RemoteError": "distnb.errors", "ShutdownError": "distnb.errors",
    "LaunchConfig": "distnb.config",
    "CellEvents": "distnb.results", "Pool": "distnb.pool", "PoolState": "distnb.states", "current_pool": "distnb.jobs.pools", "live_pools": "distnb.jobs.pools",
    "launch": "distnb.pool",
    "attach": "distnb.jobs.attached", "detach": "distnb.jobs.attached", "AttachedJob": "distnb.jobs.attached", "AttachError": "distnb.errors",
    "load": "distnb.jobs.loaded", "LoadedJob": "distnb.jobs.loaded", "LoadError": "distnb.errors",
    "CellResult": "distnb.results", "PoolStatus": "distnb.status", "RankResult": "distnb.results",
    "RankState": "distnb.states", "CellStatus": "distnb.states", "RankStatus": "distnb.status",
    "checksum": "distnb.worker.recorders.checksum",
    "Debugger": "distnb.services.debugger", "Prompt": "distnb.controller.prompts",
    "Verdict": "distnb.analysis.verdicts.verdict", "Kind": "distnb.analysis.verdicts.verdict", "Certainty": "distnb.analysis.verdicts.verdict",
    "VerdictState": "distnb.analysis.verdicts.verdict", "Site": "distnb.analysis.verdicts.verdict", "Evidence": "distnb.analysis.verdicts.verdict",
    "RootCause": "distnb.analysis.root_cause",
}

if TYPE_CHECKING:
    from distnb.analysis.root_cause import RootCause
    from distnb.analysis.verdicts.verdict import Certainty, Evidence, Kind, Site, Verdict, VerdictState
    from distnb.config import LaunchConfig
    from distnb.controller.prompts import Prompt
    from distnb.errors import (
        AttachError,
        CellFailed,
        DistnbError,
        LaunchError,
        LoadError,
        NoAnswerError,
        NoCellError,
        NoPoolError,
        PoolBrokenError,
        PoolBusyError,
        RemoteError,
        ShutdownError,
    )
    from distnb.jobs.attached import AttachedJob, attach, detach
    from distnb.jobs.loaded import LoadedJob, load
    from distnb.jobs.pools import current_pool, live_pools
    from distnb.pool import Pool, launch
    from distnb.results import CellEvents, CellResult, RankResult
    from distnb.services.debugger import Debugger
    from distnb.states import CellStatus, PoolState, RankState
    from distnb.status import PoolStatus, RankStatus
    from distnb.worker.recorders.checksum import checksum


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'distnb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))

__all__ = [
    "AttachError",
    "AttachedJob",
    "CellEvents",
    "CellFailed",
    "CellResult",
    "CellStatus",
    "Certainty",
    "Debugger",
    "DistnbError",
    "Evidence",
    "Kind",
    "LaunchConfig",
    "LaunchError",
    "LoadError",
    "LoadedJob",
    "NoAnswerError",
    "NoCellError",
    "NoPoolError",
    "Pool",
    "PoolBrokenError",
    "PoolBusyError",
    "PoolState",
    "PoolStatus",
    "Prompt",
    "RankResult",
    "RankState",
    "RankStatus",
    "RemoteError",
    "RootCause",
    "ShutdownError",
    "Site",
    "Verdict",
    "VerdictState",
    "attach",
    "checksum",
    "current_pool",
    "detach",
    "launch",
    "live_pools",
    "load",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: object) -> None:
    from distnb.magics import load_magics

    load_magics(ipython)


def unload_ipython_extension(ipython: object) -> None:
    from distnb.magics import unload_magics

    unload_magics(ipython)
