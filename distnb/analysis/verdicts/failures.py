"""What a failed cell's errors mean and which of their lines matter: a collective's timeout
in gloo's and NCCL's words, a dead rank's stderr cut to what explains the death, and the part of
each rank's message that differs from the others'."""

from __future__ import annotations

import re

from distnb._text import fit
from distnb.wire.record_types import CellError

__all__ = ["CrashDumpFold", "cut_message", "differing_messages", "fold_crash_dump", "holders_words", "is_timeout", "salient_lines"]

#: Error texts that mean a collective timed out (gloo's and NCCL's words).
_TIMEOUT_MARKS = re.compile(r"Timed out waiting|Application timeout caused pair closure|Watchdog caught collective operation timeout|"
                            r"Socket Timeout|wait timeout after", re.IGNORECASE)


def is_timeout(error: CellError | str) -> bool:
    """Did this cell error (or a rank's ``Ename: message``) come from a collective timing out?"""
    return bool(_TIMEOUT_MARKS.search(error if isinstance(error, str) else error.get("evalue", "")))


_NOISE = re.compile(r"^\s*(frame #\d+:|<omitting python frames>|Exception raised from |File \"|\^+$|Extension modules: |"
                    r"Thread 0x[0-9a-f]+ \(most recent call first\):$)")  # other threads' headers: their frames are noise
_KEY = re.compile(r"terminate called|what\(\):|enforce fail|Fatal Python error|[A-Za-z]*(Error|Exception)\b|Segmentation fault|Aborted")


def cut_message(text: str, limit: int = 300) -> str:
    """A message kept whole when short, else cut at a line boundary (or, for one long line, at a
    word) with "…": never mid-word inside a headline."""
    text = text.strip()
    if len(text) <= limit:
        return text
    kept = ""
    for line in text.splitlines():
        if len(kept) + len(line) + 1 > limit:
            break
        kept = f"{kept}\n{line}" if kept else line
    if not kept:
        return fit(text.splitlines()[0], limit)
    return kept.rstrip(" ,;:") + " …"


#: Python's faulthandler dump, which a rank killed by a signal writes to its stderr.
_DUMP_START = re.compile(r"^Fatal Python error: ")
_DUMP_LINE = re.compile(r"^(\s*$|Thread 0x[0-9a-f]+ \(most recent call first\):|Current thread 0x[0-9a-f]+ \(most recent call first\):|"
                        r"  File \"|  <no Python frame>|  \.\.\.|Python runtime state: |Extension modules: )")


class CrashDumpFold:
    """Python's crash dump (faulthandler's, which a rank killed by a signal writes to its stderr)
    folded out of one rank's stderr, line by line, so that the live view can fold a dump that
    arrives over several reads: its first line stays, marked; its thread and frame lines go. A
    rank that dies of it has its death report say the dump once, cut to the user's frames; the raw
    text stays on the rank's result."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.inside = False

    def line(self, line: str) -> str | None:
        """The line as shown, or None where it is part of a dump."""
        if _DUMP_START.match(line):
            self.inside = True
            # Said so that it is true whether the rank dies of it (its death report then shows the
            # cell's frames) or a child process of the rank wrote it (a DataLoader worker's crash).
            return f"{line} (Python's crash dump, folded here: the whole of it is in _dist[{self.rank}].stderr)"
        if self.inside and _DUMP_LINE.match(line):
            return None
        self.inside = False
        return line

    def lines(self, lines: list[str]) -> list[str]:
        """The next of the rank's lines, as shown."""
        return [shown for line in lines if (shown := self.line(line)) is not None]


def fold_crash_dump(stderr: str, rank: int) -> str:
    """A dead rank's whole stderr with each crash dump folded into one line (:class:`CrashDumpFold`)."""
    return "\n".join(CrashDumpFold(rank).lines(stderr.split("\n")))


#: How to make again each kind of object that holds a process group.
_REMAKE = {
    "DistributedDataParallel": "DDP(model.module, ...)",
    "FullyShardedDataParallel": "FSDP(module, ...)",
    "FSDPModule": "fully_shard(...) on a new mesh",
    "DeviceMesh": "init_device_mesh(...)",
    "ProcessGroup": "dist.new_group(...)",
}


def holders_words(held: dict[str, str]) -> str:
    """```model` (DistributedDataParallel: make it again, DDP(model.module, ...)); `mesh` (DeviceMesh …)``."""
    return "; ".join(f"`{name}` ({kind}: make it again, {_REMAKE.get(kind, 'as it was made')})" for name, kind in sorted(held.items()))


def differing_messages(ename: str, messages: list[tuple[int, str]]) -> str:
    """Under a group's one traceback: each rank's own message, cut to the lines that are not the
    same on every rank (a long library message often differs in one line: "… for rank 1: 2 3")."""
    if len({m for _, m in messages}) < 2:
        return ""
    common = set.intersection(*(set(m.splitlines()) for _, m in messages))
    rows = []
    for rank, message in messages:
        own = [line.strip() for line in message.splitlines() if line not in common and line.strip()]
        shown = " / ".join(own[:3]) + (" / …" if len(own) > 3 else "")
        rows.append(f"  rank {rank}: {shown[:300] + ('…' if len(shown) > 300 else '')}")
    where = f"the {ename} messages differ" if common else f"each rank's {ename}"
    return f"\n  {where}:\n" + "\n".join(rows)


def salient_lines(text: str, limit: int = 12) -> list[str]:
    """A dead rank's stderr, cut to what explains the death: the error lines (gloo's enforce
    failure, ``what():``, Python's fatal error) first, then the last other lines; C++ frame
    listings and library frames, which can run to hundreds of lines after the message, are left
    out (cell frames stay)."""
    lines = [line for line in text.rstrip().splitlines() if line.strip()]
    useful = [i for i, line in enumerate(lines) if not _NOISE.match(line) or "<cell-" in line]
    key = [i for i in useful if _KEY.search(lines[i])][:4]
    rest = [i for i in useful if i not in key][-(limit - len(key)):] if limit > len(key) else []
    return [lines[i] for i in sorted(set(key) | set(rest))]
