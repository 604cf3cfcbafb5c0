"""The controller's view of the other machines in a multi-node pool, and the ways to start them.

Each other machine runs a node agent (:mod:`distnb.launching.node_agent`), started by hand with the printed join
command, over ssh (``hosts``) or by srun (``slurm``). The controller keeps, per agent, where it runs
and which of its processes were alive at its last beat. A rank on another machine is dead when its
supervisor is missing from its agent's beats, or when the agent exits or goes silent.
"""

from __future__ import annotations

import collections
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from distnb import _processes
from distnb.config import VERSION, LaunchConfig, is_loopback
from distnb.launching import network
from distnb.launching.torchrun import drain_lines

__all__ = ["NodeInfo", "NodeState", "Nodes", "NodeStarters", "Starter", "join_command"]

#: An agent that has not beaten for this long is taken for lost with its machine.
LOST_AFTER = 3.0


class NodeState(Enum):
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"


@dataclass
class NodeInfo:
    agent_id: int
    host: str
    pid: int
    state: NodeState = NodeState.RUNNING
    last_beat: float = field(default_factory=time.monotonic)
    beats: int = 0
    pids: set[int] = field(default_factory=set)
    returncode: int | None = None
    why: str = ""
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=200))

    def name(self) -> str:
        return f"the node agent on {self.host} (pid {self.pid})"

    def cause(self) -> str:
        """Why this agent's ranks are gone, in words."""
        if self.state == NodeState.LOST:
            return f"lost with its machine: {self.name()} stopped answering"
        return f"{self.name()} ended: {self.why or 'exited'}"


