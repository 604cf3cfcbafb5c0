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
import pickle
import struct
import signal
import socket
import subprocess
import sys
import time

import zmq

from distnb import _processes
from distnb._zmq_io import NOBLOCK, recv_frames, send_frames
from distnb.protocol import BadFrame, Codec, FrameTooLarge, Msg, ReplayGuard, socket_max_msgsize, supervisor_identity
from distnb.security import Credentials

_READ_SIZE = 1 << 16
_TAIL_BYTES = 16 * 1024
_LEN = struct.Struct("!I")


def write_event(fd: int, msg: dict) -> None:
    """Rank side: one length-prefixed pickled event on the private pipe to the supervisor."""
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_LEN.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data):]


class _EventReader:
    """Supervisor side: reassembles length-prefixed events from pipe reads."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < _LEN.size + n:
                break
            out.append(self._buf[_LEN.size : _LEN.size + n])
            self._buf = self._buf[_LEN.size + n :]
        return out


class Supervisor:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.addr = os.environ["DISTNB_ADDR"]
        creds = Credentials.from_env(os.environ)
        self.heartbeat_timeout = float(os.environ.get("DISTNB_HEARTBEAT_TIMEOUT", "15"))
        self.codec = Codec(creds.key, f"s{self.rank}")
        self.guard = ReplayGuard()
        self.ctx = zmq.Context(1)
        self.sock = self.ctx.socket(zmq.DEALER)
        # Nothing the controller legitimately sends comes near this; anything bigger is refused
        # by libzmq before it is buffered.
        self.sock.setsockopt(zmq.MAXMSGSIZE, socket_max_msgsize())
        self.sock.setsockopt(zmq.IDENTITY, supervisor_identity(self.rank))
        self.sock.setsockopt(zmq.LINGER, 2000)
        creds.secure_client(self.sock)
        self.sock.connect(self.addr)
        self.child: subprocess.Popen[bytes] | None = None
        self.stderr_tail: collections.deque[bytes] = collections.deque()
        self.stderr_tail_bytes = 0
        self.pending_fault: list[str] = []  # request ids waiting for a faulthandler dump
        self.fault_buf = b""
        self.fault_deadline = 0.0
        self.stopping = False

    def send(self, msg: dict) -> None:
        send_frames(self.sock, self.codec.encode(msg))

    def start_child(self) -> tuple[int, int, int, int]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fault_r, fault_w = os.pipe()
        events_r, events_w = os.pipe()
        env = dict(os.environ)
        env["DISTNB_FAULT_FD"] = str(fault_w)
        env["DISTNB_EVENTS_FD"] = str(events_w)
        env["PYTHONUNBUFFERED"] = "1"
        self.child = subprocess.Popen(
            [sys.executable, "-m", "distnb.worker.rank"],
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(fault_w, events_w),
            env=env,
            # The rank must never outlive its supervisor; SIGKILL because a rank blocked in a
            # collective would not act on SIGTERM.
            preexec_fn=lambda: _processes.set_parent_death_signal(signal.SIGKILL),
        )
        for fd in (out_w, err_w, fault_w, events_w):
            os.close(fd)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)  # drained to EAGAIN before each event is forwarded
        return out_r, err_r, fault_r, events_r

    def _keep_tail(self, data: bytes) -> None:
        self.stderr_tail.append(data)
        self.stderr_tail_bytes += len(data)
        while self.stderr_tail_bytes > _TAIL_BYTES and len(self.stderr_tail) > 1:
            self.stderr_tail_bytes -= len(self.stderr_tail.popleft())

    def _forward(self, stream: str, data: bytes) -> None:
        if stream == "stderr":
            self._keep_tail(data)
        self.send({"t": Msg.OUTPUT, "stream": stream, "data": data})

    def _drain(self, fd: int, stream: str) -> bool:
        """Forward everything now in the pipe; False at EOF."""
        while True:
            try:
                data = os.read(fd, _READ_SIZE)
            except BlockingIOError:
                return True
            if not data:
                return False
            self._forward(stream, data)

    def _forward_event(self, body: bytes) -> None:
        try:
            self.send({"t": Msg.EVENT, "body": body})
        except FrameTooLarge as exc:
            # Values and displays are capped on the rank, so this takes a bug; still, a CELL_DONE must
            # arrive or the notebook waits for ever. The body comes from our own child's private
            # pipe, so reading it here is as safe as the controller reading it.
            event = pickle.loads(body)
            note = f"<this rank's {event.get('t')} event was {exc.size:,} bytes pickled, over distnb's limit of {exc.limit:,}; dropped>"
            if event.get("t") == Msg.DISPLAY:
                small = {"t": Msg.DISPLAY, "cell": event.get("cell"), "data": {"text/plain": note}}
            else:  # CELL_DONE: keep what the notebook needs to finish the cell, nothing that could be big
                small = {k: event.get(k) for k in ("t", "cell", "status", "duration")}
                small["value"] = {"text/plain": note}
                error = event.get("error")
                if isinstance(error, dict):
                    small["error"] = {"ename": str(error.get("ename"))[:200], "evalue": str(error.get("evalue"))[:4000],
                                      "traceback": note, "line": error.get("line")}
            self.send({"t": Msg.EVENT, "body": pickle.dumps(small, protocol=pickle.HIGHEST_PROTOCOL)})

    def _handle(self, msg: dict) -> None:
        t = msg["t"]
        child = self.child
        if t == Msg.SHUTDOWN:
            self.stopping = True
        elif t == Msg.FAULT_REQUEST:
            if child is not None and child.poll() is None:
                if not self.pending_fault:
                    # A dump nobody waits for any more (it came late: a rank that was stopped
                    # when asked dumps on SIGCONT) must not pass for the answer to this request.
                    self.fault_buf = b""
                self.pending_fault.append(msg["id"])
                self.fault_deadline = time.monotonic() + float(msg.get("wait", 0.3))
                os.kill(child.pid, signal.SIGUSR1)
            else:
                self.send({"t": Msg.REPLY, "id": msg["id"], "rank": self.rank, "text": "", "alive": False})
        elif t == Msg.INTERRUPT:
            # Fallback path: the rank's own control thread normally delivers interrupts.
            if child is not None and child.poll() is None:
                os.kill(child.pid, signal.SIGINT)

    def _finish_fault(self) -> None:
        text = self.fault_buf.decode("utf-8", "replace")
        for req in self.pending_fault:
            self.send({"t": Msg.REPLY, "id": req, "rank": self.rank, "text": text, "alive": True})
        self.pending_fault.clear()
        self.fault_buf = b""

    def run(self) -> int:
        _processes.set_parent_death_signal(signal.SIGTERM)
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
                "agent": int(os.environ.get("DISTNB_AGENT", "0")),  # 0: the controller's own machine
            }
        )
        out_r, err_r, fault_r, events_r = self.start_child()
        assert self.child is not None
        self.send({"t": Msg.SUP_HELLO, "rank": self.rank, "child_pid": self.child.pid})
        streams = {out_r: "stdout", err_r: "stderr"}
        reader = _EventReader()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for fd in (out_r, err_r, fault_r, events_r):
            poller.register(fd, zmq.POLLIN)
        open_fds = {out_r, err_r, fault_r, events_r}

        def close(fd: int) -> None:
            poller.unregister(fd)
            open_fds.discard(fd)
            os.close(fd)

        def drain_all() -> None:
            for fd, stream in streams.items():
                if fd in open_fds and not self._drain(fd, stream):
                    close(fd)

        os.set_blocking(events_r, False)

        def pump_events() -> None:
            """Forward the events waiting in the pipe, each after the output written before it."""
            while events_r in open_fds:
                try:
                    data = os.read(events_r, _READ_SIZE)
                except BlockingIOError:
                    return
                if not data:
                    close(events_r)
                for body in reader.feed(data):
                    # The rank flushed its output before writing the event, so those bytes are
                    # already in the pipes: forward them first, then the event.
                    drain_all()
                    self._forward_event(body)

        # The rank's exit wakes the loop through a pidfd (Linux >= 5.3): no polling for it, so an
        # idle supervisor sleeps a second at a time. Without one, look every 100 ms as before.
        try:
            pidfd = os.pidfd_open(self.child.pid)
            poller.register(pidfd, zmq.POLLIN)
            idle_ms = IDLE_POLL_MS
        except (AttributeError, OSError):
            pidfd, idle_ms = -1, 100
        last_heard = time.monotonic()
        exit_reported = False
        while True:
            events = dict(poller.poll(FAULT_POLL_MS if self.pending_fault else idle_ms))
            now = time.monotonic()
            if self.sock in events:
                while True:
                    try:
                        frames = recv_frames(self.sock, NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = self.codec.decode(frames, self.guard)
                    except BadFrame:
                        continue
                    last_heard = now
                    try:
                        self._handle(msg)
                    except Exception as exc:  # a bad request must not end the supervisor (torchrun would stop every rank)
                        print(f"distnb supervisor {self.rank}: could not handle {msg.get('t')!r}: {type(exc).__name__}: {exc}",
                              file=sys.stderr, flush=True)
            for fd, stream in streams.items():
                if fd in events and fd in open_fds and not self._drain(fd, stream):
                    close(fd)
            if fault_r in events and fault_r in open_fds:
                data = os.read(fault_r, _READ_SIZE)
                if data:
                    self.fault_buf += data
                    self.fault_deadline = max(self.fault_deadline, now + 0.05)
                else:
                    close(fault_r)
            if events_r in events and events_r in open_fds:
                pump_events()
            if self.pending_fault and now >= self.fault_deadline:
                self._finish_fault()
            rc = self.child.poll()
            if rc is not None and not exit_reported:
                died_at = time.time()  # before forwarding: which rank died first is decided by it
                # Reaped: every byte the rank wrote is in the pipes now, so take it all and report
                # at once. (Waiting for EOF instead would wait on any grandchild that inherited
                # the pipes, a DataLoader worker say, and delay the post-mortem.) What such a
                # grandchild writes later is still forwarded, as output outside any cell.
                if events_r in open_fds:
                    pump_events()
                drain_all()
                self._report_exit(rc, died_at)
                exit_reported = True
                if pidfd >= 0:  # stays readable once the rank has exited: stop watching it
                    poller.unregister(pidfd)
                    os.close(pidfd)
                    pidfd, idle_ms = -1, 100
            if self.stopping or now - last_heard > self.heartbeat_timeout:
                break
        self._stop_child()
        self.sock.close(linger=500)
        self.ctx.term()
        return 0

    def _report_exit(self, rc: int, died_at: float) -> None:
        tail = b"".join(self.stderr_tail).decode("utf-8", "replace")
        self.send({"t": Msg.RANK_EXIT, "rank": self.rank, "returncode": rc, "stderr_tail": tail, "time": died_at})
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


#: How long an idle supervisor sleeps between looks at its heartbeat deadline (its rank's exit,
#: output and requests wake it at once).
IDLE_POLL_MS = 1000
#: While a faulthandler dump is being collected, its deadline is looked at this often.
FAULT_POLL_MS = 20


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
