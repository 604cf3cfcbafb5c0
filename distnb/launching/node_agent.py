"""The node agent: ``python -m distnb.node --connect tcp://HOST:PORT --key-file FILE``.

Run once on every machine of a multi-node pool other than the notebook's. It connects to the
controller, receives the pool's launch configuration and rendezvous, and runs torchrun with
``-m distnb.worker`` there; its ranks then talk to the controller directly. While torchrun runs it
tells the controller, twice a second, which of its processes are alive, so a rank that vanishes
with its machine is reported as such. It stops torchrun and exits when the controller says so,
stops answering, or when it is itself signalled.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import signal
import socket
import sys
import time
from typing import Any

import zmq

from distnb import _processes
from distnb.config import VERSION, LaunchConfig, Rendezvous
from distnb.launching import network
from distnb.launching.torchrun import Launcher
from distnb.wire.codec import BadFrame, Codec, ReplayGuard, socket_max_msgsize
from distnb.wire.peers import PeerKind, node_identity
from distnb.wire.protocol import Msg, NodeStart, ToNode, accept_request
from distnb.wire.security import Credentials, KeyFileError

__all__ = ["NodeAgent", "main"]

BEAT_EVERY = 0.5


class NodeAgent:
    def __init__(self, address: str, creds: Credentials, wait: float = 60.0) -> None:
        self.address = address
        self.creds = creds
        self.wait = wait
        self.agent_id = secrets.randbelow(10**12)
        self.codec = Codec(creds.key, f"n{self.agent_id}")
        self.guard = ReplayGuard()
        self.ctx = zmq.Context(1)
        self.sock = self.ctx.socket(zmq.DEALER)
        # Frames bigger than any legitimate one are refused by libzmq before they are buffered.
        self.sock.setsockopt(zmq.MAXMSGSIZE, socket_max_msgsize())
        self.sock.setsockopt(zmq.IDENTITY, node_identity(self.agent_id))
        self.sock.setsockopt(zmq.LINGER, 1000)
        creds.secure_client(self.sock)
        self.sock.connect(address)
        self.launcher: Launcher | None = None
        self.stopping = ""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send_multipart(self.codec.encode(msg), copy=False)

    def recv(self, timeout: float) -> ToNode | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        frames = self.sock.recv_multipart()
        try:
            raw = self.codec.decode(frames, self.guard)
            # The controller signs as "C" (its I/O thread) or "C<n>" (its other threads); peers never do.
            return accept_request(PeerKind.NODE, raw) if str(raw.get("_s", "")).startswith("C") else None
        except BadFrame:
            return None

    def _join(self) -> NodeStart | None:
        hello = {"t": Msg.NODE_HELLO, "host": socket.gethostname(), "pid": os.getpid(), "version": VERSION}
        deadline = time.monotonic() + self.wait
        next_hello = 0.0
        while time.monotonic() < deadline and not self.stopping:
            if time.monotonic() >= next_hello:
                self.send(dict(hello))  # again now and then: the controller may not be listening yet
                next_hello = time.monotonic() + 2.0
            msg = self.recv(0.2)
            if msg is None:
                continue
            if msg["t"] == Msg.NODE_REFUSED:
                print(f"distnb node: the controller at {self.address} refused this node: {msg['reason']}", file=sys.stderr)
                return None
            if msg["t"] == Msg.NODE_START:
                return msg
            if msg["t"] == Msg.SHUTDOWN:  # the launch was given up before this node was needed
                print(f"distnb node: the controller at {self.address} stopped its pool before this node started.", file=sys.stderr)
                return None
        if not self.stopping:
            print(
                f"distnb node: no answer from a controller at {self.address} within {self.wait:g} s. Check that this "
                "machine can reach that address (firewall, --bind on the controller) and that the key file is the one "
                "this pool's %dist_launch printed: frames signed with another key are dropped unread. Both machines need the "
                "same distnb: an older one signs its frames differently.",
                file=sys.stderr,
            )
        return None

    def _local_rendezvous(self, rdzv: Rendezvous) -> Rendezvous:
        """The rendezvous with this node's own address: the one it reaches the controller from
        (its hostname may not resolve on the other machines, or resolve to loopback)."""
        if rdzv.local_addr:
            return rdzv
        return dataclasses.replace(rdzv, local_addr=network.source_address(_host_of(self.address)))

    def _refuse_start(self, why: str) -> int:
        """End before starting torchrun, saying why to the controller (its launch fails with it)."""
        print(f"distnb node: {why}", file=sys.stderr)
        self.send({"t": Msg.NODE_EXIT, "returncode": 2, "why": why, "tail": ""})
        return 2

    def _forward_line(self, line: str) -> None:
        print(line, flush=True)
        self.send({"t": Msg.NODE_OUTPUT, "lines": [line[:2000]]})

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: setattr(self, "stopping", signal.Signals(s).name))
        try:
            start = self._join()
            if start is None:
                return 2
            config: LaunchConfig = start["config"]
            rdzv: Rendezvous = self._local_rendezvous(start["rdzv"])
            problem = network.missing_interface({**os.environ, **config.env})
            if problem:
                return self._refuse_start(problem)
            print(f"distnb node: joined the pool at {self.address} as node agent {self.agent_id}; starting "
                  f"{config.nproc} ranks (rendezvous {rdzv.endpoint})", flush=True)
            # The sender can't be touched from the output thread: hand lines to it through a list.
            lines: list[str] = []
            self.launcher = Launcher(config, self.address, self.creds, on_line=lines.append, rdzv=rdzv, agent=self.agent_id)
            self.launcher.start()
            return self._serve(config, lines)
        finally:
            if self.launcher is not None:
                self.launcher.stop(grace=0.5)
            self.sock.close(linger=1000)
            self.ctx.term()

    def _serve(self, config: LaunchConfig, lines: list[str]) -> int:
        assert self.launcher is not None
        last_heard = time.monotonic()
        next_beat = 0.0
        while True:
            while lines:
                self._forward_line(lines.pop(0))
            now = time.monotonic()
            if now >= next_beat:
                pids = sorted(self.launcher._pool_pids())
                self.send({"t": Msg.NODE_BEAT, "pids": pids, "torchrun": self.launcher.pid})
                next_beat = now + BEAT_EVERY
            rc = self.launcher.returncode()
            if rc is not None or self.stopping:
                why = f"torchrun exited ({_processes.signal_meaning(rc)})" if rc is not None else f"stopped by {self.stopping}"
                self.launcher.stop(grace=0.5)
                while lines:
                    self._forward_line(lines.pop(0))
                self.send({"t": Msg.NODE_EXIT, "returncode": rc, "why": why, "tail": self.launcher.tail_text(20)})
                print(f"distnb node: {why}", file=sys.stderr)
                return 0 if rc in (0, None) else 1
            if now - last_heard > config.heartbeat_timeout:
                print(f"distnb node: the controller has been silent for {config.heartbeat_timeout:g} s; stopping this node's ranks.", file=sys.stderr)
                self.launcher.stop(grace=0.5)
                return 1
            msg = self.recv(0.1)
            if msg is None:
                continue
            last_heard = time.monotonic()
            if msg["t"] == Msg.SHUTDOWN:
                self.stopping = "the controller (shutdown)"


def _host_of(address: str) -> str:
    """The host of ``tcp://HOST:PORT`` (an IPv6 address without its brackets)."""
    return address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distnb.node", description=__doc__.split("\n\n")[1] if __doc__ else None)
    parser.add_argument("--connect", required=True, metavar="tcp://HOST:PORT", help="the controller's address, as %%dist_launch printed it")
    parser.add_argument("--key-file", required=True, metavar="FILE", help="the pool's key file ('-': read it from standard input)")
    parser.add_argument("--wait", type=float, default=60.0, metavar="SECONDS", help="how long to wait for the controller's answer (default 60)")
    args = parser.parse_args(argv)
    if not args.connect.startswith("tcp://"):
        parser.error(f"--connect takes tcp://HOST:PORT, not {args.connect!r}")
    host = _host_of(args.connect)
    if not network.resolve(host):
        print(f"distnb node: this machine can't resolve {host!r}, the controller's name in --connect. Launch the pool with "
              "--bind set to the notebook machine's IP address on the network the machines share, or make the name "
              "resolvable here (/etc/hosts, DNS).", file=sys.stderr)
        return 2
    try:
        creds = Credentials.read(args.key_file)
    except KeyFileError as exc:
        print(f"distnb node: {exc}", file=sys.stderr)
        return 2
    return NodeAgent(args.connect, creds, args.wait).run()


if __name__ == "__main__":
    sys.exit(main())
