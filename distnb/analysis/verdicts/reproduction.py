"""Does a script fail the way the session did? A failure's signature, and the two compared.

A signature is what a failure is, with the noise of its consequences left out: the errors of the
ranks that raised their own (a peer's closed connection, an interrupt, a watchdog's abort are
consequences, never the failure), and the ranks that never finished (a hang). Two failures match
when the same ranks raised the same exception type with the same first line of message, and the
same ranks hung. Anything else is said, field by field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from distnb.analysis.verdicts.records import is_consequence
from distnb.ranks import format_ranks, group_by

__all__ = ["DIED", "FailureSignature", "compare_failures", "last_exception"]

#: A rank's "error" when its process died (a signal, no exception of its own).
DIED = "died"


@dataclass(frozen=True)
class FailureSignature:
    """The errors of their own, by rank (``ValueError: bad batch``), and the ranks that hung."""

    errors: dict[int, str] = field(default_factory=dict)
    hung: tuple[int, ...] = ()

    @classmethod
    def of(cls, errors: dict[int, str], hung: list[int] | tuple[int, ...] = ()) -> FailureSignature:
        """From every rank's error (``Ename: message``): consequences left out, messages cut to
        their first line (a traceback's own details, addresses and timings differ between runs)."""
        own = {r: _first_line(e) for r, e in sorted(errors.items()) if e and not is_consequence(e)}
        return cls(own, tuple(sorted(hung)))

    @property
    def failed(self) -> bool:
        return bool(self.errors or self.hung)

    def within(self, world_size: int) -> FailureSignature:
        """The failure as a pool of ``world_size`` ranks shows it, where it needs no other rank: the
        errors and hangs of ranks below ``world_size`` (a smaller world's try must match them)."""
        return FailureSignature({r: e for r, e in self.errors.items() if r < world_size}, tuple(r for r in self.hung if r < world_size))

    def text(self) -> str:
        # A death is recorded as the error "died" (it has no exception): said as such, not "raised died".
        parts = [f"{format_ranks(rs)} {what if what == DIED else 'raised ' + what}" for rs, what in group_by(sorted(self.errors.items()))]
        if self.hung:
            parts.append(f"{format_ranks(list(self.hung))} never finished (a hang)")
        return "; ".join(parts) if parts else "no failure"


def compare_failures(session: FailureSignature, script: FailureSignature) -> str:
    """"" when the script failed as the session did; else what differed, in words."""
    out = []
    for rank in sorted(set(session.errors) | set(script.errors)):
        mine, theirs = session.errors.get(rank), script.errors.get(rank)
        if mine != theirs:
            out.append(f"rank {rank}: {mine or 'no error of its own'} in the session, {theirs or 'no error of its own'} in the script")
    if session.hung != script.hung:
        out.append(f"hung: {format_ranks(list(session.hung)) if session.hung else 'none'} in the session, "
                   f"{format_ranks(list(script.hung)) if script.hung else 'none'} in the script")
    return "; ".join(out)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0].strip() if error.strip() else error


#: A traceback's last line: ``ValueError: bad batch`` (a dotted name allowed: ``torch.OutOfMemoryError``).
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|Failure)|[A-Z]\w*Error): ?(.*)$")


#: torchrun's prefix on a rank's lines in its log files (``[rank1]: Traceback …``).
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")


def last_exception(stderr: str) -> str | None:
    """The exception a rank's stderr ends with (``Ename: message``), from its last traceback;
    None when it holds no traceback."""
    lines = [_RANK_PREFIX.sub("", line, count=1) for line in stderr.splitlines()]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), default=None)
    if start is None:
        return None
    for line in lines[start + 1:]:
        m = _EXC_LINE.match(line) if not line.startswith((" ", "\t")) else None
        if m is not None:
            name = m.group(1).rsplit(".", 1)[-1]
            return f"{name}: {m.group(2).strip()}" if m.group(2).strip() else name
    return None
