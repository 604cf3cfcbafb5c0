"""The Pool: the public face of a persistent torchrun pool.

It composes the parts that do the work and keeps each to its job:

- :class:`~distnb.controller.tracker.Tracker` — pool and rank states, fed by messages (the only place they change);
- :class:`~distnb.controller.session.SessionLog` — cells and pushes, for replay and export;
- :class:`~distnb.services.inspector.Inspector` — stacks, diagnoses, collectives, memory, env, checksums
  (:class:`~distnb.services.watch.CellWatch`, the live hang watch, asks it only when the logs look wrong);
- a :class:`~distnb.transport.base.RankTransport` — the ranks and the wire to them:
  :class:`~distnb.transport.torchrun_ranks.TorchrunRanks` (ZMQ, torchrun, other machines' agents)
  unless another is given (tests replay recorded ranks through it).
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator

from distnb.cell_names import name_cell
from distnb.config import LaunchConfig
from distnb.controller.collective_log import CollectiveLog
from distnb.controller.internal_errors import InternalErrors
from distnb.controller.session import CellRecord, PushRecord, SessionLog
from distnb.controller.tracker import Tracker
from distnb.errors import LaunchError, RemoteError, ShutdownError
from distnb.jobs import pools
from distnb.pool_views import PoolViews
from distnb.ranks import Ranks, format_ranks, parse_ranks
from distnb.results import CellEvents, CellResult, RankResult
from distnb.services.cases.export import Export, export_session
from distnb.services.cases.minimal_case import Minimized
from distnb.services.cases.minimize import Runs, minimize, write_case
from distnb.services.cases.verify import VERIFY_SECONDS
from distnb.services.debugger import Ask, Debugger, read_line
from distnb.services.fail_fast import FailFast
from distnb.services.inspector import Inspector
from distnb.services.rank_debug import RankDebug
from distnb.services.values import errors_of, fetch_value, pack_values, send_values
from distnb.services.waiting import rebuild_after_unblock, wait_for_cell
from distnb.states import PoolState
from distnb.status import PoolStatus, Regrouped
from distnb.transport.base import RankTransport
from distnb.transport.startup import OnNote, OnProgress, request_spares, respawn, wait_ready
from distnb.transport.torchrun_ranks import TorchrunRanks
from distnb.wire.cell_code import CompiledCell, compile_source, exec_request
from distnb.wire.peers import control_identity, exec_identity
from distnb.wire.protocol import Msg

__all__ = ["Pool", "launch"]



class Pool(PoolViews):
    """A persistent pool of ranks under torchrun.

    Options are :class:`~distnb.config.LaunchConfig`'s, given either as a config or one by one
    (``None`` keeps the config's default). ``transport`` is what starts the ranks and carries the
    messages to them (default: torchrun's processes over ZMQ, :class:`~distnb.transport.torchrun_ranks.TorchrunRanks`)::

        pool = distnb.Pool(nproc=4).start()
        pool.run("x = torch.ones(1); dist.all_reduce(x); x")
    """

    def __init__(
        self,
        config: LaunchConfig | None = None,
        *,
        nproc: int | None = None,
        backend: str | None = None,
        env: dict[str, str] | None = None,
        pg_timeout: float | None = None,
        start_timeout: float | None = None,
        hang_after: float | None = None,
        heartbeat_timeout: float | None = None,
        bind: str | None = None,
        debug: tuple[str, ...] | str | None = None,
        nnodes: int | None = None,
        rdzv_endpoint: str | None = None,
        hosts: tuple[str, ...] | None = None,
        slurm: bool | None = None,
        curve: bool | None = None,
        key_file: str | None = None,
        node_python: str | None = None,
        local_nodes: bool | None = None,
        share_gpus: bool | None = None,
        spares: bool | None = None,
        transport: RankTransport | None = None,
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "config", "transport") and v is not None}
        if config is not None and options:
            raise TypeError("pass either a LaunchConfig or keyword options, not both.")
        self._config = config if config is not None else LaunchConfig(**options)
        self._tracker = Tracker(self._config.world_size, CollectiveLog())
        self._session = SessionLog()
        self._inspector = Inspector(self._tracker, self._config, self._session, lambda: self.run_dir)
        self._debugger = Debugger(self._tracker, self._config, self.diagnose, self.meshes)
        self._panel = RankDebug(self._tracker.requests, self._tracker.rank_statuses)
        self._tracker.route_debugger(self._panel.deliver)
        self._transport: RankTransport = transport if transport is not None else TorchrunRanks(self._config)
        self._regroups = 0
        self._respawns = 0
        self._warm: list[str] = []  # what fresh ranks have loaded before they start (warm())
        self._internal = InternalErrors()
        pools.add_pool(self)

    # -- read-only views of the parts -----------------------------------------------------------
    @property
    def config(self) -> LaunchConfig:
        return self._config

    @property
    def run_dir(self) -> str | None:
        """This launch's folder (torchrun's logs, NCCL's timeout dumps); None when not running."""
        return self._transport.run_dir

    @property
    def debugger(self) -> Debugger:
        """Ranks waiting for a line (pdb, ``input()``) and the means to answer them."""
        return self._debugger

    @property
    def panel(self) -> RankDebug:
        """The ranks' debugpy, one target for the notebook's debugger panel (distnb.magics.panel)."""
        return self._panel

    @property
    def state(self) -> PoolState:
        return self._tracker.state

    @property
    def internal_errors(self) -> InternalErrors:
        """Exceptions the notebook side's best-effort parts (the live diagnosis, the diagnosis at a
        timeout) caught and survived: distnb's bugs, said by ``%dist_status``, never in a cell."""
        return self._internal

    @property
    def history(self) -> list[CellResult | CellRecord]:
        """Every cell run, in order; only the last 100 keep their full results."""
        return self._session.history

    @property
    def pushes(self) -> list[PushRecord]:
        """What %dist_push sent, in order, for replay and export."""
        return self._session.pushes

    first_death = property(lambda self: self._tracker.first_death, doc="The rank that died first (the root cause when several did).")

    @property
    def address(self) -> str | None:
        """What other machines connect to (multi-node pools)."""
        return self._transport.multinode.address if self._transport.multinode else None

    key_file = property(lambda self: self._transport.multinode.key_file if self._transport.multinode else None,
                        doc="A multi-node pool's key file.")
    join_command = property(lambda self: self._transport.multinode.join_command if self._transport.multinode else None,
                            doc="What joins a machine to it.")

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, on_progress: OnProgress | None = None, on_note: OnNote | None = None) -> Pool:
        """Launch torchrun and return once every rank's process group is ready.

        ``on_progress`` hears each change of the ranks' stages; ``on_note`` what a multi-node start has to say."""
        if self.state not in (PoolState.NEW, PoolState.STOPPED):
            raise LaunchError(f"this pool is {self.state.value}; call shutdown() or restart() instead of start().")
        config, tracker, transport = self._config, self._tracker, self._transport
        try:
            transport.open(tracker)
            wait_ready(tracker, transport, config, on_progress, on_note)
        except BaseException:
            self._teardown()
            raise
        request_spares(transport, config, tracker, on_note, modules=self._warm)
        self._session.mark_launch()
        pools.set_current(self)
        return self

    def shutdown(self) -> None:
        """Stop every rank: ask nicely, then SIGTERM, then SIGKILL, and verify nothing is left."""
        if not self._tracker.begin_stop():
            return
        leftovers = self._teardown()
        if pools.current_or_none() is self:
            pools.set_current(None)
        if leftovers:
            raise ShutdownError(
                f"processes {leftovers} of the pool survived SIGKILL (stuck in the kernel, e.g. on a "
                "hung GPU); they may need a reboot or `nvidia-smi` to clear.",
                pids=leftovers,
            )

    def _teardown(self) -> list[int]:
        """Stop what this launch started, in order; the tracker ends STOPPED whatever happens once it began."""
        # A launch that failed before it began (the wire could not listen) left the pool as it was.
        began = self._tracker.begin_stop() or self._tracker.state == PoolState.STOPPING
        try:
            return self._transport.close()
        finally:
            if began:
                self._tracker.stopped()

    def restart(
        self,
        on_progress: OnProgress | None = None,
        replay: bool = False,
        on_replay: Callable[[CellResult], None] | None = None,
        on_note: OnNote | None = None,
        full: bool = False,
    ) -> Pool:
        """Fresh ranks with the same configuration (cell numbers keep counting).

        Fresh rank processes start under the running torchrun and supervisors, from spares (see
        :attr:`LaunchConfig.spares`); where that can't be (a supervisor, torchrun or machine lost) or ``full``, all restarts.

        With ``replay``, the cells that succeeded since the launch are re-run in order on the same
        ranks, with the values pushed between them, bringing the fresh pool back to the state
        before a failure. Replay stops at the first cell that fails this time. A restart without
        replay does not move where the next replay starts: the session since ``%dist_launch`` (or
        since the last replay, which re-ran it) is replayed, however many restarts came between.
        """
        base = self._session.launch_index
        steps = self._session.since_launch() if replay else []
        if full or not self._respawn(on_progress, on_note):
            self.shutdown()
            self.start(on_progress, on_note)
        if not replay:
            self._session.mark_launch(base)
        self._session.replay(steps, lambda code, ranks, label: self.wait(self.submit(code, ranks, label=label)), self._push_blob, on_replay)
        return self

    def warm(self, modules: Iterable[str]) -> None:
        """Fresh ranks from now on (:meth:`restart`) are forked from a process per rank that has
        imported ``modules`` already — torch's and its libraries' (worker/process/zygote.WARMABLE) —
        instead of importing them again: DDP's first use imports torch._dynamo, seconds per rank.
        Cells' results say what they imported first (``CellResult.imported``). Takes the spares' place
        (their memory); a pool that has no spares (``spares=False``, or too little memory) ignores it."""
        have = set(self._warm)
        new = [m for m in dict.fromkeys(modules) if m not in have]
        self._warm += new
        if new and self._transport.running():  # else the next start() names them
            request_spares(self._transport, self._config, self._tracker, modules=new)

    def _respawn(self, on_progress: OnProgress | None, on_note: OnNote | None) -> bool:
        if not self._transport.running():
            return False
        self._respawns += 1
        if not respawn(self._tracker, self._transport, self._config, self._respawns, on_progress, on_note):
            return False
        self._session.mark_launch()
        return True

    def regroup(self) -> Regrouped:
        """Recover from a collective timeout without restarting processes: every rank replaces its
        poisoned default process group with a fresh one (namespaces are kept; objects holding
        the old group, such as a DDP model, must be rebuilt: the result names them). Ranks must be
        idle and alive."""
        targets = list(range(self.world_size))
        self._tracker.ensure_idle(targets)
        self._regroups += 1
        replies = self._tracker.requests.ask(exec_identity, targets, {"t": Msg.REGROUP, "generation": self._regroups},
                                             self._config.pg_timeout + 30)
        # The new default group is named "0" again and counts from #1 while the ranks' recorders keep
        # the old one's entries: a new generation of the log ignores every record made before it —
        # up to each rank's own newest id (its reply), not only what the log had read: an old entry
        # it never read (still open in the recorder) would otherwise pass for one of the new group's.
        self._tracker.new_generation(targets, {r: int(reply.get("last_id", -1)) for r, reply in replies.items()})
        errors = errors_of(replies)
        if errors:
            raise RemoteError(f"regroup failed on {format_ranks(errors)}: {next(iter(errors.values()))} "
                              "Use %dist_restart --replay instead.", errors=errors)
        return Regrouped(self.world_size, {n: k for reply in replies.values() for n, k in (reply.get("holders") or {}).items()})

    def __enter__(self) -> Pool:
        if self.state == PoolState.NEW:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- cells ----------------------------------------------------------------------------------
    def submit(self, code: str, ranks: Ranks = None, events: CellEvents | None = None, profile: bool = False,
               pdb: bool = False, label: int | None = None, comms: bool = False, paths: bool = False,
               source: dict[str, Any] | None = None, numerics: bool | str = False) -> CellResult:
        """Start a cell on the ranks and return its live :class:`CellResult` at once. ``profile``
        runs it under ``torch.profiler`` on every rank (read it with :meth:`profile`); with ``pdb``
        a rank that raises stops in the debugger at the error (:meth:`wait` answers it). ``label``
        is the notebook's In[n] for it (the magic passes it; export speaks in it). ``comms`` runs it
        under CommDebugMode (``result.comms()``); ``numerics`` records every op's fingerprint (``"collectives"``:
        the collectives only) for ``result.numerics()``. ``paths`` records which notebook lines each rank ran
        (default on 3.12+ ranks, or DISTNB_PATHS=1): failures name the first decision that differed.
        ``source`` is the notebook cell the code is ({"path", "line"}), for the debugger panel."""
        compiled = compile_source(code)  # a SyntaxError is raised here, once, before anything is sent
        targets = parse_ranks(ranks, self.world_size)
        flags = {"profile": len(targets) if profile else 0, "pdb": pdb, "comms": comms, "paths": paths, "source": source,
                 "numerics": ("ops" if numerics is True else numerics) or ""}
        return self._start(code, targets, events, flags, compiled=compiled, label=label)

    def _start(self, code: str, targets: list[int], events: CellEvents | None, flags: dict[str, Any], record: bool = True,
               compiled: CompiledCell | None = None, label: int | None = None) -> CellResult:
        with self._tracker.lock:
            self._tracker.ensure_idle(targets)
            cell = self._session.next_cell()
            name_cell(cell, label)
            result = CellResult(cell=cell, code=code, ranks=targets, results={r: RankResult(r) for r in targets}, label=label)
            run = self._tracker.begin_cell(result, events or CellEvents())
            if record:
                self._session.add_cell(result)
        self._transport.send_many(map(exec_identity, targets), exec_request(cell, code, compiled, flags),  # type: ignore[arg-type]
                                follow_up=self._tracker.watch_follow_up(run))
        return result

    def debug(self, rank: int | None = None, ask: Ask | None = read_line) -> CellResult:
        """Post-mortem: the debugger on ``rank`` (default: the root-cause rank of the last cell
        that raised) at the frame of its last error, its namespace alive; answered by ``ask``."""
        target = self._debugger.post_mortem_rank(self._session.history) if rank is None else parse_ranks(rank, self.world_size)[0]
        return self.wait(self._start("", [target], None, {"debug_last": True}, record=False), ask=ask)

    def wait(
        self,
        result: CellResult,
        timeout: float | None = None,
        on_tick: Callable[[CellResult], None] | None = None,
        tick: float = 0.1,
        ask: Ask | None = read_line,
        fail_fast: bool = True,
        rebuild: bool = True,
        proven_hang_ends: bool = False,
    ) -> CellResult:
        """Wait for a submitted cell. The first Ctrl-C interrupts the ranks; a second stops waiting.
        Ranks paused in the debugger or in ``input()`` are answered with lines from ``ask``
        (default ``input()``; see :class:`~distnb.services.debugger.Debugger`); None leaves them to
        :attr:`debugger`. With ``fail_fast`` (default), once a rank has raised or died and every
        running rank waits in a call that needs it, the cell is ended at once as a Ctrl-C would
        end it, not at ``timeout`` (checked while one call waits at least a second). ``rebuild``:
        give every rank a fresh process group when an interrupt had to unblock a rank (a caller
        that restarts the ranks next, as the minimizer's tries do, need not). ``proven_hang_ends``:
        once running ranks provably wait for a call that ranks which finished the cell never
        reached, return as ``timeout`` would (``timed_out``), ranks left running (the minimizer's
        tries: their next restart ends them)."""
        run = self._tracker.run_of(result)
        fast = (FailFast(result, self._tracker, lambda ranks: self._inspector.collectives(ranks, refresh=True), finished=proven_hang_ends)
                if fail_fast else None)
        wait_for_cell(result, run, self._debugger, self.interrupt, timeout, on_tick, tick, ask, tracker=self._tracker, fail_fast=fast)
        result.elapsed = time.monotonic() - run.started
        if run.finished.is_set() and not run.death_checked:
            run.death_checked = True
            self._inspector.conclude(result)
            if rebuild:
                rebuild_after_unblock(result, self._tracker, self.regroup)  # after an interrupt that had to unblock a rank
        if on_tick is not None:
            on_tick(result)
        return result

    def run(self, code: str, ranks: Ranks = None, timeout: float | None = None, events: CellEvents | None = None,
            profile: bool = False, pdb: bool = False, ask: Ask | None = read_line, fail_fast: bool = True,
            numerics: bool | str = False) -> CellResult:
        """Run ``code`` on the ranks (all by default) and return per-rank output, value and error;
        ``breakpoint()`` and ``input()`` in it are answered by ``ask``; ``fail_fast``: see :meth:`wait`;
        ``numerics``: see :meth:`submit`."""
        return self.wait(self.submit(code, ranks, events, profile, pdb, numerics=numerics), timeout, ask=ask, fail_fast=fail_fast)

    def interrupt(self, ranks: Iterable[int] | None = None) -> list[int]:
        """Send a KeyboardInterrupt to the cell running on the given (default: all busy) ranks."""
        cells = self._tracker.busy(None if ranks is None else list(ranks))
        targets = list(ranks) if ranks is not None else list(cells)
        if self._transport.address is None:  # never launched
            return []
        for r in targets:
            # The cell number lets a rank whose EXEC has not arrived yet interrupt that cell on arrival.
            self._transport.send(control_identity(r), {"t": Msg.INTERRUPT, "cell": cells.get(r)})
        return targets

    # -- values in and out ----------------------------------------------------------------------
    def push(self, ranks: Ranks = None, **values: Any) -> None:
        """Copy notebook values into every (or the given) rank's namespace."""
        blob = pack_values(values)
        targets = parse_ranks(ranks, self.world_size)
        self._tracker.ensure_idle(targets)
        self._push_blob(blob, targets, tuple(values))
        self._session.add_push(targets, tuple(values), blob)

    def _push_blob(self, blob: bytes, targets: list[int], names: tuple[str, ...]) -> None:
        send_values(self._tracker.requests, blob, targets, names)

    def pull(self, name: str, ranks: Ranks = None) -> dict[int, Any]:
        """``{rank: value}`` of a name in each (or the given) rank's namespace."""
        targets = parse_ranks(ranks, self.world_size)
        self._tracker.ensure_idle(targets)
        return fetch_value(self._tracker.requests, name, targets)

    # -- status and inspection ------------------------------------------------------------------
    def status(self) -> PoolStatus:
        """Per-rank pid, host, device and state, from what the controller knows (no round trip)."""
        transport, multinode = self._transport, self._transport.multinode
        health = transport.health
        return PoolStatus(
            state=self.state.value, backend=self._tracker.backend(), world_size=self.world_size, ranks=self._tracker.rank_statuses(),
            agent_pid=transport.agent_pid, address=self.address or transport.address,
            cells_run=len(self._session), nnodes=self._config.nnodes,
            nodes=multinode.nodes.text(self._tracker.ranks_by_agent()) if multinode else "",
            rejected=health.rejected if health else 0, internal_errors=health.errors if health else 0,
            last_internal_error=health.last_error if health else None, diagnosis_errors=self._internal.count,
            last_diagnosis_error=self._internal.last)

    def pids(self) -> list[int]:
        """Every process of the pool known to be alive (agent, supervisors, ranks)."""
        return self._transport.pids()

    def minimize(self, budget: float = 300.0, path: str = "minimal.py", on_progress: Callable[[str], None] | None = None,
                 verify: float | None = VERIFY_SECONDS, bound: float | None = None) -> Minimized:
        """Cut the session's last failure down on this pool (services/cases/minimize.py): the cells before
        it, then each kept cell's statements, each try on fresh ranks, keeping the same failure;
        within ``budget`` seconds (Ctrl-C stops it, keeping the smallest case found). Writes the case
        as ``path`` (a torchrun script, run once to verify it) and a notebook beside it, then gives
        the ranks back the session's state (a restart that replays it). ``bound``: seconds one try
        may run a cell (default: services.cases.minimize.try_bound)."""
        history = self._session.failure_window()  # a failure before a `%dist_restart --replay` too
        self.warm(m for cell in history for m in cell.imported)  # each try's fresh ranks: not the session's imports again
        found = minimize(self._tries(), history, budget, on_progress, bound)
        write_case(found, self._config, path, verify)
        self.restart(replay=True)
        return found

    def _tries(self) -> Runs:
        """This pool as minimize's tries use it; a single-machine pool can start smaller ones."""
        flags = {"profile": 0, "pdb": False, "comms": False, "paths": False, "source": None}

        def run(code: str, ranks: list[int], timeout: float) -> CellResult:  # not kept in the session's history
            res = self.wait(self._start(code, ranks, None, flags, record=False, compiled=compile_source(code)), timeout, ask=None, rebuild=False,
                            proven_hang_ends=True)
            if res.user_interrupted:
                raise KeyboardInterrupt  # one Ctrl-C stops the minimizing, keeping the smallest case found
            return res

        def stop(res: CellResult) -> None:
            """Nothing: the next try's restart kills ranks still in a cell, which then ends as dead
            (Tracker.begin_respawn); interrupting ranks blocked in gloo first took seconds a try."""

        return Runs(self.restart, run, stop, self.world_size, self._smaller if self._config.nnodes == 1 else None)

    @contextmanager
    def _smaller(self, nproc: int) -> Iterator[Runs]:
        """A pool like this one with ``nproc`` ranks, for a try of a smaller world; this pool stays
        the notebook's current one, and the smaller one is shut down on leaving."""
        pool = Pool(replace(self._config, nproc=nproc))
        try:
            pool.start()
            pool.warm(self._warm)
            yield pool._tries()
        finally:
            pool.shutdown()
            pools.set_current(self)

    def export(self, path: str, cells: str | None = None, include_failed: bool = False, only_ok: bool = False,
               by_label: bool = False, verify: float | None = VERIFY_SECONDS, say: Callable[[str], None] | None = None) -> Export:
        """Write the session as a standalone ``torchrun`` script (or a notebook: ``.ipynb``): by
        default the minimal failing case, see :func:`~distnb.services.cases.export.export_session`. A
        script ending with a failed cell is run under torchrun for at most ``verify`` seconds (None:
        not run; ``say`` hears it start) and says whether it reproduced the failure (``.verified``)."""
        return export_session(self._session, path, self._config, cells, include_failed, only_ok, by_label, verify, say)

    def __repr__(self) -> str:
        return f"<distnb.Pool {self.state.value}, {self.world_size} ranks>"


def launch(config: LaunchConfig | None = None, on_progress: OnProgress | None = None, **options: Any) -> Pool:
    """Start a pool and make it the current one: ``pool = distnb.launch(nproc=4)``. ``options``
    are :class:`Pool`'s (and :class:`~distnb.config.LaunchConfig`'s)."""
    return Pool(config, **options).start(on_progress)


def _launch_signature() -> inspect.Signature:
    """``launch``'s signature as callers should see it (``distnb.launch?``, editor tooltips): Pool's
    options, spelled out, without repeating them here."""
    pool = list(inspect.signature(Pool.__init__).parameters.values())[1:]  # without self
    progress = inspect.Parameter("on_progress", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                 annotation="OnProgress | None")
    return inspect.Signature([pool[0], progress, *pool[1:]], return_annotation="Pool")


launch.__signature__ = _launch_signature()  # type: ignore[attr-defined]
