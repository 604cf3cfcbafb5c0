"""IPython magics: thin argument parsing over :class:`distnb.Pool`, then display."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from distnb.cell_names import cell_name
from distnb.config import LaunchConfig
from distnb.display.cell_display import CellDisplay
from distnb.display.text import LivePrinter, StartProgress
from distnb.display.widgets import widgets_available
from distnb.errors import CellFailed, NoPoolError
from distnb.jobs.attached import AttachedJob
from distnb.jobs.bare import BareJob
from distnb.jobs.loaded import LoadedJob
from distnb.jobs.looking import current_job
from distnb.jobs.pools import current_pool
from distnb.magics.after_cell import AfterCell, show_after_cell
from distnb.magics.live_watch import HangWatch, follow
from distnb.magics.panel import cell_source
from distnb.magics.support import keep_going, notebook_cell_number, pool_or_usage_error, stop_if_failed, views_or_usage_error
from distnb.magics.support import parse as _parse
from distnb.magics.support import usage_errors as _usage_errors
from distnb.pool import Pool
from distnb.ranks import format_ranks, parse_ranks
from distnb.results import CellEvents, CellResult
from distnb.states import RankState
from distnb.wire.cell_code import RANK_NAMES

__all__ = ["DistMagics"]


def _env_pairs(items: list[str] | None) -> dict[str, str]:
    env = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env takes KEY=VALUE (e.g. --env NCCL_DEBUG=INFO), not {item!r}.")
        env[key] = value
    return env


def _print_note(text: str) -> None:
    print(f"[distnb] {text}", flush=True)


@magics_class
class DistMagics(Magics):
    """``%dist_launch``, ``%%on_ranks``, ``%dist_status``, ``%dist_push``, ``%dist_pull``, ``%dist_wait``,
    ``%dist_restart``, ``%dist_regroup`` and ``%dist_shutdown`` (the rest: inspect_magics.py)."""

    def _in_kernel(self) -> bool:
        return getattr(self.shell, "kernel", None) is not None

    @property
    def _user_ns(self) -> dict[str, Any]:
        assert self.shell is not None  # magics run inside a shell
        return self.shell.user_ns

    def _pool(self) -> Pool:
        return pool_or_usage_error()

    # -- launch / lifecycle ---------------------------------------------------------------------
    @magic_arguments()
    @argument("-n", "--nproc", "--nproc-per-node", type=int, default=None, help="Ranks per machine (default: visible GPUs, else 2).")
    @argument("--backend", choices=["auto", "nccl", "gloo"], default="auto", help="Process group backend (auto: nccl with CUDA, else gloo).")
    @argument("--env", action="append", metavar="KEY=VALUE", help="Environment variable for every rank; repeatable (e.g. --env NCCL_DEBUG=INFO).")
    @argument("--pg-timeout", type=float, default=None, metavar="SECONDS",
              help="The collective timeout of the default group and of every group made later without one (new_group, init_device_mesh; default 1800).")
    @argument("--start-timeout", type=float, default=None, metavar="SECONDS", help="How long to wait for every rank to be ready (default 180).")
    @argument("--hang-after", type=float, default=None, metavar="SECONDS", help="Report ranks disagreeing in collectives after this long (default 3).")
    @argument("--debug", action="append", choices=["detail", "nccl"],
              help="detail: TORCH_DISTRIBUTED_DEBUG=DETAIL (mismatched collectives raise, naming the field); nccl: NCCL_DEBUG=INFO. Repeatable.")
    @argument("--nnodes", type=int, default=None, metavar="K",
              help="Machines in the pool, this one included (default 1). Prints the command to run on the others.")
    @argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="torchrun's c10d rendezvous (default: this machine, a free port).")
    @argument("--bind", default=None, metavar="ADDRESS[:PORT]",
              help="Where the controller listens (default 127.0.0.1; other machines need an address they can reach, e.g. 0.0.0.0).")
    @argument("--hosts", default=None, metavar="H1,H2", help="Start the other machines' node agents over ssh (nnodes = 1 + hosts).")
    @argument("--local-nodes", action="store_true",
              help="Run the other nodes' agents on this machine too: rehearse a multi-node layout (RANK vs LOCAL_RANK, GROUP_RANK) on one box; gloo.")
    @argument("--share-gpus", action="store_true",
              help="Several NCCL ranks per GPU over loopback (e.g. -n 4 on one GPU): rehearse NCCL hangs on fewer GPUs; slow.")
    @argument("--no-spares", action="store_true",
              help="Don't keep a spare process per rank (torch imported, idle) that makes %%dist_restart take about a second.")
    @argument("--slurm", action="store_true", help="Inside a Slurm allocation: start a node agent on every other node with srun.")
    @argument("--curve", action="store_true", help="Encrypt the control plane (CURVE) and admit only clients holding the pool's key.")
    @argument("--key-file", default=None, metavar="FILE", help="Where to write the key the other machines read (default ~/.distnb/keys/<pool>.key).")
    @argument("--node-python", default=None, metavar="PATH", help="The Python that runs distnb on the other machines (default: this kernel's path).")
    @line_magic
    def dist_launch(self, line: str) -> None:
        """Start a persistent torchrun pool; returns once every rank's process group is ready.

        Multi-node: ``%dist_launch --nnodes 2 -n 4 --bind 0.0.0.0`` prints the one command to run on
        the other machine; ``--hosts node2`` starts it over ssh, ``--slurm`` with srun.

        NCCL pools get watchdog settings for interactive work (any you set yourself win): at a
        collective timeout (``--pg-timeout``) NCCL aborts that group's communicator but every rank
        stays alive with its namespace (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, heartbeat monitor off);
        each rank's Flight Recorder is dumped into the pool's run folder and read for the
        post-mortem (TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_FR_DUMP_TEMP_FILE); the dump wait is 4 s,
        not 60 (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=1000); GPU start times are recorded
        (TORCH_NCCL_ENABLE_TIMING=1). Then ``%dist_regroup`` builds a new group."""
        args = _parse(self.dist_launch, line)
        with contextlib.suppress(NoPoolError):
            pool = current_pool()
            raise UsageError(
                f"a pool of {pool.world_size} ranks is already {pool.state.value}; "
                "use %dist_restart for fresh ranks or %dist_shutdown before launching another."
            )
        attached = current_job()
        if attached is not None:
            raise UsageError(f"this notebook is {attached.describe()} (read-only); %dist_detach first, then launch a pool.")
        options: dict[str, Any] = {"nproc": args.nproc, "backend": args.backend, "env": _env_pairs(args.env), "debug": tuple(args.debug or ())}
        for name in ("pg_timeout", "start_timeout", "hang_after", "nnodes", "rdzv_endpoint", "bind", "key_file", "node_python"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
        if args.hosts is not None:
            options["hosts"] = tuple(h for h in args.hosts.split(",") if h.strip())
            if not options["hosts"]:
                raise UsageError("--hosts needs at least one host name, e.g. --hosts node2,node3.")
        options.update(slurm=args.slurm, curve=args.curve, local_nodes=args.local_nodes, share_gpus=args.share_gpus, spares=not args.no_spares)
        try:
            config = LaunchConfig(**options)
        except ValueError as exc:
            # Speak the magic's language: the flag, not the Python parameter.
            text = str(exc)
            for name, flag in (("nproc", "-n/--nproc"), ("pg_timeout", "--pg-timeout"), ("start_timeout", "--start-timeout"), ("hang_after", "--hang-after"),
                               ("nnodes", "--nnodes"), ("rdzv_endpoint", "--rdzv-endpoint"), ("hosts", "--hosts"), ("slurm", "--slurm"),
                               ("local_nodes", "--local-nodes"), ("share_gpus", "--share-gpus")):
                if text.startswith(name + " "):
                    text = flag + text[len(name):]
                text = text.replace(f" {name} ", f" {flag} ").replace(f"({name} ", f"({flag} ")
            raise UsageError(text) from None
        with _usage_errors():
            pool = Pool(config).start(on_progress=StartProgress(self._in_kernel()), on_note=_print_note)
        print(pool.status().text())
        print(f"every rank starts with: {', '.join(RANK_NAMES)} (its process group is initialised; "
              "a pasted script's init_process_group keeps it)")

    @magic_arguments()
    @line_magic
    def dist_shutdown(self, line: str) -> None:
        """Stop every rank of the current pool (SIGTERM, then SIGKILL) and verify none is left."""
        _parse(self.dist_shutdown, line)
        pool = self._pool()
        with _usage_errors():
            pool.shutdown()
        print(f"pool stopped: {pool.world_size} ranks shut down, no process left.")

    @magic_arguments()
    @argument("--replay", action="store_true", help="Re-run, in order, the cells that succeeded since launch.")
    @argument("--full", action="store_true", help="Restart torchrun and the supervisors too (what a restart falls back to by itself when one is gone).")
    @argument("--keep-going", action="store_true", help="With --replay: a replayed cell that fails does not raise CellFailed (see %%on_ranks?).")
    @line_magic
    def dist_restart(self, line: str) -> None:
        """Replace every rank with a fresh process, same configuration (namespaces start empty).

        Works on a pool with hung or dead ranks. The fresh ranks start under the running torchrun
        from spares that imported torch already (about a second); where a supervisor, torchrun or a
        machine is gone — or with --full — everything restarts. With --replay, the cells that
        succeeded since launch run again, so the pool is back at the step before the failure; a
        replayed cell that fails this time stops the replay and raises CellFailed (the pool is not
        back where it was, so Run All stops too), unless --keep-going or DISTNB_KEEP_GOING=1.
        """
        args = _parse(self.dist_restart, line)
        pool = self._pool()
        failed: list[CellResult] = []

        def replayed(result: CellResult) -> None:
            first = result.code.strip().splitlines()[0] if result.code.strip() else ""
            status = "ok" if result.ok else "FAILED — replay stopped here"
            print(f"replayed {cell_name(result.cell)} on {format_ranks(result.ranks)}: {status}  | {first[:60]}")
            if not result.ok:
                failed.append(result)
                print(result.outcome_text(), file=sys.stderr)

        with _usage_errors():
            pool.restart(on_progress=StartProgress(self._in_kernel()), replay=args.replay, on_replay=replayed, on_note=_print_note, full=args.full)
        print(pool.status().text())
        if failed:
            self._user_ns["_dist"] = failed[-1]
            stop_if_failed(failed[-1], args.keep_going, prefix="replay stopped: ")

    @magic_arguments()
    @line_magic
    def dist_regroup(self, line: str) -> None:
        """After a collective timeout: a fresh process group on every rank, without restarting (state kept)."""
        _parse(self.dist_regroup, line)
        pool = self._pool()
        with _usage_errors():
            print(pool.regroup().text())

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to interrupt: 0,2 · 1-3 · all (default: every busy one).")
    @line_magic
    def dist_interrupt(self, line: str) -> None:
        """Interrupt the cell still running on the ranks (one that timed out, or runs with --bg): a
        KeyboardInterrupt in the cell, as Ctrl-C gives a cell the notebook waits for."""
        args = _parse(self.dist_interrupt, line)
        pool = self._pool()
        with _usage_errors():
            busy = [s.rank for s in pool.status().ranks if s.state == RankState.RUNNING]
            chosen = busy if args.ranks is None else [r for r in parse_ranks(args.ranks, pool.world_size) if r in busy]
            hit = pool.interrupt(chosen) if chosen else []
        print(f"interrupting the cell on {format_ranks(hit)}: they stop at their next Python line; one blocked in a collective is "
              "unblocked after 2 s (its group aborted, then rebuilt when the cell has ended, namespaces kept). %dist_wait shows how it "
              "ended." if hit else "no cell is running: nothing to interrupt.")

    @magic_arguments()
    @argument("--timeout", type=float, default=None, metavar="SECONDS", help="Stop waiting after this long (the cell then counts as failed).")
    @argument("--keep-going", action="store_true", help="A failed cell does not raise CellFailed (see %%on_ranks?).")
    @line_magic
    def dist_wait(self, line: str) -> None:
        """Wait for the last cell (e.g. one started with %%on_ranks --bg) and show its result.

        A cell that failed, or still runs when --timeout passes, raises CellFailed after its result
        is shown, as %%on_ranks does: Run All stops here unless --keep-going or DISTNB_KEEP_GOING=1."""
        args = _parse(self.dist_wait, line)
        pool = self._pool()
        if not pool.history:
            raise UsageError("no cell has run on this pool yet: there is nothing to wait for. Run one with %%on_ranks (add --bg to keep the notebook free).")
        result = pool.history[-1]
        assert isinstance(result, CellResult)  # the newest cells always keep their full results
        pool.wait(result, timeout=args.timeout)
        pool.explain_timeout(result)
        self._user_ns["_dist"] = result
        print(result.text())
        stop_if_failed(result, args.keep_going)

    @magic_arguments()
    @argument("--all", action="store_true", help="A line per rank even above 16 ranks (else: ranks grouped by state, the odd ones named).")
    @line_magic
    def dist_status(self, line: str) -> None:
        """Per rank: pid, host, device and state (idle · running cell k for t s · dead)."""
        args = _parse(self.dist_status, line)
        from IPython.display import display

        target = views_or_usage_error()
        if isinstance(target, (AttachedJob, BareJob, LoadedJob)):
            display(target.status())
            return
        status = target.status()
        status.every_rank = args.all
        display(status)

    # -- cells ----------------------------------------------------------------------------------
    @magic_arguments()
    @argument("ranks", nargs="*", help="Ranks to run on: 0,2 · 1-3 · all (default: all).")
    @argument("--timeout", type=float, default=None, metavar="SECONDS",
              help="Return after this long, naming the ranks still running (the cell then counts as failed: see --keep-going).")
    @argument("--quiet", action="store_true", help="Don't stream output; show only values, errors and ranks still running.")
    @argument("--hang-after", type=float, default=None, metavar="SECONDS", help="Report a hang once ranks disagree this long (default: the pool's, 3 s).")
    @argument("--no-fail-fast", action="store_true",
              help="Wait for --timeout even when a rank has raised or died and the others wait in a call that needs it (default: end the cell then).")
    @argument("--check", default=None, metavar="NAMES", help="After the cell, compare these variables across ranks (comma-separated).")
    @argument("--bg", action="store_true",
              help="Return at once; the cell keeps running (see %%dist_stacks, %%dist_wait, _dist); %%dist_wait raises if it failed.")
    @argument("--keep-going", action="store_true",
              help="Don't raise CellFailed when the cell fails: Run All goes on past it. DISTNB_KEEP_GOING=1 does this for every cell.")
    @argument("--pdb", action="store_true", help="A rank that raises stops in the debugger at the error, its namespace alive.")
    @argument("--profile", action="store_true",
              help="Run under torch.profiler on every rank: time in compute, collectives and waiting per rank, top ops, one merged trace.")
    @argument("--comms", action="store_true",
              help="Run under PyTorch's CommDebugMode on every rank: collectives per module and mesh dimension (calls, bytes), "
                   "redistributes with their placements, ranks that differ flagged.")
    @argument("--numerics", nargs="?", const="ops", choices=("ops", "collectives"), default=None,
              help="Fingerprint every op on every rank (or only the collectives: a cheap NaN/Inf check); after the cell, the "
                   "first op where ranks that must agree part, and where a NaN/Inf was born (%%dist_numerics for more).")
    @argument("--paths", action="store_true",
              help="Record which of the notebook's lines each rank runs (on by default on Python 3.12+; DISTNB_PATHS=1 everywhere): "
                   "a hang, failure or desync names the first decision ranks took differently.")
    @cell_magic
    def on_ranks(self, line: str, cell: str) -> None:
        """Run the cell on every rank (or the given ones), streaming per-rank output live.

        The result is kept in the notebook variable ``_dist`` (a :class:`distnb.CellResult`).
        Ctrl-C interrupts the cell on the ranks; a second Ctrl-C stops waiting.

        A cell that fails — a rank raised, was interrupted or died, or ranks still run when
        --timeout passes — raises ``distnb.CellFailed`` once its report is shown: one line under
        it, and Run All (nbclient, CI) stops at this cell. ``--keep-going`` goes on past this cell;
        ``%env DISTNB_KEEP_GOING=1`` past every cell. A cell meant to fail in a notebook that must
        run through can carry Jupyter's ``raises-exception`` tag instead.

        ``breakpoint()`` (or ``pdb.set_trace()``) pauses the ranks that reach it and ``input()`` asks
        for a line: both are answered at the notebook's prompt, labelled by rank. The console's own
        commands: ``list`` (paused ranks), ``attach R``, ``ranks R: CMD``, ``detach``, ``help``.
        """
        args = _parse(self.on_ranks, line)
        args.ranks = " ".join(args.ranks) or None  # "0, 1" and "0 2" arrive as two words
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError("--timeout takes a positive number of seconds, e.g. --timeout 10.")
        pool = self._pool()
        view: CellDisplay | LivePrinter
        if widgets_available():
            with _usage_errors():
                view = CellDisplay(parse_ranks(args.ranks, pool.world_size), output=not args.quiet)
        else:
            with _usage_errors():
                view = LivePrinter(ranks=parse_ranks(args.ranks, pool.world_size))  # above 16 ranks it merges by number
        events = CellEvents(on_output=None if args.quiet else view.feed, on_display=view.display_bundle, on_rank_done=view.rank_done)
        try:
            with _usage_errors():
                result = pool.submit(cell, args.ranks, events if (isinstance(view, CellDisplay) or not args.bg) else None,
                                     profile=args.profile, pdb=args.pdb, label=notebook_cell_number(self.shell),
                                     comms=args.comms, paths=args.paths, source=cell_source(self.shell, pool),
                                     numerics=args.numerics or False)
        except SyntaxError as exc:  # pool.submit compiles the cell before sending anything
            import traceback

            print("".join(traceback.format_exception_only(type(exc), exc)).rstrip(), file=sys.stderr)
            print("[distnb] nothing was sent to the ranks.", file=sys.stderr)
            if keep_going(args.keep_going):
                return
            where = f" at cell line {exc.lineno}" if exc.lineno else ""
            raise CellFailed(f"the cell was not run: {type(exc).__name__}{where}: {exc.msg}; nothing was sent to the ranks") from None
        self._user_ns["_dist"] = result
        if isinstance(view, CellDisplay):
            view.cell = result.cell
        if args.bg:
            print(f"{cell_name(result.cell)} is running in the background on {format_ranks(result.ranks)}; "
                  "_dist holds its live result; %dist_stacks shows where it is, %dist_wait shows its output.")
            if isinstance(view, CellDisplay):
                view.go_live()
                threading.Thread(target=follow, args=(pool, result, view), name="distnb-view", daemon=True).start()
            return
        watch = HangWatch(pool, result, pool.config.hang_after if args.hang_after is None else args.hang_after, view)
        pool.wait(result, timeout=args.timeout, on_tick=watch.tick, fail_fast=not args.no_fail_fast)
        if not watch.said:  # the live watch said why already, else the report does
            pool.explain_timeout(result)
        if isinstance(view, CellDisplay):
            view.finish(result)
        else:
            view.flush(final=True)
            self._show_outcome(result, view)
        if not result.running:
            show_after_cell(pool, result, AfterCell(args.check, args.profile, args.comms, bool(args.numerics)))
        stop_if_failed(result, args.keep_going)  # last: the report, checks and profile are shown first

    def _show_outcome(self, result: CellResult, printer: LivePrinter) -> None:
        for note in (printer.cap_note(), result.truncation_note()):
            if note:
                print(note)
        outcome = printer.outcome_text(result).strip("\n")  # less what was already shown live
        if outcome:
            stream = sys.stderr if result.failed or result.running else sys.stdout
            print(outcome, file=stream)

    # -- data -----------------------------------------------------------------------------------
    @magic_arguments()
    @argument("names", nargs="+", help="Notebook variables to copy to the ranks.")
    @argument("--ranks", default=None, help="Only these ranks: 0,2 · 1-3 · all.")
    @line_magic
    def dist_push(self, line: str) -> None:
        """Copy notebook variables into the ranks' namespaces."""
        args = _parse(self.dist_push, line)
        ns = self._user_ns
        missing = [n for n in args.names if n not in ns]
        if missing:
            raise UsageError(f"{', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} not defined in the notebook; define it first.")
        pool = self._pool()
        with _usage_errors():
            pool.push(ranks=args.ranks, **{n: ns[n] for n in args.names})

    @magic_arguments()
    @argument("name", help="A variable defined on the ranks.")
    @argument("--ranks", default=None, help="Only these ranks: 0,2 · 1-3 · all.")
    @line_magic
    def dist_pull(self, line: str) -> dict[int, Any]:
        """Return ``{rank: value}`` of a variable on the ranks."""
        args = _parse(self.dist_pull, line)
        pool = self._pool()
        with _usage_errors():
            return pool.pull(args.name, ranks=args.ranks)

