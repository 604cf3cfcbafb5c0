"""The case the minimizer cuts (services/cases/minimize.py): its cells, the smallest found so far with
the account of what went, and the measures every pass compares (cells and top-level statements,
characters, where the failing lines still are)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from distnb.analysis.cell_parts import statements
from distnb.analysis.verdicts.reproduction import FailureSignature
from distnb.ranks import format_ranks
from distnb.services.cases.verify import Reproduction

__all__ = ["Candidate", "Minimized", "Try", "case_size", "weight", "where"]


@dataclass(frozen=True)
class Candidate:
    """A cell of the case: its code and the ranks it runs on."""

    code: str
    ranks: tuple[int, ...]
    #: The session's time for the cell: an earlier cell of a try gets a bound from it (0: not known).
    seconds: float = field(default=0.0, compare=False)


@dataclass
class Minimized:
    """The smallest case found: its cells, what was removed, and what it took."""

    cells: list[Candidate]
    signature: FailureSignature
    started_with: tuple[int, int]  # (cells, statements) of the session's case
    tries: int = 0
    #: Cases not tried, by why: known to fail otherwise, or to pass, from their code alone.
    unrun: dict[str, int] = field(default_factory=dict)
    #: The failing cell's lines where ranks raised or waited, as written: a case without them does not fail the same way.
    needed: set[str] = field(default_factory=set, repr=False)
    world_size: int = 0  # the ranks the case needs (the session's world size where none could go)
    started_world: int = 0
    seconds: float = 0.0
    stopped: str = ""  # why it stopped before the end: "interrupted", "budget"
    steps: list[str] = field(default_factory=list)  # the account of what was removed
    script: str = ""  # where the case was written (write_case), and what running the script showed
    notebook: str = ""
    verified: Reproduction | None = None
    sliced_at: int = field(default=0, repr=False)  # the case's weight when last sliced: sliced again once it shrank

    def size(self) -> tuple[int, int]:
        return case_size(self.cells)

    def text(self) -> str:
        cells, stmts = self.size()
        ranks = f" on {self.world_size} ranks (the session had {self.started_world})" if self.world_size < self.started_world else ""
        head = (f"minimized: {self.started_with[0]} cells, {self.started_with[1]} statements → {cells} "
                f"cell{'s' * (cells != 1)}, {stmts} statement{'s' * (stmts != 1)}{ranks}; it still fails as the session did "
                f"({self.signature.text()}); {self.tries} tries in {self.seconds:.0f} s")
        if self.stopped:
            head += f" (stopped early: {self.stopped}; the smallest case found so far)"
        steps = [*self.steps, *(f"{n} case{'s' * (n != 1)} not tried ({why})" for why, n in self.unrun.items())]
        lines = [head, *(f"  {s}" for s in steps)]
        if self.script:
            lines.append(f"wrote {self.script} and {self.notebook}")
        if self.verified is not None:
            lines.append(self.verified.text())
        return "\n".join(lines)

    def code(self) -> str:
        """The case as cells, ``# ---- cell N`` between them."""
        return "\n\n".join(f"# ---- cell {i + 1} ({format_ranks(list(c.ranks))})\n{c.code}" for i, c in enumerate(self.cells))


def case_size(cells: Sequence[Candidate]) -> tuple[int, int]:
    """Cells and top-level statements."""
    return len(cells), sum(len(statements(c.code)) for c in cells)


def where(needed: set[str], code: str) -> dict[str, list[int]]:
    """Each of the ``needed`` lines (as written, stripped) that ``code`` still holds, and the
    numbers of the lines holding it."""
    found: dict[str, list[int]] = {}
    for n, line in enumerate(code.splitlines(), 1):
        for text in needed:
            if text in line.strip():
                found.setdefault(text, []).append(n)
    return found


#: A try of a candidate case: whether it still fails as the session did.
Try = Callable[[list["Candidate"]], bool]


def weight(cells: list[Candidate]) -> int:
    return sum(len(c.code) for c in cells)
