"""A rank process as its supervisor holds it: the process (started, or forked by a zygote), the
read ends of its pipes, and the length-prefixed events the rank writes on its private one."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
from typing import Any, Mapping

import zmq

from distnb.wire.black_box import BlackBox
from distnb.worker.process.quiet import ReadFence
from distnb.worker.process.zygote import ForkedRank

__all__ = ["Child", "EventReader", "IDLE_POLL_MS", "write_event"]

#: How long an idle supervisor sleeps between looks at its heartbeat deadline, at most (its rank's
#: exit, output, requests and the controller's pings wake it at once).
IDLE_POLL_MS = 5000

_LEN = struct.Struct("!I")


def write_event(fd: int, msg: Mapping[str, Any]) -> None:
    """Rank side: one length-prefixed pickled event on the private pipe to the supervisor."""
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_LEN.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data):]


class EventReader:
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


class Child:
    """A rank process and the read ends of its pipes (stdout, stderr, faulthandler dumps, events)."""

    def __init__(self, proc: subprocess.Popen[bytes] | ForkedRank, out_r: int, err_r: int, fault_r: int, events_r: int, wake_w: int = -1,
                 fence: ReadFence | None = None, box: BlackBox | None = None) -> None:
        self.proc = proc
        self.box = box  # the rank's last calls, read when it dies (wire/black_box.py)
        self.fence = fence  # moved around every read of its pipes (see worker/process/quiet.py)
        self.streams = {out_r: "stdout", err_r: "stderr"}
        self.fault_r, self.events_r, self.wake_w = fault_r, events_r, wake_w
        self.open_fds = {out_r, err_r, fault_r, events_r}
        self.reader = EventReader()
        self.exit_reported = False
        self.exit_fd = -1  # readable once the rank has exited: a pidfd of our own, or a forked rank's status pipe
        self.idle_ms = 100
        self._watched = False

    def watch(self, poller: zmq.Poller) -> None:
        for fd in self.open_fds:
            poller.register(fd, zmq.POLLIN)
        self._watched = True
        # The rank's exit wakes the loop through a pidfd (Linux >= 5.3): no polling for it, so an
        # idle supervisor sleeps until a ping or its heartbeat deadline. Without one, look every 100 ms.
        # A forked rank's exit is its status arriving (a pidfd would wake the loop before the zygote
        # has reaped it, and go on waking it until then).
        try:
            self.exit_fd = self.proc.exit_fd if isinstance(self.proc, ForkedRank) else os.pidfd_open(self.proc.pid)
            poller.register(self.exit_fd, zmq.POLLIN)
            self.idle_ms = IDLE_POLL_MS
        except (AttributeError, OSError):
            self.exit_fd, self.idle_ms = -1, 100

    def unwatch_exit(self, poller: zmq.Poller) -> None:
        """Stop watching the exit: it stays readable once the rank has exited."""
        if self.exit_fd >= 0:
            poller.unregister(self.exit_fd)
            if not isinstance(self.proc, ForkedRank):  # the status pipe is the ForkedRank's
                os.close(self.exit_fd)
            self.exit_fd, self.idle_ms = -1, 100

    def close(self, fd: int, poller: zmq.Poller) -> None:
        if self._watched:
            poller.unregister(fd)
        self.open_fds.discard(fd)
        os.close(fd)

    def wake(self, env: dict[str, str]) -> bool:
        """Tell a spare to become the rank, with ``env`` added to its environment; False if it is gone."""
        if self.proc.poll() is not None or self.wake_w < 0:
            return False
        try:
            os.write(self.wake_w, pickle.dumps(env))
        except OSError:
            return False
        finally:
            os.close(self.wake_w)
            self.wake_w = -1
        return True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:  # stuck in the kernel: the controller's checks will name it
            pass

    def discard(self, poller: zmq.Poller) -> None:
        """Kill it (if alive) and close every pipe."""
        self.kill()
        self.unwatch_exit(poller)
        for fd in list(self.open_fds):
            self.close(fd, poller)
        if self.wake_w >= 0:
            os.close(self.wake_w)
            self.wake_w = -1
        if self.fence is not None:
            self.fence.close()
            self.fence = None
        if self.box is not None:
            self.box.close()
            self.box = None
        if isinstance(self.proc, ForkedRank):
            self.proc.close()
