"""The rank supervisor: the process torchrun starts for each rank.

It imports no torch. It starts the real rank process (:mod:`distnb.worker.rank`) as its child and
owns the child's stdout/stderr pipes, so that:

* output reaches the controller the moment it is written, Python- and C-level alike;
* the last stderr lines of a rank that dies abruptly (SIGKILL, SIGABRT, segfault) are not lost;
* the exact exit code or signal of the rank is known (it is our child: ``waitpid``);
* a faulthandler dump can be requested with SIGUSR1 and read back even while the rank holds the
  GIL in a C loop.

When the rank dies the supervisor stays up (so torchrun does not tear down the other ranks, whose
state the user wants to inspect) until the controller says shut down or stops sending heartbeats.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import time

import zmq

from distnb import _linux
from distnb.protocol import Codec, Msg, ReplayGuard, BadFrame, supervisor_identity

#: Prefix of the end-of-cell marker the rank writes to its stdout and stderr (token follows).
MARK_PREFIX = b"\x00DNBMARK:"
_READ_SIZE = 1 << 16
_TAIL_BYTES = 16 * 1024


class _StreamSplitter:
    """Splits a pipe's bytes into user output and end-of-cell markers."""

    def __init__(self, token: bytes) -> None:
        self._prefix = MARK_PREFIX + token + b":"
        self._buf = b""

    def feed(self, data: bytes) -> list[tuple[str, object]]:
        """Returns events: ("data", bytes) and ("mark", cell_id), in stream order."""
        events: list[tuple[str, object]] = []
        buf = self._buf + data
        prefix = self._prefix
        while buf:
            i = buf.find(prefix)
            if i < 0:
                keep = self._partial_prefix_len(buf)
                if len(buf) - keep:
                    events.append(("data", buf[: len(buf) - keep]))
                buf = buf[len(buf) - keep :]
                break
            j = buf.find(b"\x00", i + len(prefix))
            if j < 0:  # marker not complete yet
                if i:
                    events.append(("data", buf[:i]))
                buf = buf[i:]
                break
            if i:
                events.append(("data", buf[:i]))
            try:
                events.append(("mark", int(buf[i + len(prefix) : j])))
            except ValueError:
                events.append(("data", buf[i : j + 1]))
            buf = buf[j + 1 :]
        self._buf = buf
        return events

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest

    def _partial_prefix_len(self, buf: bytes) -> int:
        # Longest suffix of buf that could be the start of a marker split across reads.
        for n in range(min(len(buf), len(self._prefix) - 1), 0, -1):
            if self._prefix.startswith(buf[-n:]):
                return n
        return 0


