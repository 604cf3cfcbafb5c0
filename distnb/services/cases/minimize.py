"""Cut a session's failure down on the live pool: delta debugging (Zeller's ddmin) over the cells,
then over each kept cell's top-level statements and its functions' bodies, then over the world
size, keeping the same failure signature.

Each try starts fresh rank processes (``Pool.restart``: the spares make it about a second), runs
the candidate cells in order, and compares the last cell's failure with the session's
(analysis/verdicts/reproduction.py): the same ranks raising the same errors, or the same ranks
hung at the try's bound. A try whose earlier cells fail, or whose last cell fails otherwise, does
not reproduce. Bounded by a time budget; one Ctrl-C stops it, keeping the smallest case found.

A smaller world is tried on a pool of its own (the session's pool keeps its ranks): the case
reproduces there when the ranks it keeps fail as they did in the session (``FailureSignature.within``)
— a raise on rank 1 of 4 needs 2 ranks, a rank 3 that skipped a barrier needs all 4. Two ranks is
the floor: one rank turns every collective into a copy, which is no longer the failure.
"""

from __future__ import annotations

import ast
import textwrap
import time
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence, TypeVar

from distnb.analysis.cell_parts import function_bodies, replace_body, statements
from distnb.analysis.names import bindings, read_before_bound
from distnb.analysis.verdicts.reproduction import FailureSignature, compare_failures
from distnb.config import LaunchConfig
from distnb.controller.session import CellRecord
from distnb.ranks import format_ranks
from distnb.results import CellResult
from distnb.services.cases import code_cuts
from distnb.services.cases.export import export_notebook, export_script
from distnb.services.cases.minimal_case import Candidate, Minimized, case_size, weight, where
from distnb.services.cases.verify import session_signature, verify_script

T = TypeVar("T")

__all__ = ["Runs", "failing_lines", "minimize", "setup_bound", "try_bound", "world_sizes", "write_case"]


@dataclass(frozen=True)
class Runs:
    """What a try needs of a pool: fresh ranks, a cell run on them (not kept in the session's
    history), and a cell left running stopped; ``smaller`` starts a pool of fewer ranks for the
    world-size pass (None: it can't, e.g. a pool spanning machines)."""

    restart: Callable[[], object]
    run: Callable[[str, list[int], float], CellResult]
    stop: Callable[[CellResult], object]
    world_size: int = 0
    smaller: Callable[[int], AbstractContextManager[Runs]] | None = None


class Fails(Protocol):
    def __call__(self, candidate: list[Candidate], runs: Runs | None = None, signature: FailureSignature | None = None) -> bool: ...


def write_case(found: Minimized, config: LaunchConfig, path: str | Path, verify: float | None) -> None:
    """The case as a script for torchrun (``path``.py, run once to verify it) and a notebook beside
    it, for the world size the case needs."""
    if found.world_size and found.world_size != config.world_size and config.nnodes == 1:
        config = replace(config, nproc=found.world_size)
    base = Path(path).with_suffix("")
    steps = [CellRecord(i + 1, c.code, c.ranks, i < len(found.cells) - 1) for i, c in enumerate(found.cells)]
    found.script = str(export_script(steps, config, base.with_suffix(".py"), hang=bool(found.signature and found.signature.hung)))
    found.notebook = str(export_notebook(steps, config, base.with_suffix(".ipynb")))
    if verify is not None:
        found.verified = verify_script(found.script, config, found.signature, verify)


def try_bound(failing: CellResult | CellRecord) -> float:
    """How long one try may run a cell: a hang is what the session saw at its cell's timeout, so
    the same time (and a little) shows it again; an error may take longer on a busier machine."""
    if not isinstance(failing, CellResult):
        return 15.0
    return max(5.0, failing.elapsed + 2.0) if failing.timed_out else max(5.0, 3 * failing.elapsed)


