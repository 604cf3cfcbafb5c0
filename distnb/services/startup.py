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
from distnb.controller.channel import Channel
from distnb.controller.tracker import Tracker
from distnb.errors import LaunchError
from distnb.launching.network import SOCKET_IFNAME_VARS
from distnb.launching.torchrun import Launcher
from distnb.services.multinode import MultiNode
from distnb.states import RankState
from distnb.wire.peers import supervisor_identity
from distnb.wire.protocol import Msg

__all__ = ["wait_ready", "respawn", "request_spares", "OnProgress", "OnNote", "RESPAWN_TIMEOUT"]

OnProgress = Callable[[dict[int, RankState]], None]
OnNote = Callable[[str], None]

#: Seconds a respawn may take before the restart falls back to starting torchrun anew.
RESPAWN_TIMEOUT = 60.0


def wait_ready(
    tracker: Tracker,
    launcher: Launcher,
    config: LaunchConfig,
    multinode: MultiNode | None,
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
            failure = start_failure(tracker, launcher, multinode)
            if failure is not None:
                raise failure
            if tracker.mark_ready():
                return
            if time.monotonic() > deadline:
                raise _timeout(tracker, launcher, timeout, multinode, stages)
            tracker.changed.wait(0.1)


def respawn(tracker: Tracker, channel: Channel, launcher: Launcher, config: LaunchConfig, multinode: MultiNode | None,
            generation: int, on_progress: OnProgress | None = None, on_note: OnNote | None = None) -> bool:
    """Fresh rank processes under the running torchrun: each supervisor kills its rank and wakes
    its spare (or starts a new process), which joins process group ``generation`` under a store
    prefix of its own. True once every rank is ready; False where a full restart is needed (a
    supervisor gone; or the respawn failed, said through ``on_note``)."""
    if not tracker.begin_respawn():
        return False
    channel.generation = generation
    channel.send_many(map(supervisor_identity, range(config.world_size)), {"t": Msg.RESPAWN, "generation": generation})
    try:
        wait_ready(tracker, launcher, config, multinode, on_progress, on_note, timeout=min(config.start_timeout, RESPAWN_TIMEOUT))
    except LaunchError as exc:
        if on_note is not None:
            on_note(f"fresh ranks under the running torchrun failed ({str(exc).splitlines()[0]}); starting torchrun anew")
        return False
    request_spares(channel, config, tracker)  # said once, at the launch
    return True


#: Spares are started on this machine only while they leave this share of its available memory free.
SPARE_MEMORY_SHARE = 0.6


def request_spares(channel: Channel, config: LaunchConfig, tracker: Tracker, on_note: OnNote | None = None) -> None:
    """Each supervisor starts a spare for the next restart (once the ranks are ready, so that the
    spares' imports don't slow the start) — but on this machine only if they fit: a spare is a
    second Python with torch per rank, and 64 ranks' spares are ~10 GB more."""
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
        channel.send_many(map(supervisor_identity, targets), {"t": Msg.SPARE})


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
        return LaunchError(f"rank {first.rank} failed to start: {why}\nThe other ranks were stopped."
                           + _mesh_hint(why, launcher, multinode), rank=first.rank)
    remote = multinode.start_failure() if multinode is not None else None
    if remote is not None:
        return LaunchError(remote + _rendezvous_hint(remote, launcher, multinode))
    rc = launcher.returncode()
    if rc is not None:
        return LaunchError(
            f"torchrun exited ({_processes.signal_meaning(rc)}) before every rank was ready. "
            f"Its last output:\n{launcher.tail_text(20)}\n"
            "Check that torch.distributed works here (python -m distnb doctor), then launch again."
            + _rendezvous_hint(launcher.tail_text(20), launcher, multinode)
        )
    return None


def _network(launcher: Launcher, multinode: MultiNode) -> str:
    """What this machine told torchrun and the backends about the network."""
    env = launcher.environment()
    pinned = ", ".join(f"{v}={env[v]}" for v in SOCKET_IFNAME_VARS if env.get(v)) or "no GLOO_SOCKET_IFNAME"
    return f"this machine: --local-addr {multinode.rdzv.local_addr or '(its name)'}, {pinned}; rendezvous {multinode.rdzv.endpoint}"


def _mesh_advice(launcher: Launcher, multinode: MultiNode) -> str:
    """What to check when the ranks on different machines can't connect to each other."""
    return (f"Here {_network(launcher, multinode)}; the other machines use the interface that reaches this one. Let TCP "
            "through between the machines (gloo and NCCL pick ports at random), and set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME "
            "(--env) only to an interface every machine has, never lo.")


def _mesh_hint(error: str, launcher: Launcher, multinode: MultiNode | None) -> str:
    """A rank's process group could not connect its peers: say which addresses it was given."""
    if multinode is None or not any(w in error for w in ("connectFullMesh", "timed out connecting", "Connection refused")):
        return ""
    loopback = " A rank was given a loopback address (remote=[127.…]) for a peer on another machine." if "remote=[127." in error else ""
    return f"\nThe ranks could not connect to each other across machines.{loopback} {_mesh_advice(launcher, multinode)}"


def _rendezvous_hint(text: str, launcher: Launcher, multinode: MultiNode | None) -> str:
    """torchrun's words for an unreachable rendezvous, in terms of what the user can change."""
    if multinode is None or not any(w in text for w in ("MASTER_ADDR", "DistStoreError", "RendezvousTimeoutError", "RendezvousConnectionError")):
        return ""
    return ("\nThe machines' torchruns could not complete the c10d rendezvous: every machine must reach the rendezvous "
            "endpoint, and the address the first node publishes as MASTER_ADDR (its --local-addr, set by distnb to the "
            f"address each node reaches the notebook's machine from). Here {_network(launcher, multinode)}. Check the "
            "firewall between the machines (the rendezvous port and the controller's port), or give --rdzv-endpoint "
            "ADDRESS:PORT with an address every machine reaches.")


def _timeout(tracker: Tracker, launcher: Launcher, timeout: float, multinode: MultiNode | None,
             stages: dict[int, RankState]) -> LaunchError:
    missing = {r: s.value for r, s in stages.items() if s != RankState.IDLE}
    detail = ", ".join(f"rank {r}: {s}" for r, s in missing.items())
    nodes = multinode.timeout_text(launcher.pid) if multinode is not None else ""
    if multinode is not None and missing and all(s == RankState.CONNECTED.value for s in missing.values()):
        nodes += ("Every rank reached the notebook, but the process group did not form: the ranks could not connect to "
                  f"each other. {_mesh_advice(launcher, multinode)}\n")
    return LaunchError(
        f"the pool did not start within {timeout:g} s ({detail}).\n{nodes}"
        f"torchrun's last output:\n{launcher.tail_text(15)}\n"
        "Raise --start-timeout if the machine is just slow, or check the output above.",
        missing=missing,
    )
