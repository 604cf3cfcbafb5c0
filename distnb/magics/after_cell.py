"""What ``%%on_ranks`` shows once its cell has ended, as its flags asked: the values checked across
ranks (``--check``), the profile (``--profile``), the communication per module (``--comms``) and the
numerics record (``--numerics``), each as its text and, where there is one, its plot."""

from __future__ import annotations

from dataclasses import dataclass

from IPython.display import display

from distnb.magics.numerics import show_numerics
from distnb.magics.support import show_checks, show_figure, usage_errors
from distnb.pool import Pool
from distnb.results import CellResult
from distnb.states import PoolState

__all__ = ["AfterCell", "show_after_cell"]


@dataclass(frozen=True)
class AfterCell:
    """The after-cell reports a cell's flags asked for."""

    check: str | None = None  # names to compare across ranks, comma-separated
    profile: bool = False
    comms: bool = False
    numerics: bool = False


def show_after_cell(pool: Pool, result: CellResult, wanted: AfterCell) -> None:
    """The reports ``wanted`` of an ended cell, in the order the flags are documented."""
    if wanted.check and pool.state == PoolState.READY:
        with usage_errors():
            show_checks(pool.check([n.strip() for n in wanted.check.split(",") if n.strip()], ranks=result.ranks))
    if wanted.profile:
        with usage_errors():
            report = pool.profile(result)
        display(report)
        if report.times:
            show_figure(report.plot())
    if wanted.comms:
        with usage_errors():
            comms = result.comms()
        display(comms)
        if comms.rows:
            show_figure(comms.plot())
    if wanted.numerics:
        show_numerics(result)