def minimize(pool: Runs, history: Sequence[CellResult | CellRecord], budget: float,
             on_progress: Callable[[str], None] | None = None, bound: float | None = None) -> Minimized:
    """The session's last failed cell and the cells before it, cut down while the failure stays."""
    last = next((i for i in range(len(history) - 1, -1, -1) if not history[i].ok), None)
    if last is None:
        raise ValueError("no cell of this session has failed: there is nothing to minimize. Run the failing cell first.")
    failing = history[last]
    target = session_signature(failing)
    if target is None:
        raise ValueError("the failing cell's errors are no longer kept (only the newest cells' are): run it again, then minimize.")
    if not target.failed:
        raise ValueError("the failing cell ended without an error of its own (interrupted, or only a peer's failure): minimize needs "
                         "a failure it can recognise — run the cell again with --timeout, so a hang ends as one.")
    cells = [Candidate(c.code, tuple(c.ranks), c.elapsed if isinstance(c, CellResult) else 0.0) for c in history[: last + 1]
             if c.ok or c is failing]
    limit = bound if bound is not None else try_bound(failing)
    world = pool.world_size or 1 + max(r for c in cells for r in c.ranks)
    state = Minimized(cells, target, case_size(cells), world_size=world, started_world=world)
    t0 = time.monotonic()
    say = on_progress or (lambda _text: None)
    on = [pool]  # the pool the tries run on: the session's, or a smaller one the world-size pass kept

    tried: dict[tuple[object, ...], bool] = {}  # a case tried once is not run again (ddmin's passes meet the same ones)
    # Names the session reads and never sets come from its namespace (rank, dist, a %dist_push).
    provided = read_before_bound([c.code for c in cells]) or set()
    took: list[float] = []  # each try's seconds

    def fails(candidate: list[Candidate], runs: Runs | None = None, signature: FailureSignature | None = None) -> bool:
        key = ((runs or on[0]).world_size, (signature or state.signature).text(), *candidate)
        if key in tried:
            return tried[key]
        why_not = _unrun(candidate, state.needed, provided)
        if why_not:
            state.unrun[why_not] = state.unrun.get(why_not, 0) + 1
            tried[key] = False
            return False
        # The budget is kept: a try is not started when one like the longest so far (a hang runs
        # to its bound) would end past it.
        if time.monotonic() - t0 + max(took, default=0.0) > budget:
            raise _Budget
        state.tries += 1
        started = time.monotonic()
        why_not = _reproduces(runs or on[0], candidate, signature or state.signature, limit)
        took.append(time.monotonic() - started)
        ok = tried[key] = not why_not
        n, s = case_size(candidate)
        cur = state.size()
        say(f"minimizing: {cur[0]} cells, {cur[1]} statements · try {state.tries} ({n} cells, {s} statements): "
            f"{'still fails' if ok else why_not} · {time.monotonic() - t0:.0f} s of {budget:.0f}")
        return ok

    lines = failing_lines(failing)
    failing_code = failing.code.splitlines()
    state.needed = {text for n in lines if 0 < n <= len(failing_code) and (text := failing_code[n - 1].strip())}
    with ExitStack() as pools:
        try:
            code_cuts.slice_case(state, lines, fails)
            code_cuts.inline_settings(state, fails)
            code_cuts.unshare(state, fails)
            _shrink(state, fails)
            if pool.smaller is not None and (smaller := _cut_world(state, pool, pools, fails, say)) is not None:
                on[0] = smaller
                _shrink(state, fails)  # each try is cheaper on fewer ranks, and a rank's own code may go now
        except _Budget:
            state.stopped = "the time budget ran out"
        except KeyboardInterrupt:
            state.stopped = "interrupted"
    state.seconds = time.monotonic() - t0
    return state


def _unrun(candidate: list[Candidate], needed: set[str], provided: set[str]) -> str:
    """Why ``candidate`` need not be tried, known from its code alone; "" when it must be."""
    code = [c.code for c in candidate]
    if len(where(needed, "\n".join(code))) < len(needed):
        return "without a line where the session's ranks raised or waited"
    if (read_before_bound(code) or set()) - provided:
        return "reading a name before anything in the case sets it: a NameError, not the failure"
    return ""


class _Budget(Exception):
    pass


def failing_lines(failing: CellResult | CellRecord) -> set[int]:
    """The failing cell's lines where its ranks raised, or wait (empty: not known)."""
    if not isinstance(failing, CellResult):
        return set()
    lines = {int(line) for res in failing.results.values() if res.error and (line := res.error.get("line"))}
    if failing.verdict is not None:
        lines |= {p.line for p in failing.verdict.positions if p.line and p.line_cell in (None, failing.cell)}
    return lines


