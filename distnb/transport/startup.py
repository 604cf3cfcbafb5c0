"""Waiting for a launch to become ready, fresh ranks under a running one, and their spares.

Over any :class:`~distnb.transport.base.RankTransport`: a start fails fast with the transport's
first failure (root cause first) and at ``start_timeout`` with its account of the ranks still
missing; the words for both are the transport's (``torchrun_ranks.py`` for real processes).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from distnb import _processes
from distnb.config import LaunchConfig
from distnb.controller.requests import Transport
from distnb.controller.tracker import Tracker
from distnb.errors import LaunchError
from distnb.states import RankState
from distnb.transport.base import RankTransport
from distnb.wire.peers import supervisor_identity
from distnb.wire.protocol import Msg

__all__ = ["wait_ready", "respawn", "request_spares", "OnProgress", "OnNote", "RESPAWN_TIMEOUT"]

OnProgress = Callable[[dict[int, RankState]], None]
OnNote = Callable[[str], None]

#: Seconds a respawn may take before the restart falls back to starting torchrun anew.
RESPAWN_TIMEOUT = 60.0


def wait_ready(
    tracker: Tracker,
    transport: RankTransport,
    config: LaunchConfig,
    on_progress: OnProgress | None = None,
    on_note: OnNote | None = None,
    timeout: float | None = None,
) -> None:
    """Return once the tracker has turned READY; raise :class:`LaunchError` on any failure."""
    timeout = config.start_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    last: dict[int, RankState] | None = None
    with tracker.changed:
        while True:
            for note in tracker.take_notes():
                if on_note is not None:
                    on_note(note)
            stages = tracker.stages()
            if stages != last and on_progress is not None:
                on_progress(dict(stages))
            last = stages
            failure = transport.start_failure(tracker)
            if failure is not None:
                raise failure
            if tracker.mark_ready():
                return
            if time.monotonic() > deadline:
                raise transport.start_timeout(tracker, timeout, stages)
            tracker.changed.wait(0.1)


def respawn(tracker: Tracker, transport: RankTransport, config: LaunchConfig, generation: int,
            on_progress: OnProgress | None = None, on_note: OnNote | None = None) -> bool:
    """Fresh rank processes under the running torchrun: each supervisor kills its rank and wakes
    its spare (or starts a new process), which joins process group ``generation`` under a store
    prefix of its own. True once every rank is ready; False where a full restart is needed (a
    supervisor gone; or the respawn failed, said through ``on_note``)."""
    if not tracker.begin_respawn():
        return False
    transport.generation = generation
    transport.send_many(map(supervisor_identity, range(config.world_size)), {"t": Msg.RESPAWN, "generation": generation})
    try:
        wait_ready(tracker, transport, config, on_progress, on_note, timeout=min(config.start_timeout, RESPAWN_TIMEOUT))
    except LaunchError as exc:
        if on_note is not None:
            on_note(f"fresh ranks under the running torchrun failed ({str(exc).splitlines()[0]}); starting torchrun anew")
        return False
    request_spares(transport, config, tracker)  # said once, at the launch
    return True


#: Spares are started on this machine only while they leave this share of its available memory free.
SPARE_MEMORY_SHARE = 0.6


def request_spares(transport: Transport, config: LaunchConfig, tracker: Tracker, on_note: OnNote | None = None,
                   modules: Sequence[str] = ()) -> None:
    """Each supervisor starts a spare for the next restart (once the ranks are ready, so that the
    spares' imports don't slow the start) — but on this machine only if they fit: a spare is a
    second Python with torch per rank, and 64 ranks' spares are ~10 GB more. With ``modules``, a
    zygote in the spare's place, which imports them and forks each fresh rank (worker/process/zygote.py)."""
    if not config.spares:
        return
    here = [r for r, info in tracker.ranks.items() if not info.agent or config.local_nodes]
    sizes = [size for r in here[:4] if (pid := tracker.ranks[r].pid) and (size := _processes.memory_of(pid))]
    available = _processes.memory_available()
    need = len(here) * max(sizes) if sizes else 0
    targets = list(range(config.world_size))
    if available is not None and need > SPARE_MEMORY_SHARE * available:
        targets = [r for r in targets if r not in set(here)]
        if on_note is not None:
            on_note(f"no spare rank processes on this machine: {len(here)} would need ~{need / 2**30:.1f} GiB of the "
                    f"{available / 2**30:.1f} GiB available; %dist_restart starts fresh processes instead (slower).")
    if targets:
        transport.send_many(map(supervisor_identity, targets), {"t": Msg.SPARE, "modules": list(modules)} if modules else {"t": Msg.SPARE})
