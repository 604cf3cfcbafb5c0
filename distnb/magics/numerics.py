"""``%dist_numerics``: where the ranks' numbers part in a cell run with ``--numerics``, and
``%dist_numerics diff A B``: two runs of a cell compared op by op. Thin over
:meth:`distnb.CellResult.numerics` and :func:`distnb.analysis.reports.numerics_diff.diff_runs`."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from distnb.magics.support import parse, pool_or_usage_error, show_figure, usage_errors
from distnb.results import CellResult

__all__ = ["NumericsMagics", "find_result", "show_numerics"]


def find_result(token: str | None, ns: dict[str, Any]) -> CellResult:
    """A cell's result: a notebook variable holding one, the notebook's In[n] (or distnb's cell
    number) of a cell still in the pool's history, or ``_dist`` when none is named."""
    if token is None:
        token = "_dist"
    if isinstance(ns.get(token), CellResult):
        return ns[token]
    if token.isdigit():
        n = int(token)
        results = [c for c in pool_or_usage_error().history if isinstance(c, CellResult)]
        for found in [c for c in results if c.label == n] or [c for c in results if c.cell == n]:
            return found
        raise UsageError(f"no result of In[{n}] (or cell {n}) is kept (old cells' records are let go); keep one with `a = _dist` after it.")
    raise UsageError(f"{token!r} is neither a notebook variable holding a cell's result nor a cell number.")


def show_numerics(result: CellResult, plot: bool = True, **options: Any) -> Any:
    """The report of a ``--numerics`` cell shown: its text (or HTML table) and its plot."""
    from IPython.display import display

    with usage_errors():
        report = result.numerics(**options)
    display(report)
    if plot and report.records and report.mode != "collectives":
        show_figure(report.plot())
    return report


@magics_class
class NumericsMagics(Magics):
    """``%dist_numerics``."""

    @magic_arguments()
    @argument("words", nargs="*", help="[CELL] — a result variable or In[n] (default _dist) — or: diff A B.")
    @argument("--agree", default=None, metavar="RANKS",
              help="Ranks that ran the same data and must agree at every op: 0-3, groups 0,1;2,3, or a mesh dimension (tp).")
    @argument("--rtol", type=float, default=0.0, help="Relative tolerance on sums (default 0: bit for bit).")
    @argument("--atol", type=float, default=0.0, help="Absolute tolerance on sums (default 0: bit for bit).")
    @argument("--no-plot", action="store_true", help="Text only.")
    @line_magic
    def dist_numerics(self, line: str) -> Any:
        """Where ranks that must agree first part, op by op, in a cell run with %%on_ranks --numerics; where
        NaN/Inf was born and which collective spread it. `%dist_numerics diff A B`: two runs compared per rank."""
        args = parse(self.dist_numerics, line)
        ns: dict[str, Any] = self.shell.user_ns if self.shell is not None else {}
        words = list(args.words)
        if words and words[0] == "diff":
            if len(words) != 3:
                raise UsageError("usage: %dist_numerics diff A B (two result variables or In[n] numbers).")
            from distnb.analysis.reports.numerics_diff import diff_runs

            a, b = find_result(words[1], ns), find_result(words[2], ns)
            return diff_runs(a.label or a.cell, {r: x.numerics for r, x in a.results.items()},
                             b.label or b.cell, {r: x.numerics for r, x in b.results.items()}, args.rtol, args.atol)
        if len(words) > 1:
            raise UsageError("usage: %dist_numerics [CELL] [--agree RANKS] [--rtol X] [--atol X], or %dist_numerics diff A B.")
        show_numerics(find_result(words[0] if words else None, ns), not args.no_plot, agree=args.agree or (), rtol=args.rtol,
                      atol=args.atol)
        return None
