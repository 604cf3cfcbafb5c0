"""Waiting for a launch to become ready, and saying why it did not: root cause first.

A start fails fast with the first failing rank's error (or its exit and last output), a node
agent's failure, or torchrun's exit; at ``start_timeout`` it names each rank still missing and
its stage. The words are built here from what the tracker, the launcher and the other machines
know; the pool only calls :func:`wait_ready`.
"""

from __future__ import annotations

import time
from typing import Callable

from distnb import _processes
from distnb.config import LaunchConfig
from distnb.errors import LaunchError
from distnb.launcher import Launcher
from distnb.multinode import MultiNode
from distnb.results import RankState
from distnb.tracker import Tracker

__all__ = ["wait_ready", "OnProgress", "OnNote"]

OnProgress = Callable[[dict[int, RankState]], None]
OnNote = Callable[[str], None]


def wait_ready(
    tracker: Tracker,
    launcher: Launcher,
    config: LaunchConfig,
    multinode: MultiNode | None,
    on_progress: OnProgress | None = None,
    on_note: OnNote | None = None,
) -> None:
    """Return once the tracker has turned READY; raise :class:`LaunchError` on any failure."""
    deadline = time.monotonic() + config.start_timeout
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
            failure = start_failure(tracker, launcher, multinode)
            if failure is not None:
                raise failure
            if tracker.mark_ready():
                return
            if time.monotonic() > deadline:
                raise _timeout(tracker, launcher, config, multinode, stages)
            tracker.changed.wait(0.1)


def start_failure(tracker: Tracker, launcher: Launcher, multinode: MultiNode | None) -> LaunchError | None:
    failed = [info for info in tracker.ranks.values() if info.start_error or info.state == RankState.DEAD]
    if failed:
        first = min(failed, key=lambda i: (i.died_at or float("inf"), i.rank))
        if first.start_error:
            why = first.start_error.rstrip()
        else:
            why = f"its process {_processes.signal_meaning(first.returncode)}"
            tail = (first.stderr_tail or "\n".join(first.log)).strip()
            if tail:
                why += "; its last output:\n" + "\n".join(tail.splitlines()[-15:])
        return LaunchError(f"rank {first.rank} failed to start: {why}\nThe other ranks were stopped.", rank=first.rank)
    remote = multinode.start_failure() if multinode is not None else None
    if remote is not None:
        return LaunchError(remote)
    rc = launcher.returncode()
    if rc is not None:
        return LaunchError(
            f"torchrun exited ({_processes.signal_meaning(rc)}) before every rank was ready. "
            f"Its last output:\n{launcher.tail_text(20)}\n"
            "Check that torch.distributed works here (python -m distnb doctor), then launch again."
        )
    return None


def _timeout(tracker: Tracker, launcher: Launcher, config: LaunchConfig, multinode: MultiNode | None,
             stages: dict[int, RankState]) -> LaunchError:
    missing = {r: s.value for r, s in stages.items() if s != RankState.IDLE}
    detail = ", ".join(f"rank {r}: {s}" for r, s in missing.items())
    nodes = multinode.timeout_text(launcher.pid) if multinode is not None else ""
    return LaunchError(
        f"the pool did not start within {config.start_timeout:g} s ({detail}).\n{nodes}"
        f"torchrun's last output:\n{launcher.tail_text(15)}\n"
        "Raise --start-timeout if the machine is just slow, or check the output above.",
        missing=missing,
    )
