"""A pool's other machines: key file, join command, rendezvous, the agents it starts (ssh, srun,
or simulated here), the agents' messages, and their part in start-up failures and shutdown.

Used only when ``nnodes > 1``; the pool composes one per launch.
"""

from __future__ import annotations

import os
import secrets
import time

from distnb.config import LaunchConfig, Rendezvous, is_loopback, split_host_port
from distnb.controller.requests import Transport
from distnb.controller.tracker import Tracker
from distnb.launching import network
from distnb.launching.remote_nodes import NodeStarters, connect_host, join_command
from distnb.states import PoolState
from distnb.wire.peers import node_identity
from distnb.wire.protocol import FromNode, Msg
from distnb.wire.security import Credentials, default_key_file

__all__ = ["MultiNode"]


def _local_addr(config: LaunchConfig, host: str) -> str | None:
    """This machine's address for torchrun's ``--local-addr``: published as MASTER_ADDR if this node
    becomes the rendezvous' rank 0, and the interface gloo binds here (launcher)."""
    if is_loopback(config.bind_host) or is_loopback(host):
        return "127.0.0.1"
    mine = network.local_addresses()
    # A name (bound to every interface): the first address it resolves to that is this machine's.
    return next((a for a in network.resolve(host) if a in mine and not is_loopback(a)), None)


