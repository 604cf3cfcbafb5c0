"""The Pool's read-only views: stacks, diagnoses, the live watch, collectives, compiles, memory,
environment, meshes, checks and profiles — each asked of the parts the Pool composes (its
:class:`~distnb.services.inspector.Inspector` above all), none changing the pool."""

from __future__ import annotations

from typing import Iterable

from distnb.analysis.agreement.collectives import CollectiveReport
from distnb.analysis.reports.check_within import WithinReport
from distnb.analysis.reports.checks import CheckReport
from distnb.analysis.reports.compiles import CompileReport
from distnb.analysis.reports.env import EnvReport
from distnb.analysis.reports.memory import MemoryReport
from distnb.analysis.reports.meshes import MeshReport, mesh_dims
from distnb.analysis.reports.profile import ProfileReport
from distnb.analysis.verdicts.stacks import StackReport
from distnb.analysis.verdicts.stragglers import StragglerReport
from distnb.analysis.verdicts.verdict import Verdict
from distnb.config import LaunchConfig
from distnb.controller.internal_errors import InternalErrors
from distnb.controller.tracker import Tracker
from distnb.ranks import Ranks, parse_ranks
from distnb.results import CellResult
from distnb.services.inspector import STACKS_TIMEOUT, Inspector
from distnb.services.meshes import mesh_report
from distnb.services.waiting import why_still_running
from distnb.services.watch import CellWatch

__all__ = ["PoolViews"]


class PoolViews:
    """What :class:`~distnb.pool.Pool` shows without changing anything (its base)."""

    _config: LaunchConfig
    _tracker: Tracker
    _inspector: Inspector
    _internal: InternalErrors

    @property
    def world_size(self) -> int:
        return self._config.world_size

    def explain_timeout(self, result: CellResult) -> None:
        """After a wait that ended at its timeout: why the ranks still run, as ``result.verdict``
        and a note in its text (``%%on_ranks --timeout`` calls it)."""
        why_still_running(result, lambda res: self.diagnose(res, hang_after=0.0), self._internal)

    def profile(self, result: CellResult, trace_path: str | None = None) -> ProfileReport:
        """Per rank, where a cell run with ``profile=True`` spent its time (compute, collectives,
        waiting for peers), its top ops with the ranks that differ, and one merged Chrome trace
        (a process row per rank, clocks aligned) written to ``trace_path`` (default:
        ``distnb-traces/cell-N.json`` under the current folder)."""
        return self._inspector.profile(result, trace_path)

    def stacks(self, ranks: Ranks = None, all_threads: bool = False, native: bool = False, timeout: float = STACKS_TIMEOUT) -> StackReport:
        return self._inspector.stacks(ranks, all_threads, native, timeout)

    def diagnose(self, result: CellResult | None = None, hang_after: float | None = None) -> Verdict:
        return self._inspector.diagnose(result, hang_after)

    def watch(self, result: CellResult, hang_after: float | None = None) -> CellWatch:
        """A running cell's live hang watch (``%%on_ranks`` calls ``.look()`` once a second)."""
        return CellWatch(self._tracker, self._inspector, result, self._config.hang_after if hang_after is None else hang_after)

    def stragglers(self, ranks: Ranks = None, group: str = "0", last: int = 200) -> StragglerReport:
        """Who arrives last at the recent collectives of ``group`` (from the Flight Recorder's
        entries, clocks aligned): the straggler with figures, a text table and ``.plot()``."""
        return self._inspector.stragglers(ranks, group, last)

    def collectives(self, ranks: Ranks = None, last: int | None = None, refresh: bool = True) -> CollectiveReport:
        return self._inspector.collectives(ranks, last, refresh)

    def compiles(self, ranks: Ranks = None) -> CompileReport:
        return self._inspector.compiles(ranks)

    def memory(self, ranks: Ranks = None) -> MemoryReport:
        return self._inspector.memory(ranks)

    def env(self, ranks: Ranks = None) -> EnvReport:
        return self._inspector.env(ranks)

    def meshes(self, ranks: Ranks = None) -> MeshReport:
        """The ranks' device meshes compared: shape, names, coordinates, groups, the odd ranks."""
        self._inspector.require_pool()
        return mesh_report(self._tracker.requests, self._tracker.collective_log, self._tracker.alive(parse_ranks(ranks, self.world_size)))

    def check(self, names: str | Iterable[str], ranks: Ranks = None, within: str | None = None) -> list[CheckReport | WithinReport]:
        """Compare names (tensors, modules, state dicts, optimizers) across ranks by fingerprint.
        ``within``: a mesh dimension (``"tp"``) — compare inside each of its groups, where the
        values must agree (tensor-parallel peers see one batch), not across the whole world."""
        return self._inspector.check(names, ranks, lambda: mesh_dims(self.meshes(ranks)), within)


for _name in ("stacks", "diagnose", "collectives", "compiles", "memory", "env", "check"):
    getattr(PoolViews, _name).__doc__ = getattr(Inspector, _name).__doc__