def _shrink(state: Minimized, fails: Fails) -> None:
    """Passes over cells, statements and function bodies, again while one shrinks the case: a
    cell becomes unneeded once the statements that used it are gone."""
    while True:
        before = weight(state.cells)
        code_cuts.reslice(state, fails)
        _cut_cells(state, fails)
        # The failing cell first, its blocks included: what it stops reading, the slice then drops
        # from the cells before it, each of which would otherwise cost tries of its own.
        _cut_statements(state, fails, [len(state.cells) - 1])
        code_cuts.reslice(state, fails)
        _cut_bodies(state, fails, [-1], reslice=True)
        _cut_statements(state, fails, range(len(state.cells) - 1))
        _cut_bodies(state, fails, range(len(state.cells) - 1))
        if weight(state.cells) >= before:
            return


def world_sizes(world_size: int) -> list[int]:
    """The smaller worlds worth a try, smallest first: each size up to 8, then halvings."""
    if world_size <= 8:
        return list(range(2, world_size))
    sizes, n = [], world_size // 2
    while n >= 2:
        sizes.append(n)
        n //= 2
    return sorted(sizes)


def _within(cells: list[Candidate], world_size: int) -> list[Candidate] | None:
    """The case's cells on the first ``world_size`` ranks; None when a cell keeps no rank."""
    out = [replace(c, ranks=tuple(r for r in c.ranks if r < world_size)) for c in cells]
    return out if all(c.ranks for c in out) else None


def _cut_world(state: Minimized, pool: Runs, pools: ExitStack, fails: Fails, say: Callable[[str], None]) -> Runs | None:
    """The smallest world in which the ranks that remain fail as they did: its pool is kept
    (closed with ``pools``) for the passes after, and the case and its signature are restricted to it."""
    assert pool.smaller is not None
    for n in world_sizes(state.world_size):
        target, cells = state.signature.within(n), _within(state.cells, n)
        if not target.failed or cells is None:
            continue  # the failure is on ranks this world lacks
        say(f"minimizing: trying {n} ranks (of {state.world_size})")
        with ExitStack() as trial:
            try:
                runs = trial.enter_context(pool.smaller(n))
            except Exception as exc:  # the case found so far stands; only the smaller worlds are not tried
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                state.steps.append(f"kept {state.world_size} ranks: a pool of {n} did not start ({why})")
                return None
            if fails(cells, runs, target):
                pools.enter_context(trial.pop_all())
                state.steps.append(f"removed {state.world_size - n} of the {state.world_size} ranks: "
                                   f"{format_ranks(range(n))} fail as they did ({target.text()})")
                state.cells, state.signature, state.world_size = cells, target, n
                return runs
    return None


def _cut_cells(state: Minimized, fails: Fails) -> None:
    """The cells before the failing one (which stays)."""
    kept = _ddmin(state.cells[:-1], lambda sub: fails([*sub, state.cells[-1]]))
    if len(kept) < len(state.cells) - 1:
        state.steps.append(f"removed {len(state.cells) - 1 - len(kept)} of the {len(state.cells) - 1} cells before the failing one")
    state.cells = [*kept, state.cells[-1]]


def _cut_statements(state: Minimized, fails: Fails, which: Sequence[int]) -> None:
    """The top-level statements of the cells ``which`` (indices into the case's cells)."""
    for i in which:
        cell = state.cells[i]
        parts = statements(cell.code)
        if len(parts) < 2:
            continue

        def with_cell(sub: list[str], i: int = i, cell: Candidate = cell) -> list[Candidate]:
            return [*state.cells[:i], replace(cell, code="\n".join(sub)), *state.cells[i + 1:]]

        keep = _ddmin(parts, lambda sub: bool(sub) and fails(with_cell(sub)))
        if len(keep) < len(parts):
            which_cell = "the failing cell" if i == len(state.cells) - 1 else f"cell {i + 1} of the case"
            state.steps.append(f"removed {len(parts) - len(keep)} of the {len(parts)} statements of {which_cell}")
            state.cells = with_cell(keep)


