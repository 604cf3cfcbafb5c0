"""The real ranks: torchrun's processes on this machine (and node agents' on others), over ZMQ.

:class:`TorchrunRanks` is the Pool's default :class:`~distnb.transport.base.RankTransport`: per
launch it opens the :class:`~distnb.controller.channel.Channel`, starts torchrun
(:class:`~distnb.launching.torchrun.Launcher`) and, for several machines, their agents
(:class:`~distnb.transport.multinode.MultiNode`), and stops them in order. Why a start failed is
said here, root cause first, in terms of what the user can change: a rank's error or exit with
its last output, a node agent's failure, torchrun's exit; across machines, ranks that could not
connect their peers and rendezvous errors, each with this machine's addresses.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from distnb import _processes
from distnb.config import LaunchConfig
from distnb.controller.channel import Channel, FollowUp
from distnb.controller.tracker import Tracker
from distnb.errors import LaunchError
from distnb.launching.network import SOCKET_IFNAME_VARS
from distnb.launching.remote_nodes import Nodes
from distnb.launching.torchrun import Launcher
from distnb.states import RankState
from distnb.transport.base import WireHealth
from distnb.transport.multinode import MultiNode
from distnb.wire.peers import supervisor_identity
from distnb.wire.protocol import Msg
from distnb.wire.security import Credentials

__all__ = ["TorchrunRanks"]


class TorchrunRanks:
    """Channel, torchrun and node agents, made anew at each :meth:`open`."""

    def __init__(self, config: LaunchConfig) -> None:
        self._config = config
        self.channel: Channel | None = None
        self.launcher: Launcher | None = None
        #: The other machines of this launch (None on one machine).
        self.multinode: MultiNode | None = None
        self.heartbeat_peers: set[bytes] = set()

    # -- a launch -------------------------------------------------------------------------------
    def open(self, tracker: Tracker) -> None:
        config = self._config
        self.channel = self.launcher = self.multinode = None
        try:
            creds = Credentials.new(curve=config.curve)
            self.channel = Channel(creds, tracker.on_message, tracker.on_tick, bind=config.bind_host, port=config.bind_port,
                                   ping_every=config.ping_interval)
        except (OSError, RuntimeError) as exc:
            raise LaunchError(str(exc)) from None
        self.heartbeat_peers = self.channel.heartbeat_peers
        tracker.begin_start(self, Nodes(config.nnodes - 1))
        rdzv = None
        if config.nnodes > 1:
            try:
                self.multinode = MultiNode(config, tracker, self, self.channel.address, creds)
            except (OSError, RuntimeError) as exc:
                raise LaunchError(str(exc)) from None
            tracker.route_nodes(self.multinode.on_message)
            rdzv = self.multinode.rdzv
        self.launcher = Launcher(config, self.channel.address, creds, rdzv=rdzv)
        self.launcher.start()
        tracker.watch(self.launcher)
        if self.multinode is not None:
            self.launcher.known_pids |= self.multinode.start_agents()

    def close(self) -> list[int]:
        """Ask the supervisors to stop, other machines first, then torchrun; close the wire."""
        leftovers: list[int] = []
        if self.channel is not None:
            self.channel.send_many(map(supervisor_identity, range(self._config.world_size)), {"t": Msg.SHUTDOWN})
            if self.multinode is not None:
                # Other machines stop first: their torchrun leans on this one's rendezvous store.
                self.multinode.stop_agents()
        if self.launcher is not None:
            leftovers = self.launcher.stop(grace=2.0)
        if self.multinode is not None:
            self.multinode.close()
        if self.channel is not None:
            self.channel.close()
        return leftovers

    def running(self) -> bool:
        return self.channel is not None and self.launcher is not None and self.launcher.returncode() is None

    # -- the wire -------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.channel.generation if self.channel is not None else 0

    @generation.setter
    def generation(self, value: int) -> None:
        if self.channel is not None:
            self.channel.generation = value

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.send_many((identity,), msg)

    def send_many(self, identities: Iterable[bytes], msg: dict[str, Any], follow_up: FollowUp | None = None) -> None:
        if self.channel is not None:
            self.channel.send_many(identities, msg, follow_up)

    # -- what the Pool shows --------------------------------------------------------------------
    def pids(self) -> list[int]:
        return sorted(self.launcher.live_pids()) if self.launcher is not None else []

    @property
    def agent_pid(self) -> int | None:
        return self.launcher.pid if self.launcher is not None else None

    @property
    def run_dir(self) -> str | None:
        return self.launcher.run_dir if self.launcher is not None else None

    @property
    def address(self) -> str | None:
        return self.channel.address if self.channel is not None else None

    @property
    def health(self) -> WireHealth | None:
        return self.channel

    # -- why a start failed ---------------------------------------------------------------------
    def start_failure(self, tracker: Tracker) -> LaunchError | None:
        assert self.launcher is not None
        return _start_failure(tracker, self.launcher, self.multinode)

    def start_timeout(self, tracker: Tracker, timeout: float, stages: Mapping[int, RankState]) -> LaunchError:
        assert self.launcher is not None
        return _timeout(self.launcher, timeout, self.multinode, stages)


def _start_failure(tracker: Tracker, launcher: Launcher, multinode: MultiNode | None) -> LaunchError | None:
    """Why the launch can't become ready, root cause first: a rank's error or exit, a node agent, torchrun's exit."""
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


def _timeout(launcher: Launcher, timeout: float, multinode: MultiNode | None, stages: Mapping[int, RankState]) -> LaunchError:
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
