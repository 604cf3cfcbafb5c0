"""A rank waiting for a line from the notebook (pdb's next command, or ``input()``), as the tracker
files it for the running cell; :mod:`distnb.services.debugger` answers it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from distnb.cell_names import cell_name
from distnb.wire.protocol import StdinRequest

__all__ = ["Prompt"]


@dataclass
class Prompt:
    """A rank waiting for a line: pdb's next command (``kind`` "pdb") or ``input()`` ("input")."""

    rank: int
    id: int
    cell: int
    kind: str
    prompt: str
    output: str  # pdb's answer to the previous command
    where: dict[str, Any] | None
    mode: str  # "breakpoint" or "post_mortem"
    asked: float = field(default_factory=time.monotonic)
    shown: bool = False  # the console has shown its output
    answered: bool = False  # a line was sent: the rank is running again until its next prompt

    @classmethod
    def of(cls, rank: int, msg: StdinRequest) -> Prompt:
        return cls(rank, msg["id"], msg["cell"], msg["kind"], msg["prompt"], msg["output"], msg["where"], msg["mode"])

    def place(self) -> str:
        """``cell 7 line 4 (x = y.sum())``, ``step() (cell 2 line 11)``, ``torch/nn/functional.py:2037 in relu()``."""
        w = self.where
        if not w:
            return "an unknown place"
        code = f" ({w['code']})" if w.get("code") else ""
        if w.get("cell") is None:
            return f"{w['file']}:{w['line']} in {w['func']}(){code}"
        if w.get("func") not in (None, "<module>"):
            return f"{w['func']}() ({cell_name(w['cell'])} line {w['line']}){code}"
        return f"{cell_name(w['cell'])} line {w['line']}{code}"

    @property
    def before(self) -> dict[str, Any] | None:
        """The collective the rank is paused before, nothing issued yet (pdb's ``nc``, the console's
        hold): op, group, members, desc, args, sizes, dtypes, cell, line, why; None otherwise."""
        return (self.where or {}).get("before")

    def source(self) -> str:
        """The lines around the paused one, the paused one marked."""
        w = self.where or {}
        width = len(str(max((n for n, _ in w.get("context", [])), default=0)))
        return "\n".join(f"  {'->' if n == w.get('line') else '  '} {n:>{width}} | {text}" for n, text in w.get("context", []))