def _cut_bodies(state: Minimized, fails: Fails, which: Sequence[int], reslice: bool = False) -> None:
    """The statements inside the functions the cells ``which`` define (a step function, a forward)
    and inside their blocks (a training loop, the accumulation loop in it), outermost first: a
    block cut away takes the blocks inside it along. ``reslice``: slice again after each block that
    shrank (``which`` then counts from the end, as the slice may drop whole cells): a training
    loop's schedule and optimizer step cut away take the optimizer's set-up (and its imports) out
    of every try after."""
    for at in which:
        k = 0
        while k < len(bodies := function_bodies(state.cells[at].code)):
            i = at % len(state.cells)
            cell = state.cells[i]
            name, body = bodies[k]
            if len(body) > 1:

                def with_body(sub: list[str], i: int = i, k: int = k, cell: Candidate = cell) -> list[Candidate]:
                    return [*state.cells[:i], replace(cell, code=replace_body(cell.code, k, sub)), *state.cells[i + 1:]]

                guess = _holding_and_binders(body, state.needed)
                if guess is not None and fails(with_body(guess)):
                    # The statement the failure is in, and what binds the names it reads: a loop's
                    # schedule, evaluation and logging gone in one try; then the few left, by trying.
                    keep = _ddmin(guess, lambda sub: fails(with_body(sub)))
                else:
                    keep = _ddmin(body, lambda sub: fails(with_body(sub)))
                if len(keep) < len(body):
                    state.steps.append(f"removed {len(body) - len(keep)} of the {len(body)} statements of {name}")
                    state.cells = with_body(keep)
                    if reslice:
                        code_cuts.reslice(state, fails)
            k += 1


def _holding_and_binders(body: list[str], needed: set[str]) -> list[str] | None:
    """Of a block's statements, those holding a line where the session's ranks raised or waited,
    with every statement of the block that binds a name they read before binding it (again for
    those, a loop's body read once through); None when no statement holds such a line or all would
    stay. Only names bound, not objects changed: a guess, tried once."""
    holding = {j for j, part in enumerate(body) if where(needed, part)}
    if not holding:
        return None
    try:
        binds = [set(bindings(ast.parse(textwrap.dedent(part)))) for part in body]
    except SyntaxError:  # a continuation line indented less than its statement: not read alone
        return None
    keep = set(holding)
    while True:
        reads = read_before_bound([textwrap.dedent("\n".join(body[j] for j in sorted(keep)))]) or set()
        more = {j for j in range(len(body)) if j not in keep and binds[j] & reads}
        if not more:
            break
        keep |= more
    return [body[j] for j in sorted(keep)] if len(keep) < len(body) else None


def setup_bound(cell: Candidate, limit: float) -> float:
    """How long an earlier cell of a try may run: what it took in the session, three times and a
    little (a model's set-up, DDP's first sync, an import, take longer than the failing cell's
    bound), or a minute when that is not known."""
    return max(limit, 3 * cell.seconds + 5.0) if cell.seconds else max(limit, 60.0)


def _reproduces(pool: Runs, cells: list[Candidate], target: FailureSignature, limit: float) -> str:
    """One try on fresh ranks: the cells before the last must succeed, the last fail as ``target``.
    "" when it did; else why the try does not count, in words."""
    pool.restart()
    for n, cell in enumerate(cells[:-1], 1):
        res = pool.run(cell.code, list(cell.ranks), setup_bound(cell, limit))
        if not res.ok:
            pool.stop(res)
            got = session_signature(res)
            return f"cell {n} of the try {'timed out' if res.timed_out else 'failed'}" + (f" ({got.text()})" if got and got.failed else "")
    res = pool.run(cells[-1].code, list(cells[-1].ranks), limit)
    got = session_signature(res)
    pool.stop(res)  # a hang reproduced leaves ranks running: the next try restarts them anyway
    if got is None or not got.failed:
        return "passed" if res.ok else "ended without a failure of its own"
    return f"failed otherwise ({got.text()})" if compare_failures(target, got) else ""


def _ddmin(items: Sequence[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """The smallest sublist (1-minimal, in Zeller's sense) for which ``fails`` still holds, found by
    removing complements of ever finer chunks; ``fails(items)`` is assumed."""
    current, n = list(items), 2
    while len(current) > 1:
        chunk = max(1, len(current) // n)
        parts = [current[i:i + chunk] for i in range(0, len(current), chunk)]
        complement = next((c for j in range(len(parts)) if fails(c := [x for k, p in enumerate(parts) if k != j for x in p])), None)
        if complement is not None:
            current, n = complement, max(n - 1, 2)
        elif n >= len(current):
            return current
        else:
            n = min(n * 2, len(current))
    return [] if current and fails([]) else current