class Nodes:
    """Node agents that joined (or tried to join) the current launch."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.agents: dict[int, NodeInfo] = {}
        self.refused = 0

    def hello(self, agent_id: int, host: str, pid: int, version: str, accepting: bool) -> str | None:
        """Register an agent; returns why it may not join, or None."""
        if agent_id in self.agents:
            return None  # a repeated hello while our answer was on its way
        if version != VERSION:
            reason = f"it runs distnb {version} but the notebook runs {VERSION}; install the same version on every node."
        elif not accepting:
            reason = "the pool is not starting (an agent from an earlier launch?)."
        elif len(self.agents) >= self.expected:
            reason = f"the pool already has its {self.expected + 1} nodes."
        else:
            self.agents[agent_id] = NodeInfo(agent_id, host, pid)
            return None
        self.refused += 1
        return reason

    def beat(self, agent_id: int, pids: list[int]) -> None:
        node = self.agents.get(agent_id)
        if node is not None and node.state == NodeState.RUNNING:
            node.last_beat = time.monotonic()
            node.beats += 1
            node.pids = set(pids)

    def output(self, agent_id: int, lines: list[str]) -> None:
        node = self.agents.get(agent_id)
        if node is not None:
            node.tail.extend(lines)

    def exited(self, agent_id: int, returncode: int | None, why: str, tail: str) -> None:
        node = self.agents.get(agent_id)
        if node is not None:
            node.state, node.returncode, node.why = NodeState.EXITED, returncode, why
            if tail and not node.tail:
                node.tail.extend(tail.splitlines())

    def check(self) -> list[NodeInfo]:
        """Mark agents silent for too long as lost; returns the newly lost."""
        now = time.monotonic()
        lost = []
        for node in self.agents.values():
            if node.state == NodeState.RUNNING and now - node.last_beat > LOST_AFTER:
                node.state = NodeState.LOST
                lost.append(node)
        return lost

    def rank_gone(self, agent_id: int, supervisor_pid: int | None, beats_at_hello: int) -> str | None:
        """Why a rank on another machine is gone, or None while it is alive."""
        node = self.agents.get(agent_id)
        if node is None:
            return None
        if node.state != NodeState.RUNNING:
            return node.cause()
        # Two beats after the rank said hello, so a beat computed before it existed does not count.
        if supervisor_pid is not None and node.beats >= beats_at_hello + 2 and supervisor_pid not in node.pids:
            return f"its process is gone from {node.host} (reported by {node.name()})"
        return None

    def missing(self) -> int:
        return max(0, self.expected - len(self.agents))

    def text(self, ranks_by_agent: dict[int, list[int]] | None = None) -> str:
        """Which agents joined, with their ranks, and how many never did."""
        from distnb.ranks import format_ranks

        lines = []
        for node in self.agents.values():
            ranks = (ranks_by_agent or {}).get(node.agent_id)
            lines.append(f"{node.name()}: {node.state.value}" + (f", {format_ranks(ranks)}" if ranks else ", no rank connected yet"))
        if self.missing():
            lines.append(f"{self.missing()} of {self.expected} other node(s) never joined")
        return "\n".join(lines)


def connect_host(config: LaunchConfig) -> str:
    """The address other machines reach this controller at.

    A specific ``bind`` address is it. Bound to every interface, the address this machine's routing
    uses towards the first ssh host is (it reaches that host, so that host reaches it back), else
    this machine's name, which must resolve to an address other machines can reach: a name that
    resolves to loopback (Debian's ``127.0.1.1 host`` line) would send every agent and rank to
    their own machine."""
    bind = config.bind_host
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    for host in config.hosts:
        source = network.source_address(host)
        if source and not is_loopback(source):
            return source
    name = socket.getfqdn()
    addrs = network.resolve(name)
    if config.local_nodes or any(not is_loopback(a.split("%")[0]) for a in addrs):
        return name
    usable = [f"{i} {a}" for i, al in network.interfaces().items() for a in al if not is_loopback(a) and not a.startswith("fe80")]
    raise RuntimeError(
        f"this machine's name {name!r} resolves to {', '.join(addrs) or 'nothing'}, which the other machines can't reach. "
        "Bind this machine's address on the network they share, e.g. --bind "
        f"{usable[0].split()[1] if usable else 'ADDRESS'}" + (f" (this machine has: {'; '.join(usable)})" if usable else "")
        + ", or fix the name in /etc/hosts or DNS."
    )


def join_command(address: str, key_file: str, python: str | None = None) -> str:
    """The one command to run on each other node."""
    return shlex.join([python or sys.executable, "-m", "distnb.node", "--connect", address, "--key-file", key_file])


@dataclass
class Starter:
    """One process that starts node agents (an ssh session, an srun step, a local agent)."""

    label: str  # "ssh node3", "srun", "local node 1"
    proc: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=50))
    drained: threading.Event = field(default_factory=threading.Event)  # its output read to the end

    def describe(self) -> str:
        rc = self.proc.poll()
        if rc is None:
            return f"{self.label}: running (pid {self.proc.pid})"
        self.drained.wait(1.0)  # the last words of a starter that just exited may still be in the pipe
        last = [line for line in self.tail if line.strip()][-3:]
        return f"{self.label}: {_processes.signal_meaning(rc)}" + "".join(f"\n  | {line}" for line in last)


class NodeStarters:
    """Node agents this controller started itself, over ssh or srun; stopped by PID."""

    def __init__(self, on_line: Callable[[str], None] | None = None) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.starters: list[Starter] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self._on_line = on_line
        self._threads: list[threading.Thread] = []

    @staticmethod
    def ssh_commands(config: LaunchConfig, address: str) -> list[list[str]]:
        # DISTNB_SSH replaces the ssh client (e.g. "ssh -p 2222 -i ~/.ssh/cluster").
        ssh = shlex.split(os.environ.get("DISTNB_SSH", "ssh"))
        remote = shlex.join([config.node_python or sys.executable, "-m", "distnb.node", "--connect", address, "--key-file", "-"])
        return [[*ssh, "-o", "BatchMode=yes", host, remote] for host in config.hosts]

    @staticmethod
    def local_commands(config: LaunchConfig, address: str) -> list[list[str]]:
        """One node agent per simulated node, on this machine (the key goes on stdin, as over ssh)."""
        agent = [sys.executable, "-m", "distnb.node", "--connect", address, "--key-file", "-"]
        return [list(agent) for _ in range(config.nnodes - 1)]

    @staticmethod
    def srun_command(config: LaunchConfig, address: str, key_file: str) -> list[str]:
        others = config.nnodes - 1
        # DISTNB_SRUN adds what a cluster needs, e.g. "srun --gpus-per-node 4 --account proj".
        srun = shlex.split(os.environ.get("DISTNB_SRUN", "srun"))
        return [
            *srun, f"--nodes={others}", f"--ntasks={others}", "--ntasks-per-node=1",
            f"--exclude={socket.gethostname()}", "--kill-on-bad-exit=0", "--input=none",
            # Share the allocation with the step the notebook runs in (Slurm >= 20.11).
            "--overlap",
            config.node_python or sys.executable, "-m", "distnb.node", "--connect", address, "--key-file", key_file,
        ]

    def start(self, command: list[str], stdin_text: str | None = None, label: str = "") -> None:
        proc = _processes.popen_with_parent_death(
            command,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if stdin_text is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin_text.encode() + b"\n")
                proc.stdin.close()
            except OSError:
                pass
        self.procs.append(proc)
        starter = Starter(label or shlex.join(command[:2]), proc)
        self.starters.append(starter)

        def on_line(line: str) -> None:
            starter.tail.append(line)
            if self._on_line is not None:
                self._on_line(line)

        def drain() -> None:
            try:
                drain_lines(proc.stdout, self.tail, on_line)  # type: ignore[arg-type]
            finally:
                starter.drained.set()

        thread = threading.Thread(target=drain, name="distnb-node-starter", daemon=True)
        thread.start()
        self._threads.append(thread)

    def failed(self) -> Starter | None:
        """A starter that ended while the pool was still starting: its agents will never join (an
        ssh or srun session lives as long as the agent it runs)."""
        return next((s for s in self.starters if s.proc.poll() is not None), None)

    def text(self) -> str:
        return "\n".join(s.describe() for s in self.starters)

    def pids(self) -> set[int]:
        return {p.pid for p in self.procs if p.poll() is None}

    def stop(self, grace: float = 3.0) -> None:
        """Give the agents time to stop their ranks (they were told to), then TERM, then KILL."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            for proc in alive:
                for pid in {proc.pid, *_processes.session_pids(proc.pid)}:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(p.poll() is None for p in alive):
                time.sleep(0.05)
        for thread in self._threads:
            thread.join(2.0)
