"""distnb: debug distributed PyTorch from a Jupyter notebook.

``%load_ext distnb`` registers the magics; everything they do is available from Python::

    import distnb
    pool = distnb.launch(nproc=4)
    print(pool.run("x = torch.ones(1); dist.all_reduce(x); x"))
    pool.shutdown()
"""

from __future__ import annotations

from distnb.errors import DistnbError, LaunchError, NoPoolError, PoolBrokenError, PoolBusyError, RemoteError
from distnb.launch import LaunchConfig
from distnb.pool import CellEvents, Pool, PoolState, current_pool, launch
from distnb.results import CellResult, PoolStatus, RankResult, RankState, RankStatus
from distnb.worker.checksum import checksum

__version__ = "0.1.0"

__all__ = [
    "CellEvents",
    "CellResult",
    "DistnbError",
    "LaunchConfig",
    "LaunchError",
    "NoPoolError",
    "Pool",
    "PoolBrokenError",
    "PoolBusyError",
    "PoolState",
    "PoolStatus",
    "RankResult",
    "RankState",
    "RankStatus",
    "RemoteError",
    "checksum",
    "current_pool",
    "launch",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: object) -> None:
    from distnb.magics import load

    load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    from distnb.magics import unload

    unload(ipython)
