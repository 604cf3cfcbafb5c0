"""What the Pool needs of its ranks and the wire to them: the seam under the Pool.

A :class:`RankTransport` starts a launch's ranks, carries the controller's messages to them (their
replies reach the tracker's ``on_message``, as the channel delivers them), says why a start
failed, and stops what it started. :class:`~distnb.transport.torchrun_ranks.TorchrunRanks` is the real
one (ZMQ, torchrun, node agents); ``tests/fake_ranks.py`` replays message streams recorded from
real pools, so that what sits above the wire (the Pool, services, magics, display) is tested
without processes. One object serves every launch of its pool: :meth:`open` starts one,
:meth:`close` ends it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol

from distnb.controller.requests import Transport
from distnb.errors import LaunchError
from distnb.states import RankState

if TYPE_CHECKING:
    from distnb.controller.channel import FollowUp
    from distnb.controller.tracker import Tracker
    from distnb.transport.multinode import MultiNode

__all__ = ["RankTransport", "WireHealth"]


class WireHealth(Protocol):
    """What ``%dist_status`` says of the wire: messages rejected, and errors on its own thread."""

    @property
    def rejected(self) -> int: ...

    @property
    def errors(self) -> int: ...

    @property
    def last_error(self) -> str | None: ...


class RankTransport(Transport, Protocol):
    """One pool's ranks and the wire to them, launch after launch."""

    #: Which ranks' connections messages go to: 0 for the first processes, N after the Nth respawn.
    generation: int
    #: The launch's other machines (key file, join command, their agents); None on one machine.
    multinode: MultiNode | None

    def open(self, tracker: Tracker) -> None:
        """Start a launch: the wire (``tracker.begin_start`` with this transport), then the ranks'
        processes, whose messages reach ``tracker.on_message``. Raises :class:`LaunchError`."""

    def start_failure(self, tracker: Tracker) -> LaunchError | None:
        """Why the launch can no longer become ready (root cause first), or None."""

    def start_timeout(self, tracker: Tracker, timeout: float, stages: Mapping[int, RankState]) -> LaunchError:
        """The error for a launch not ready within ``timeout`` seconds."""

    def send_many(self, identities: Iterable[bytes], msg: dict[str, Any], follow_up: FollowUp | None = None) -> None:
        """Send ``msg`` to each peer; ``follow_up`` runs on the wire's thread after its delay."""

    def running(self) -> bool:
        """Whether this launch's processes (torchrun) still run: a respawn can then keep them."""

    def close(self) -> list[int]:
        """Stop what :meth:`open` started, in order; the processes that survived, by PID."""

    def pids(self) -> list[int]:
        """Every process of this launch known to be alive."""

    @property
    def agent_pid(self) -> int | None:
        """torchrun's PID on this machine."""

    @property
    def run_dir(self) -> str | None:
        """This launch's folder (torchrun's logs, NCCL's timeout dumps)."""

    @property
    def address(self) -> str | None:
        """Where the ranks connect to (the controller's socket)."""

    @property
    def health(self) -> WireHealth | None:
        """The wire's counters, while a launch is open."""
