"""The rank supervisor: the process torchrun starts for each rank.

It imports no torch. It starts the real rank process (:mod:`distnb.worker.process.rank`) as its child and
owns the child's stdout/stderr pipes, so that:

* output reaches the controller the moment it is written, Python- and C-level alike;
* the last stderr lines of a rank that dies abruptly (SIGKILL, SIGABRT, segfault) are not lost;
* the exact exit code or signal of the rank is known (it is our child: ``waitpid``);
* a faulthandler dump of the rank's main thread can be requested with SIGUSR1 (sent to that
  thread) and read back even while the rank holds the GIL in a C loop.

When the rank dies the supervisor stays up (so torchrun does not tear down the other ranks, whose
state the user wants to inspect) until the controller says shut down or stops sending heartbeats.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import zmq

from distnb import _processes
from distnb.wire.black_box import ENV as BLACK_BOX_ENV
from distnb.wire.black_box import BlackBox
from distnb.wire.codec import BadFrame, Codec, FrameTooLarge, ReplayGuard, socket_max_msgsize
from distnb.wire.peers import PeerKind, supervisor_identity
from distnb.wire.protocol import Msg, ToSupervisor, accept_request
from distnb.wire.security import Credentials
from distnb.wire.zmq_io import drain, send_frames
from distnb.worker.process.child import Child
from distnb.worker.process.quiet import ReadFence
from distnb.worker.process.zygote import ForkedRank, Zygote

#: The most a supervisor reads from a rank's pipe at once: an OUTPUT frame carries at most this.
READ_SIZE = 1 << 16
_TAIL_BYTES = 16 * 1024

class Supervisor:
    def __init__(self) -> None:
        self.rank = int(os.environ["RANK"])
        self.addr = os.environ["DISTNB_ADDR"]
        creds = Credentials.from_env(os.environ)
        self.heartbeat_timeout = float(os.environ.get("DISTNB_HEARTBEAT_TIMEOUT", "15"))
        # The controller's silence is noticed within a quarter of the timeout past it.
        self.deadline_ms = max(1, int(self.heartbeat_timeout * 250))
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
        self.current: Child | None = None  # the rank process now, with its pipes
        self.spare: Child | None = None  # a rank process that has imported torch, waiting (see _respawn)
        self.zygote: Zygote | None = None  # forks fresh ranks with a session's modules loaded (SPARE with modules)
        self.poller = zmq.Poller()
        self.stderr_tail: collections.deque[bytes] = collections.deque()
        self.stderr_tail_bytes = 0
        self.pending_fault: list[str] = []  # request ids waiting for a faulthandler dump
        self.fault_buf = b""
        self.fault_deadline = 0.0
        self.stopping = False

    @property
    def child(self) -> subprocess.Popen[bytes] | ForkedRank | None:
        """The rank process now."""
        return self.current.proc if self.current is not None else None

    def send(self, msg: dict[str, Any]) -> None:
        send_frames(self.sock, self.codec.encode(msg))

    def start_child(self, spare: bool = False) -> Child:
        """A rank process with its pipes; a ``spare`` imports torch, then waits for :meth:`Child.wake`.
        With a zygote (``SPARE`` naming modules), the rank is forked from it, those modules loaded."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fault_r, fault_w = os.pipe()
        events_r, events_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        fence = ReadFence()
        passed = {"DISTNB_FAULT_FD": fault_w, "DISTNB_EVENTS_FD": events_w, "DISTNB_READ_FENCE_FD": fence.fd}
        box = BlackBox.create()
        if box is not None:
            passed[BLACK_BOX_ENV] = box.fd
        wake_w = -1
        proc: subprocess.Popen[bytes] | ForkedRank | None = None
        if not spare and self.zygote is not None:
            proc = self.zygote.fork(env, out_w, err_w, passed, ZYGOTE_WAIT)
            if proc is None:
                self._end_zygote()
        if proc is None:
            if spare:
                wake_r, wake_w = os.pipe()
                passed["DISTNB_SPARE_FD"] = wake_r
            env.update((name, str(fd)) for name, fd in passed.items())
            proc = subprocess.Popen(
                [sys.executable, "-m", "distnb.worker.process.rank"],
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                pass_fds=list(passed.values()),
                env=env,
                # The rank must never outlive its supervisor; SIGKILL because a rank blocked in a
                # collective would not act on SIGTERM.
                preexec_fn=_die_with_parent,
            )
        for fd in (out_w, err_w, *passed.values()):
            if fd != fence.fd and (box is None or fd != box.fd):  # the supervisor keeps its own mapping of the box
                os.close(fd)
        fence.passed()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)  # drained to EAGAIN before each event is forwarded
        os.set_blocking(events_r, False)
        return Child(proc, out_r, err_r, fault_r, events_r, wake_w, fence, box)

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
                data = os.read(fd, READ_SIZE)
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

    def _handle(self, msg: ToSupervisor) -> None:
        child = self.child
        if msg["t"] == Msg.SHUTDOWN:
            self.stopping = True
        elif msg["t"] == Msg.FAULT_REQUEST:
            if child is not None and child.poll() is None:
                if not self.pending_fault:
                    # A dump nobody waits for any more (it came late: a rank that was stopped
                    # when asked dumps on SIGCONT) must not pass for the answer to this request.
                    self.fault_buf = b""
                self.pending_fault.append(msg["id"])
                self.fault_deadline = time.monotonic() + float(msg.get("wait", 0.3))
                try:
                    _processes.signal_main_thread(child.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass  # it just died: its death is reported, and the deadline answers the request
            else:
                self.send({"t": Msg.REPLY, "id": msg["id"], "rank": self.rank, "text": "", "alive": False})
        elif msg["t"] == Msg.INTERRUPT:
            # Fallback path: the rank's own control thread normally delivers interrupts.
            if child is not None and child.poll() is None:
                os.kill(child.pid, signal.SIGINT)
        elif msg["t"] == Msg.RESPAWN:
            self._respawn(int(msg["generation"]))
        elif msg["t"] == Msg.SPARE:
            if self.zygote is not None and not self.zygote.alive():
                self._end_zygote()
            if msg.get("modules"):
                self._warm(msg["modules"])
                return
            if self.zygote is not None:
                return  # it forks the next rank
            if self.spare is not None and self.spare.proc.poll() is not None:
                self.spare.discard(self.poller)  # died while waiting (its pipes go with it)
                self.spare = None
            if self.spare is None:
                self.spare = self.start_child(spare=True)

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
                "agent": int(os.environ.get("DISTNB_AGENT", "0")),  # 0: the controller's machine
            }
        )
        self.poller.register(self.sock, zmq.POLLIN)
        self._adopt(self.start_child())
        last_heard = time.monotonic()
        while True:
            child = self.current
            assert child is not None
            events = dict(self.poller.poll(FAULT_POLL_MS if self.pending_fault else min(child.idle_ms, self.deadline_ms)))
            now = time.monotonic()
            if self.sock in events:
                for frames in drain(self.sock):
                    try:
                        msg = accept_request(PeerKind.SUPERVISOR, self.codec.decode(frames, self.guard))
                    except BadFrame:
                        continue
                    last_heard = now
                    try:
                        self._handle(msg)
                    except Exception as exc:  # a bad request must not end the supervisor (torchrun would stop every rank)
                        print(f"distnb supervisor {self.rank}: could not handle {msg.get('t')!r}: {type(exc).__name__}: {exc}",
                              file=sys.stderr, flush=True)
                if self.current is not child:
                    # A RESPAWN: this poll's events were the old rank's pipes, whose numbers the new
                    # rank's may reuse (its fault pipe blocks on read): poll again for the new ones.
                    continue
            reading = child.fence is not None and not child.open_fds.isdisjoint(events)
            if reading:
                child.fence.enter()  # type: ignore[union-attr]
            for fd, stream in child.streams.items():
                if fd in events and fd in child.open_fds and not self._drain(fd, stream):
                    child.close(fd, self.poller)
            if child.fault_r in events and child.fault_r in child.open_fds:
                data = os.read(child.fault_r, READ_SIZE)
                if data:
                    self.fault_buf += data
                    self.fault_deadline = max(self.fault_deadline, now + 0.05)
                else:
                    child.close(child.fault_r, self.poller)
            if child.events_r in events and child.events_r in child.open_fds:
                self._pump_events(child)
            if reading:
                child.fence.leave()  # type: ignore[union-attr]
            if self.pending_fault and now >= self.fault_deadline:
                self._finish_fault()
            rc = child.proc.poll()
            if rc is not None and not child.exit_reported:
                died_at = time.time()  # before forwarding: which rank died first is decided by it
                # Reaped: every byte the rank wrote is in the pipes now, so take it all and report
                # at once. (Waiting for EOF instead would wait on any grandchild that inherited
                # the pipes, a DataLoader worker say, and delay the post-mortem.) What such a
                # grandchild writes later is still forwarded, as output outside any cell.
                self._pump_events(child)
                self._drain_all(child)
                self._report_exit(rc, died_at, child)
                child.exit_reported = True
                child.unwatch_exit(self.poller)
            if self.stopping or now - last_heard > self.heartbeat_timeout:
                break
        self._stop_child()
        if self.spare is not None:
            self.spare.discard(self.poller)
        self._end_zygote()
        self.sock.close(linger=500)
        self.ctx.term()
        return 0

    def _drain_all(self, child: Child) -> None:
        for fd, stream in child.streams.items():
            if fd in child.open_fds and not self._drain(fd, stream):
                child.close(fd, self.poller)

    def _pump_events(self, child: Child) -> None:
        """Forward the events waiting in the pipe, each after the output written before it."""
        while child.events_r in child.open_fds:
            try:
                data = os.read(child.events_r, READ_SIZE)
            except BlockingIOError:
                return
            if not data:
                child.close(child.events_r, self.poller)
            for body in child.reader.feed(data):
                # The rank flushed its output before writing the event, so those bytes are
                # already in the pipes: forward them first, then the event.
                self._drain_all(child)
                self._forward_event(body)

    def _adopt(self, child: Child) -> None:
        """Make ``child`` the rank this supervisor watches and forwards."""
        self.current = child
        child.watch(self.poller)
        self.send({"t": Msg.SUP_HELLO, "rank": self.rank, "child_pid": child.proc.pid})

    def _respawn(self, generation: int) -> None:
        """A fresh rank in place of the current one (``%dist_restart`` without restarting torchrun):
        the old one is killed — it is thrown away, so it is not reported as a death — and the
        spare, which has imported torch already, joins a new process group under a store prefix of
        its own; without a spare, a new process is started."""
        old = self.current
        if old is not None:  # what it had not sent yet belongs to the pool being thrown away
            old.discard(self.poller)
        self.pending_fault.clear()
        self.fault_buf = b""
        self.stderr_tail.clear()
        self.stderr_tail_bytes = 0
        spare, self.spare = self.spare, None
        update = {"DISTNB_GENERATION": str(generation)}
        if spare is not None and spare.wake(update):
            self._adopt(spare)
            return
        if spare is not None:
            spare.discard(self.poller)
        os.environ.update(update)
        self._adopt(self.start_child())

    def _warm(self, modules: list[str]) -> None:
        """Fresh ranks from now on are forked from a zygote that has imported ``modules`` (the
        session's: %dist_minimize's tries); it takes the spare's place."""
        if self.zygote is None:
            self.zygote = Zygote.start(dict(os.environ), _die_with_parent)
            if self.spare is not None:
                self.spare.discard(self.poller)
                self.spare = None
        self.zygote.warm(modules)

    def _end_zygote(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    def _report_exit(self, rc: int, died_at: float, child: Child) -> None:
        tail = b"".join(self.stderr_tail).decode("utf-8", "replace")
        # A clean exit has nothing to explain; a death, the calls it cut short.
        last_calls = child.box.read() if child.box is not None and rc != 0 else []
        self.send({"t": Msg.RANK_EXIT, "rank": self.rank, "returncode": rc, "stderr_tail": tail, "time": died_at,
                   "last_calls": last_calls})
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


#: How long a fresh rank waits for the zygote to fork it: it may still be importing what it was
#: told to (torch._dynamo: ~10 s on a busy machine), which a fresh process would import as slowly.
ZYGOTE_WAIT = 50.0


def _die_with_parent() -> None:
    _processes.set_parent_death_signal(signal.SIGKILL)


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
