"""The minimizer's cuts read from the code (analysis/): each is one guess, one try, kept only when
the case still fails as the session did — what the failing lines need by the cells' data flow (the
slice, again after a cut shrank the case), the settings written in where they are read with the
``with`` blocks over a context that does nothing, and the slice without what it keeps only for
process-wide state. Delta debugging (services/cases/minimize.py) cuts the rest by trying."""

from __future__ import annotations

from dataclasses import replace

from distnb.analysis.cell_parts import statements
from distnb.analysis.inlining import inline_constants
from distnb.analysis.null_contexts import unwrap_null_contexts
from distnb.analysis.slicing import read_statements, slice_cells
from distnb.services.cases.minimal_case import Candidate, Minimized, Try, case_size, weight, where

__all__ = ["inline_settings", "reslice", "slice_case", "unshare"]


def slice_case(state: Minimized, lines: set[int], fails: Try) -> None:
    """One try of what the failing ``lines`` (none: the failing cell as it is now) need by the
    cells' data flow (analysis/slicing.py), kept when it still fails, so that the tries after start
    from it. Again after a pass shrank the case: a statement cut takes its reads with it."""
    state.sliced_at = weight(state.cells)
    sliced = _sliced(state, lines, keep_shared=True)
    if sliced is None:
        return
    before, after = state.size(), case_size(sliced)
    what = "the failing line needs" if lines else "the failing cell needs now"
    _take(state, sliced, fails,
          f"kept the {after[1]} of {before[1]} statements {what} by the names they set and read, "
          "and every call into torch.distributed (read from the code, one try)",
          f"the {after[1]} statement{'s' * (after[1] != 1)} {what} by its names did not fail alone: cut by trying")


def _take(state: Minimized, sliced: list[Candidate], fails: Try, took: str, refused: str) -> None:
    """One try of a slice: the case from now on where it still fails (``took`` said), else ``refused``."""
    if fails(sliced):
        state.steps.append(took)
        state.cells = sliced
        state.sliced_at = weight(sliced)
    else:
        state.steps.append(refused)


def _sliced(state: Minimized, lines: set[int], keep_shared: bool) -> list[Candidate] | None:
    """The case cut to the slice from ``lines`` (slice_cells); None when it can't be read or is
    not smaller, or the failing cell would be left empty."""
    kept = slice_cells([c.code for c in state.cells], lines, keep_shared)
    if kept is None or not any(kept[-1:]):
        return None
    parts = [statements(c.code) for c in state.cells]
    sliced = [replace(c, code="\n".join(parts[i][j] for j in keep)) for i, (c, keep) in enumerate(zip(state.cells, kept))
              if keep or i == len(state.cells) - 1]
    return sliced if case_size(sliced)[1] < state.size()[1] else None


def unshare(state: Minimized, fails: Try) -> None:
    """One try of the slice without what it keeps only for the process-wide state it sets (a seed,
    torch's defaults, an environment variable: later statements may read it without naming it):
    most failures do not need a pasted script's ``torch.manual_seed(1337 + seed_offset)``, and
    the names those statements read go with them."""
    sliced = _sliced(state, _failing_lines(state), keep_shared=False)
    if sliced is None:
        return
    parsed = read_statements([c.code for c in state.cells]) or []
    kept = {s.strip() for c in sliced for s in statements(c.code)}
    gone = [s.source.strip().splitlines()[0] for cell in parsed for s in cell if s.shared and s.source.strip() not in kept]
    if not gone:
        return
    shown = ", ".join(f"`{g}`" for g in gone[:3]) + (", …" if len(gone) > 3 else "")
    _take(state, sliced, fails,
          f"removed {state.size()[1] - case_size(sliced)[1]} statements kept for the process-wide state they set ({shown}) "
          "and what only they read (one try)",
          f"kept the statements that set process-wide state ({shown}): without them the case did not fail the same way")


def _failing_lines(state: Minimized) -> set[int]:
    """The failing cell's lines that still hold where the session's ranks raised or waited."""
    return {n for lines in where(state.needed, state.cells[-1].code).values() for n in lines}


def reslice(state: Minimized, fails: Try) -> None:
    """The slice again once a cut shrank the case (cut statements took their reads with them),
    from the failing lines where they still are, and the settings written in again (a setting
    changed twice, ``n = 0`` and ``n += 1``, is one once the change is cut)."""
    if weight(state.cells) < state.sliced_at:
        slice_case(state, _failing_lines(state), fails)
        inline_settings(state, fails)


def inline_settings(state: Minimized, fails: Try) -> None:
    """One try of the case with its settings written in where they are read (analysis/inlining.py)
    and each ``with`` over a context that does nothing written as its body
    (analysis/null_contexts.py): a pasted script's configuration block is most of what a sliced
    case keeps, and its ``ctx = nullcontext()`` (autocast on a GPU) three statements more."""
    codes = [c.code for c in state.cells]
    got = inline_constants(codes)
    codes, names = got if got is not None else (codes, [])
    unwrapped = unwrap_null_contexts(codes)
    codes, withs = unwrapped if unwrapped is not None else (codes, 0)
    cells = [replace(c, code=code) for i, (c, code) in enumerate(zip(state.cells, codes)) if code.strip() or i == len(codes) - 1]
    if not (names or withs) or case_size(cells)[1] >= state.size()[1]:
        return
    what = []
    if names:
        shown = ", ".join(names[:6]) + (", …" if len(names) > 6 else "")
        what.append(f"{len(names)} setting{'s' * (len(names) != 1)} in where {'they are' if len(names) != 1 else 'it is'} read ({shown}")
    if withs:
        blocks = f"{withs} `with` block{'s' * (withs != 1)} over nullcontext() as {'their bodies' if withs != 1 else 'its body'}"
        what.append(f"; {blocks}" if names else blocks)
    # A needed line that read a setting reads its value now: it is looked for as the inlined case writes it.
    needed, state.needed = state.needed, set(where(state.needed, "\n".join(c.code for c in cells)))
    if fails(cells):
        state.steps.append(f"wrote {''.join(what)}{'; one try)' if names else ' (one try)'}")
        state.cells = cells
    else:
        state.needed = needed
        kept = " and ".join([*(["the settings as statements"] if names else []), *(["the `with nullcontext()` blocks"] if withs else [])])
        said = f"kept {kept}: with {''.join(what)}{')' if names else ''} written in, the case did not fail the same way"
        if said not in state.steps:  # each slice after a cut asks again (a case tried once is not run again)
            state.steps.append(said)