class Supervisor:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.addr = os.environ["DISTNB_ADDR"]
        key = bytes.fromhex(os.environ["DISTNB_KEY"])
        self.token = os.environ["DISTNB_TOKEN"].encode()
        self.heartbeat_timeout = float(os.environ.get("DISTNB_HEARTBEAT_TIMEOUT", "15"))
        self.codec = Codec(key, f"s{self.rank}")
        self.guard = ReplayGuard()
        self.ctx = zmq.Context(1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, supervisor_identity(self.rank))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(self.addr)
        self.child: subprocess.Popen[bytes] | None = None
        self.stderr_tail: collections.deque[bytes] = collections.deque()
        self.stderr_tail_bytes = 0
        self.pending_fault: list[str] = []  # request ids waiting for a faulthandler dump
        self.fault_buf = b""
        self.fault_deadline = 0.0
        self.stopping = False

    def send(self, msg: dict) -> None:
        self.sock.send_multipart(self.codec.encode(msg), copy=False)

    def start_child(self) -> tuple[int, int, int]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fault_r, fault_w = os.pipe()
        env = dict(os.environ)
        env["DISTNB_FAULT_FD"] = str(fault_w)
        env["PYTHONUNBUFFERED"] = "1"
        self.child = subprocess.Popen(
            [sys.executable, "-m", "distnb.worker.rank"],
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(fault_w,),
            env=env,
            # The rank must never outlive its supervisor; SIGKILL because a rank blocked in a
            # collective would not act on SIGTERM.
            preexec_fn=lambda: _linux.set_parent_death_signal(signal.SIGKILL),
        )
        for fd in (out_w, err_w, fault_w):
            os.close(fd)
        return out_r, err_r, fault_r

    def _keep_tail(self, data: bytes) -> None:
        self.stderr_tail.append(data)
        self.stderr_tail_bytes += len(data)
        while self.stderr_tail_bytes > _TAIL_BYTES and len(self.stderr_tail) > 1:
            self.stderr_tail_bytes -= len(self.stderr_tail.popleft())

    def _forward(self, stream: str, splitter: _StreamSplitter, data: bytes) -> None:
        for kind, value in splitter.feed(data):
            if kind == "data":
                if stream == "stderr":
                    self._keep_tail(value)  # type: ignore[arg-type]
                self.send({"t": Msg.OUTPUT, "stream": stream, "data": value})
            else:
                self.send({"t": Msg.STREAM_MARK, "stream": stream, "cell": value})

    def _handle(self, msg: dict) -> None:
        t = msg["t"]
        child = self.child
        if t == Msg.SHUTDOWN:
            self.stopping = True
        elif t == Msg.FAULT_REQUEST:
            if child is not None and child.poll() is None:
                self.pending_fault.append(msg["id"])
                self.fault_deadline = time.monotonic() + float(msg.get("wait", 0.3))
                os.kill(child.pid, signal.SIGUSR1)
            else:
                self.send({"t": Msg.SUP_REPLY, "id": msg["id"], "text": "", "alive": False})
        elif t == Msg.INTERRUPT:
            # Fallback path: the rank's own control thread normally delivers interrupts.
            if child is not None and child.poll() is None:
                os.kill(child.pid, signal.SIGINT)

    def _finish_fault(self) -> None:
        text = self.fault_buf.decode("utf-8", "replace")
        for req in self.pending_fault:
            self.send({"t": Msg.SUP_REPLY, "id": req, "text": text, "alive": True})
        self.pending_fault.clear()
        self.fault_buf = b""

    def run(self) -> int:
        _linux.set_parent_death_signal(signal.SIGTERM)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self.send(
            {
                "t": Msg.SUP_HELLO,
                "rank": self.rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            }
        )
        out_r, err_r, fault_r = self.start_child()
        assert self.child is not None
        self.send({"t": Msg.SUP_HELLO, "rank": self.rank, "child_pid": self.child.pid})
        splitters = {out_r: ("stdout", _StreamSplitter(self.token)), err_r: ("stderr", _StreamSplitter(self.token))}
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for fd in (out_r, err_r, fault_r):
            poller.register(fd, zmq.POLLIN)
        open_fds = {out_r, err_r, fault_r}
        last_heard = time.monotonic()
        exit_reported = False
        exit_seen = 0.0
        while True:
            events = dict(poller.poll(100))
            now = time.monotonic()
            if self.sock in events:
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = self.codec.decode(frames, self.guard)
                    except BadFrame:
                        continue
                    last_heard = now
                    self._handle(msg)
            for fd in (out_r, err_r, fault_r):
                if fd in events and fd in open_fds:
                    data = os.read(fd, _READ_SIZE)
                    if not data:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        os.close(fd)
                        continue
                    if fd == fault_r:
                        self.fault_buf += data
                        self.fault_deadline = max(self.fault_deadline, now + 0.05)
                    else:
                        stream, splitter = splitters[fd]
                        self._forward(stream, splitter, data)
            if self.pending_fault and now >= self.fault_deadline:
                self._finish_fault()
            rc = self.child.poll()
            if rc is not None and not exit_reported:
                exit_seen = exit_seen or now
                # Wait for EOF on both pipes so every byte the rank wrote is forwarded; a
                # grandchild that inherited the pipes caps that wait.
                if not ({out_r, err_r} & open_fds) or now - exit_seen > 2.0:
                    self._report_exit(rc, splitters)
                    exit_reported = True
            if self.stopping or now - last_heard > self.heartbeat_timeout:
                break
        self._stop_child()
        self.sock.close(linger=500)
        self.ctx.term()
        return 0

    def _report_exit(self, rc: int, splitters: dict[int, tuple[str, _StreamSplitter]]) -> None:
        for stream, splitter in splitters.values():
            rest = splitter.flush()
            if rest:
                self.send({"t": Msg.OUTPUT, "stream": stream, "data": rest})
        tail = b"".join(self.stderr_tail).decode("utf-8", "replace")
        self.send({"t": Msg.RANK_EXIT, "rank": self.rank, "returncode": rc, "stderr_tail": tail, "time": time.time()})
        if self.pending_fault:
            self._finish_fault()

    def _stop_child(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        child.terminate()
        try:
            child.wait(1.0)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5.0)


def main() -> int:
    try:
        return Supervisor().run()
    except KeyError as exc:
        print(
            f"distnb.worker: missing environment variable {exc}; this module is started by "
            "distnb's %dist_launch / distnb.launch(), not by hand.",
            file=sys.stderr,
        )
        return 2
