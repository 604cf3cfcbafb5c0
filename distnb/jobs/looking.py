"""Which job the notebook's read-only views look into — one attached (``AttachedJob``), one read
from outside (``BareJob``), or one loaded from its records (``LoadedJob``) — and what ``%dist_status``
shows of one. One at a time: looking into a job leaves the last."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from distnb.services.cases.reproduce import Reproduced

__all__ = ["AttachStatus", "JobView", "current_job", "look_into", "stop_looking"]


class JobView(Protocol):
    """A job the read-only views look into instead of a pool: one attached
    (:class:`distnb.jobs.attached.AttachedJob`), one read from outside
    (:class:`distnb.jobs.bare.BareJob`) or one loaded from the records it left
    (:class:`distnb.jobs.loaded.LoadedJob`)."""

    job: str

    def describe(self) -> str:
        """``attached to job X`` · ``looking into the records of job X``: for the magics' words."""
        ...

    def detach(self) -> None:
        """Leave the job (the job itself is not changed)."""
        ...

    def reproduce(self, path: str | None = None, ranks: int | None = None) -> Reproduced:
        """Write the notebook that stands in for the job (``%dist_reproduce``), on a pool of the job's
        world size or of ``ranks``."""
        ...


#: The job the notebook looks into, if any (one at a time: attaching or loading leaves the last).
_current: list[JobView] = []


@dataclass
class AttachStatus:
    """What ``%dist_status`` shows for an attached job (and, with its own heading, a loaded one,
    ``distnb.jobs.loaded.LoadStatus``): a line per rank, the notes and the diagnosis."""

    job: str
    world_size: int
    rows: list[tuple[int, int | None, str]]  # rank, pid, state in words
    verdict: str = ""
    notes: list[str] = field(default_factory=list)

    def heading(self) -> str:
        return f"attached to job {self.job} (read-only): {self.world_size} ranks"

    def text(self) -> str:
        lines = [self.heading()]
        lines += [f"  rank {r}: pid {pid if pid is not None else '?'}, {state}" for r, pid, state in self.rows]
        lines += [f"  {n}" for n in self.notes]
        if self.verdict:
            lines.append(self.verdict)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


def look_into(job: JobView) -> None:
    """From now, the read-only views look into ``job``; the job looked into before is left."""
    for old in list(_current):
        old.detach()
    _current.append(job)


def stop_looking(job: JobView) -> None:
    """``job`` is no longer the one the views look into (its ``detach`` calls this)."""
    if job in _current:
        _current.remove(job)


def current_job() -> JobView | None:
    """The job the read-only views look into (attached or loaded), if any."""
    return _current[-1] if _current else None
