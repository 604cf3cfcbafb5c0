"""IPython magics that look into a pool — where the ranks are, what they hold, what they did — and
``%dist_debug``, the post-mortem debugger. Thin over :class:`distnb.Pool`, like :mod:`distnb.magics.running`."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from distnb.jobs.attached import AttachedJob
from distnb.jobs.bare import BareJob
from distnb.jobs.looking import current_job
from distnb.magics.support import Progress, parse, pool_or_usage_error, show_checks, show_figure, unquote, usage_errors, views_or_usage_error

__all__ = ["InspectMagics"]


@magics_class
class InspectMagics(Magics):
    """``%dist_stacks``, ``%dist_check``, ``%dist_export``, ``%dist_memory``, ``%dist_collectives``,
    ``%dist_timeline``, ``%dist_mesh``, ``%dist_compile``, ``%dist_env`` and ``%dist_debug``."""

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to compare: 0,2 · 1-3 · all (default: all).")
    @line_magic
    def dist_compile(self, line: str) -> Any:
        """What torch.compile did on each rank this session: frames compiled, recompiles with the guard that
        failed, graph breaks, the collectives in its graphs (with --paths cells); the ranks that differ named."""
        args = parse(self.dist_compile, line)
        pool = pool_or_usage_error()
        with usage_errors():
            return pool.compiles(args.ranks)

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to show: 0,2 · 1-3 · all (default: all).")
    @argument("--native", action="store_true", help="Add native (C/C++) frames through py-spy, when installed.")
    @argument("--all-threads", action="store_true", help="Show every Python thread, not only the one running cells.")
    @line_magic
    def dist_stacks(self, line: str) -> Any:
        """Where is every rank right now? Works while a cell runs or hangs; identical stacks are grouped."""
        args = parse(self.dist_stacks, line)
        pool = views_or_usage_error()
        with usage_errors():
            return pool.stacks(args.ranks, all_threads=args.all_threads, native=args.native)

    @magic_arguments()
    @argument("names", nargs="+", help="Tensors, modules, state dicts or optimizers defined on the ranks.")
    @argument("--ranks", default=None, help="Only these ranks: 0,2 · 1-3 · all.")
    @argument("--within", default=None, metavar="DIM",
              help="Compare inside each group of this mesh dimension (e.g. tp: tensor-parallel peers must see the same batch).")
    @line_magic
    def dist_check(self, line: str) -> None:
        """Compare tensors across ranks by bitwise fingerprint, sum, norm, NaN/Inf: identical, or the odd ranks.
        A name that differs across ranks says along which mesh dimensions it agrees; --within DIM compares inside
        each group of DIM only."""
        args = parse(self.dist_check, line)
        pool = pool_or_usage_error()
        with usage_errors():
            reports = pool.check(args.names, ranks=args.ranks, within=args.within)
        show_checks(reports)

    @magic_arguments()
    @argument("path", help="Where to write: a .py script for torchrun, or a .ipynb notebook.")
    @argument("--cells", default=None, metavar="RANGE",
              help="The notebook's In[n] of the cells to export, e.g. 3-7,9 (default: the minimal failing case, see below).")
    @argument("--all", action="store_true", help="Every cell since launch, the failed ones too.")
    @argument("--ok", action="store_true", help="Only the cells that succeeded (a script that runs through).")
    @argument("--no-verify", action="store_true", help="Don't run the script to check that it fails as the session did.")
    @argument("--verify-timeout", type=float, default=None, metavar="SECONDS",
              help="How long the check may run the script (default 75; a hang's script times out its collectives after 30).")
    @line_magic
    def dist_export(self, line: str) -> None:
        """Write the session as a standalone script (torchrun --nproc-per-node N PATH) or notebook.

        By default, the minimal failing case: the cells that succeeded up to the last one that
        failed, and that one (on the ranks it ran on); with no failure, every cell that succeeded.
        Says which cells went in. A script that ends with a failed cell is then run under torchrun
        here, with the pool's world size and backend, and said "reproduced" only when it fails as
        the session did (the same ranks raising the same errors, or hanging); else what differed."""
        args = parse(self.dist_export, line)
        if args.verify_timeout is not None and args.verify_timeout <= 0:
            raise UsageError("--verify-timeout takes a positive number of seconds, e.g. --verify-timeout 60.")
        pool = pool_or_usage_error()
        progress = Progress()  # the check runs the script for seconds: it says so, and how to skip it
        with usage_errors():
            try:
                # The pool's default bound unless told (--verify-timeout), none with --no-verify.
                verify = {"verify": None} if args.no_verify else {"verify": args.verify_timeout} if args.verify_timeout else {}
                written = pool.export(args.path, cells=args.cells, include_failed=args.all, only_ok=args.ok, by_label=True,
                                      say=progress.say, **verify)
            except OSError as exc:  # e.g. a folder that does not exist
                raise UsageError(f"can't write {args.path}: {exc.strerror or exc}. Pick a path in a folder you can write to.") from None
        progress.done()
        print(written.text())

    @magic_arguments()
    @argument("--budget", type=float, default=300.0, metavar="SECONDS", help="How long it may try (default 300).")
    @argument("--out", default="minimal.py", metavar="PATH", help="Where to write the case (a script, and a notebook beside it).")
    @argument("--no-verify", action="store_true", help="Don't run the written script to check it fails as the session did.")
    @argument("--try-timeout", type=float, default=None, metavar="SECONDS",
              help="How long one try may run a cell (default: a hang's cell timeout and 2 s; 3x an error's cell time).")
    @line_magic
    def dist_minimize(self, line: str) -> None:
        """Cut the session's last failure down to a minimal case, on this pool: the cells before it,
        then each kept cell's statements, each try on fresh ranks, keeping the same failure (the
        same ranks raising the same errors, or hanging). Shows its progress; one Ctrl-C stops it,
        keeping the smallest case found. Writes the case as a script (run once under torchrun to
        verify it) and a notebook, then gives the ranks back the session's state."""
        args = parse(self.dist_minimize, line)
        if args.budget <= 0:
            raise UsageError("--budget takes a positive number of seconds, e.g. --budget 120.")
        if args.try_timeout is not None and args.try_timeout <= 0:
            raise UsageError("--try-timeout takes a positive number of seconds, e.g. --try-timeout 10.")
        pool = pool_or_usage_error()
        progress = Progress()
        with usage_errors():
            try:
                found = pool.minimize(args.budget, args.out, progress.say, **({"verify": None} if args.no_verify else {}),
                                      bound=args.try_timeout)
            except OSError as exc:
                raise UsageError(f"can't write {args.out}: {exc.strerror or exc}. Pick a path in a folder you can write to.") from None
        progress.done()
        print(found.text())
        print("the case:\n" + found.code())

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to show: 0,2 · 1-3 · all (default: all).")
    @argument("--plot", action="store_true", help="Bar chart of current and peak memory per rank.")
    @argument("--timeline", action="store_true", help="Each rank's peak memory per cell.")
    @line_magic
    def dist_memory(self, line: str) -> Any:
        """Per-rank memory: RSS (and CUDA allocated/reserved/peak, NVML device use on GPUs); flags imbalance."""
        args = parse(self.dist_memory, line)
        pool = views_or_usage_error()
        with usage_errors():
            report = pool.memory(args.ranks)
        from IPython.display import display

        display(report)
        if args.plot or args.timeline:
            figs = ([report.plot_bars()] if args.plot else []) + ([report.plot_timeline()] if args.timeline else [])
            for fig in figs:
                show_figure(fig)
        return None

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to show: 0,2 · 1-3 · all (default: all).")
    @argument("--last", type=int, default=None, metavar="K", help="Only the last K collectives of each group.")
    @argument("--per-rank", action="store_true", help="A column per rank even above 16 ranks, 8 ranks a page (with --page).")
    @argument("--page", type=int, default=None, metavar="N", help="The page of the per-rank view (from 1; implies --per-rank).")
    @line_magic
    def dist_collectives(self, line: str) -> Any:
        """Each rank's collective sequence (incl. DDP/FSDP internals) side by side; the first divergence marked.
        Above 16 ranks: the majority's sequence with the ranks that differ (--per-rank: every rank, paged)."""
        args = parse(self.dist_collectives, line)
        if args.last is not None and args.last < 1:
            raise UsageError("--last takes a positive count, e.g. --last 10.")
        pool = views_or_usage_error()
        with usage_errors():
            report = pool.collectives(args.ranks, last=args.last)
            return report.paged(args.page or 1) if args.per_rank or args.page is not None else report

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to compare: 0,2 · 1-3 · all (default: the group's members).")
    @argument("--last", type=int, default=200, metavar="K", help="The last K collectives (default 200).")
    @argument("--group", default="0", metavar="NAME", help="Process group name as in %%dist_collectives (default 0, the world).")
    @argument("--no-plot", action="store_true", help="Text only.")
    @line_magic
    def dist_timeline(self, line: str) -> None:
        """Arrival skew per rank over recent collectives: who arrives last, how late, how long the others wait (text and plot)."""
        args = parse(self.dist_timeline, line)
        if args.last < 1:
            raise UsageError("--last takes a positive count, e.g. --last 200.")
        pool = views_or_usage_error()
        with usage_errors():
            report = pool.stragglers(args.ranks, group=args.group, last=args.last)
        from IPython.display import display

        display(report)
        if report.collectives and not args.no_plot:
            show_figure(report.plot())

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to show: 0,2 · 1-3 · all (default: all).")
    @argument("--no-plot", action="store_true", help="Text only.")
    @line_magic
    def dist_mesh(self, line: str) -> None:
        """The session's device meshes: shape, dimension names, each rank's coordinates, the groups of each
        dimension, collectives per dimension per rank, and the ranks whose mesh disagrees (text and a grid)."""
        args = parse(self.dist_mesh, line)
        pool = pool_or_usage_error()
        with usage_errors():
            report = pool.meshes(args.ranks)
        from IPython.display import display

        display(report)
        fig = None if args.no_plot else report.plot()
        if fig is not None:
            show_figure(fig)

    @magic_arguments()
    @argument("ranks", nargs="?", default=None, help="Ranks to show: 0,2 · 1-3 · all (default: all).")
    @line_magic
    def dist_env(self, line: str) -> Any:
        """RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, CUDA_VISIBLE_DEVICES, NCCL_*/TORCH_* per rank; flags differences."""
        args = parse(self.dist_env, line)
        pool = views_or_usage_error()
        with usage_errors():
            return pool.env(args.ranks)

    @magic_arguments()
    @argument("rank", nargs="?", type=int, default=None,
              help="The rank to debug (default: the root-cause rank of the last cell that raised; attached: of the hang).")
    @argument("-c", "--command", action="append", default=None, metavar="CMD",
              help="Attached to a job: run this console command (again for more), then leave; without it, lines are asked.")
    @line_magic
    def dist_debug(self, line: str) -> None:
        """Post-mortem: pdb at the frame where the last failing cell raised on a rank, its namespace alive.

        Type pdb commands at the prompt (p, w, u/d, l, pp …); c or q ends it. %%on_ranks --pdb
        instead stops every rank that raises at its error while the cell runs. (An out-of-memory
        error's frames are not kept: they would hold the memory; use --pdb for those.)

        Attached to a live job (%dist_attach): pdb's words on the rank at the frame it stands in,
        after a warning. It is not stopped: where, p, pp, l, args read its frames (a rank hung in a
        collective too), ranks R: p x reads several ranks; pause stops it at its next Python line,
        then n, s, r step and c lets it go; b LINE and c run it on to a breakpoint. q leaves it
        running as it was."""
        args = parse(self.dist_debug, line)
        job = current_job()
        if isinstance(job, AttachedJob):
            # IPython's argument split keeps a value's quotes: -c "p x" gives '"p x"'.
            commands = None if args.command is None else [unquote(c) for c in args.command]
            with usage_errors():
                job.debug(args.rank, commands=commands)
            return
        if isinstance(job, BareJob):
            pids = ", ".join(f"rank {r}: {p}" for r, p in job.pids().items())
            raise UsageError(f"this notebook is {job.describe()}: stepping into a rank needs its control thread, which a job not "
                             f"started with distnb lacks. py-spy dump --locals --pid PID shows a rank's locals now ({pids}); "
                             "python -m distnb run -- torchrun … starts the job so that %dist_debug can step into it.")
        if job is not None:
            raise UsageError(f"this notebook is {job.describe()}: its ranks have ended, so there is no frame to debug; "
                             "%dist_reproduce writes a notebook that fails the same way, where %dist_debug works.")
        if args.command:
            raise UsageError("-c runs console commands on a rank of an attached job (%dist_attach); on a pool, "
                             "%dist_debug asks for pdb's commands at its prompt.")
        pool = pool_or_usage_error()
        with usage_errors():
            result = pool.debug(args.rank)
        if not result.ok:
            print(result.outcome_text().strip("\n"))
