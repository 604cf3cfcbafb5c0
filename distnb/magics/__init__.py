"""IPython magics, thin over the public Python API: ``%load_ext distnb`` calls :func:`load_magics`."""

from __future__ import annotations

from typing import Any

__all__ = ["load_magics", "unload_magics"]


def load_magics(ipython: Any) -> None:
    from distnb.display.html import register
    from distnb.magics.attaching import AttachMagics
    from distnb.magics.inspecting import InspectMagics
    from distnb.magics.loading import LoadMagics
    from distnb.magics.numerics import NumericsMagics
    from distnb.magics.running import DistMagics

    ipython.register_magics(DistMagics)
    ipython.register_magics(InspectMagics)
    ipython.register_magics(NumericsMagics)
    ipython.register_magics(AttachMagics)
    ipython.register_magics(LoadMagics)
    register(ipython)
    from distnb.magics.panel import install

    install(ipython)  # JupyterLab's debugger panel reaches the ranks (a no-op outside ipykernel)


def unload_magics(ipython: Any) -> None:
    """``%unload_ext distnb`` / ``%reload_ext distnb``: no pool of this kernel outlives the extension."""
    from distnb.jobs.pools import live_pools
    from distnb.states import PoolState

    for pool in live_pools():
        if pool.state not in (PoolState.STOPPED, PoolState.NEW):
            pool.shutdown()