class MultiNode:
    """The controller's side of one multi-node launch."""

    def __init__(self, config: LaunchConfig, tracker: Tracker, transport: Transport, channel_address: str, creds: Credentials) -> None:
        self.config = config
        self._tracker = tracker
        self._transport = transport
        self._creds = creds
        self.nodes = tracker.nodes  # the tracker judges remote ranks' liveness by it
        self.starters: NodeStarters | None = None
        run_id = f"distnb-{secrets.token_hex(6)}"
        host = connect_host(config)
        #: What other machines connect to.
        self.address = f"tcp://{host}:{channel_address.rsplit(':', 1)[1]}"
        problem = network.missing_interface({**os.environ, **config.env})
        if problem:
            raise RuntimeError(problem)
        self.key_file: str | None = str(creds.write(config.key_file or default_key_file(run_id)))
        self.join_command = join_command(self.address, self.key_file, config.node_python)
        endpoint = config.rdzv_endpoint or f"{host}:{network.port_for_another(config.bind_host)}"
        rdzv_host = split_host_port(endpoint, "rendezvous endpoint")[0]
        # This machine hosts the rendezvous store when the endpoint names it, so an agent that
        # joins first can't take the store with it when it leaves.
        here = rdzv_host in (host, config.bind_host) or network.is_local(rdzv_host)
        #: The rendezvous torchrun uses here, and the one sent to the agents (each adds its own
        #: local_addr: the address it reaches this machine from).
        self.rdzv = Rendezvous(endpoint, run_id, True if here else None, _local_addr(config, host), config.start_timeout)
        self._agent_rdzv = Rendezvous(endpoint, run_id, False if here else None, "127.0.0.1" if is_loopback(host) else None,
                                      config.start_timeout)
        if not config.local_nodes:
            tracker.note(f"waiting for {config.nnodes - 1} other node(s); on each, run:\n  {self.join_command}\n"
                         f"(the key file must be readable there: shared home, or copy it with `scp {self.key_file} NODE:{self.key_file}`)")

    def start_agents(self) -> set[int]:
        """Start the agents the config asks this notebook to start; their starters' PIDs."""
        config = self.config
        if not (config.hosts or config.slurm or config.local_nodes):
            return set()
        self.starters = NodeStarters()
        if config.hosts or config.local_nodes:
            local = config.local_nodes
            commands = (NodeStarters.local_commands if local else NodeStarters.ssh_commands)(config, self.address)
            labels = [f"local node {i + 1}" for i in range(len(commands))] if local else [f"ssh {h}" for h in config.hosts]
            for command, label in zip(commands, labels):
                self.starters.start(command, stdin_text=self._creds.for_nodes().dumps(), label=label)
            where = f"{len(commands)} simulated on this machine" if local else f"over ssh on {', '.join(config.hosts)}"
            self._tracker.note(f"started node agents {where}")
        else:
            assert self.key_file is not None
            self.starters.start(NodeStarters.srun_command(config, self.address, self.key_file), label="srun")
            self._tracker.note(f"started {config.nnodes - 1} node agent(s) with srun")
        return self.starters.pids()

    def on_message(self, agent: int, msg: FromNode) -> None:
        """A node agent's message (the I/O thread, under the tracker's lock)."""
        if msg["t"] == Msg.NODE_HELLO:
            known = agent in self.nodes.agents
            reason = self.nodes.hello(agent, msg["host"], msg["pid"], msg["version"], accepting=self._tracker.state == PoolState.STARTING)
            if reason:
                self._transport.send(node_identity(agent), {"t": Msg.NODE_REFUSED, "reason": reason})
                self._tracker.note(f"refused a node agent on {msg['host']} (pid {msg['pid']}): {reason}")
                return
            self._transport.heartbeat_peers.add(node_identity(agent))
            self._transport.send(node_identity(agent), {"t": Msg.NODE_START, "config": self.config, "rdzv": self._agent_rdzv})
            if not known:
                self._tracker.note(f"node {len(self.nodes.agents)} of {self.nodes.expected} joined: {self.nodes.agents[agent].name()}")
        elif msg["t"] == Msg.NODE_BEAT:
            self.nodes.beat(agent, msg["pids"])
        elif msg["t"] == Msg.NODE_OUTPUT:
            self.nodes.output(agent, msg["lines"])
        elif msg["t"] == Msg.NODE_EXIT:
            self.nodes.exited(agent, msg["returncode"], msg["why"], msg["tail"])

    def start_failure(self) -> str | None:
        """Why the start failed on another machine's side, if it did."""
        starter = self.starters.failed() if self.starters is not None else None
        if starter is not None:
            return (f"a node agent's starter ended before every rank was ready — {starter.describe()}\n"
                    "Check that the machine is reachable and distnb is installed there (python -m distnb doctor). "
                    "The other ranks were stopped.")
        for node in self.nodes.agents.values():
            if node.state.value != "running":
                tail = "\n".join(list(node.tail)[-15:])
                return f"{node.cause()} before every rank was ready. Its last output:\n{tail}\nThe other ranks were stopped."
        return None

    def timeout_text(self, torchrun_pid: int | None) -> str:
        """The nodes' part of a start timeout: who joined, what was started, what to run."""
        text = f"Nodes:\n  this machine: torchrun pid {torchrun_pid}\n  " + self.nodes.text(self._tracker.ranks_by_agent()).replace("\n", "\n  ") + "\n"
        if self.starters is not None:
            text += "Node agents started by this notebook:\n  " + self.starters.text().replace("\n", "\n  ") + "\n"
        elif self.nodes.missing():
            text += f"On each missing node run:\n  {self.join_command}\n"
        return text

    def stop_agents(self) -> None:
        """Ask every agent to stop and wait (bounded) for them: their torchrun leans on this
        machine's rendezvous store, so they go first."""
        for agent in self.nodes.agents:
            self._transport.send(node_identity(agent), {"t": Msg.SHUTDOWN})
        deadline = time.monotonic() + 5.0
        with self._tracker.changed:
            while time.monotonic() < deadline and any(n.state.value == "running" for n in self.nodes.agents.values()):
                self._tracker.changed.wait(0.1)

    def close(self) -> None:
        """Stop the starters (ssh, srun) and delete the key file: the key dies with the launch."""
        if self.starters is not None:
            self.starters.stop()
            self.starters = None
        if self.key_file is not None:
            try:
                os.unlink(self.key_file)
            except OSError:
                pass
            self.key_file = None
