"""Controller-side ZMQ: one ROUTER socket, received from by one I/O thread, sent on by any.

ZMQ sockets are not thread-safe, so every use of the ROUTER holds one lock. The I/O thread does not
sleep in ``zmq_poll`` on the socket (that would touch it unlocked); it sleeps on the socket's
``ZMQ_FD`` and an eventfd of its own, and reads the socket's ``ZMQ_EVENTS`` under the lock. A thread
that sends a cell's EXEC sends it itself, at once: handing it to the I/O thread first cost a thread
wake on the way out of every cell, ~0.3 ms in a kernel whose other threads want the GIL. Incoming
frames are verified (signature, replay, sender identity) before anything is unpickled, then handed
to ``on_message`` on the I/O thread, outside the socket's lock.

The I/O thread is the pool's lifeline: if it died, heartbeats would stop and every worker would
shut itself down ~15 s later with nothing said in the notebook. So an exception in a handler or
in the periodic tick is counted and kept (``errors``, ``last_error``) and the thread carries on.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import select
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

import zmq

from distnb.controller.internal_errors import InternalErrors
from distnb.wire.codec import BadFrame, Codec, ReplayGuard, socket_max_msgsize
from distnb.wire.peers import Peer, PeerKind, generation_of, in_generation, parse_identity
from distnb.wire.protocol import Inbound, Msg, accept
from distnb.wire.security import Credentials
from distnb.wire.zmq_io import drain, send_frames

__all__ = ["Channel", "FollowUp"]

log = logging.getLogger("distnb")

OnMessage = Callable[[Peer, Inbound], None]


class FollowUp(NamedTuple):
    """``fn`` runs on the I/O thread ``after`` seconds from now, unless ``wanted()`` (asked on
    the I/O thread whenever it plans its next wake) is False by then: it is then dropped, and no
    wake is spent on it."""

    after: float
    fn: Callable[[], None]
    wanted: Callable[[], bool]

#: Messages received in one go before they are handled (senders get the lock in between).
_TAKE_MAX = 256
#: Frames queued per peer before its connection is no longer read (ZMQ's default is 1,000): output
#: travels in frames of at most 64 KiB (worker/process/supervisor.py), so a flooding rank holds at most
#: 16 MiB of the notebook's memory in flight.
ROUTER_RCVHWM = 256
#: Seconds between the I/O thread's ticks (the tracker's checks: deaths without a report, stranded
#: cells, collective-log polls).
TICK = 1.0


class Channel:
    """The controller's end of the control plane.

    ``on_message(peer, msg)`` is called on the I/O thread with the :class:`~distnb.wire.peers.Peer`
    the frame came from and the message as its typed kind, once
    :func:`~distnb.wire.protocol.accept` found it is one that peer may send, with its fields (a
    message that is not is rejected and counted, and never reaches a handler). ``on_tick()`` is called on the same thread
    every ``heartbeat`` seconds, after the pings when they are due (every ``ping_every``).
    """

    def __init__(
        self,
        creds: Credentials,
        on_message: OnMessage,
        on_tick: Callable[[], None] | None = None,
        bind: str = "127.0.0.1",
        port: int = 0,
        heartbeat: float = TICK,
        ping_every: float | None = None,
    ) -> None:
        # The I/O thread signs as "C"; every other thread as "C<n>" with its own counter (see
        # ``_thread_codec``), so each sender's frames reach a peer in the order they were signed.
        self._key = creds.key
        self._codec = Codec(creds.key, "C")
        #: Which ranks' connections (exec, control) messages go to and come from: 0 for the ranks
        #: torchrun started, N after the Nth respawn (see peers.exec_identity).
        self.generation = 0
        self._senders = itertools.count(1)
        self._guard = ReplayGuard()
        self._on_message = on_message
        self._on_tick = on_tick
        self._heartbeat = heartbeat
        #: Peers are pinged at most this often (a tick, at least): every wake costs each supervisor
        #: ~0.1 ms of CPU, and an idle pool should sleep (see LaunchConfig.ping_interval).
        self._ping_every = heartbeat if ping_every is None else max(heartbeat, ping_every)
        self._next_ping = 0.0
        self._ctx = zmq.Context(1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # libzmq disconnects a peer sending a bigger part before buffering it: without this, anyone
        # who can reach the port could make this process hold frames of any size.
        self._router.setsockopt(zmq.MAXMSGSIZE, socket_max_msgsize())
        # A rank printing faster than this thread handles its output queues frames here, up to the
        # receive bound per peer; past it libzmq stops reading that connection and the rank waits
        # on its pipe (flow control), so a flood costs the notebook a bounded amount of memory.
        self._router.setsockopt(zmq.RCVHWM, ROUTER_RCVHWM)
        self._gate = creds.secure_server(self._ctx, self._router)
        try:
            if port:
                self._router.bind(f"tcp://{bind}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{bind}")
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"can't listen on {bind}:{port or '(any port)'}: {exc}. Pass an address of this machine "
                          "(--bind) and a free port.") from None
        self.address = f"tcp://{bind}:{port}"
        #: Held for every use of the ROUTER, by whichever thread.
        self._sock_lock = threading.Lock()
        self._router_fd = int(self._router.getsockopt(zmq.FD))
        #: Wakes the I/O thread: a follow-up due before its planned wake, a message a sender's
        #: EVENTS check found waiting, close().
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        #: When the I/O thread will wake on its own (inf while it plans, 0 while awake).
        self._planned_wake = 0.0
        self._local = threading.local()
        #: Peers (supervisors, node agents) pinged every ``ping_every`` so they know the controller lives.
        self.heartbeat_peers: set[bytes] = set()
        self._rejected = 0
        self.undeliverable = 0
        #: Exceptions caught on the I/O thread (handlers, the tick, the loop itself).
        self.caught = InternalErrors(log)
        #: Follow-ups (see send_many) by when they are due: ``(when, n, follow-up)``.
        self._timers: list[tuple[float, int, FollowUp]] = []
        self._timers_lock = threading.Lock()
        self._timer_count = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="distnb-io", daemon=True)
        self._thread.start()

    # -- sending (any thread) -------------------------------------------------------------------
    def _thread_codec(self) -> Codec:
        """This thread's own signer.

        Peers drop a frame whose counter is not above the last one from its sender. Messages are
        signed before the socket's lock is taken (a large push must not hold up the I/O thread
        while it is pickled), so two threads' frames can be sent in the opposite order to the one
        they were signed in: with one shared counter a peer would drop the later-sent one as a
        replay. One sender name and counter per thread keeps every sender in order."""
        if threading.get_ident() == self._thread.ident:
            return self._codec
        codec = getattr(self._local, "codec", None)
        if codec is None:
            codec = self._local.codec = Codec(self._key, f"C{next(self._senders)}")
        return codec

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.send_many((identity,), msg)

    def send_many(self, identities: Iterable[bytes], msg: dict[str, Any], follow_up: FollowUp | None = None) -> None:
        """Send one message to several peers (a cell's EXEC to every rank, a push of a large
        value): signed once, on the calling thread, and sent from it.

        ``follow_up`` (a cell's watch, for a cell that runs on) is registered after the message has
        left, and the I/O thread is woken for it only when it would otherwise sleep past it."""
        if self._closed:
            return
        ids = list(identities)
        if not ids:
            return
        self._route(ids, self._thread_codec().encode(msg))
        if follow_up is not None:
            when = time.monotonic() + follow_up.after
            with self._timers_lock:
                heapq.heappush(self._timers, (when, next(self._timer_count), follow_up))
            if when < self._planned_wake:
                self._poke()

    def _route(self, identities: list[bytes], signed: list[Any]) -> None:
        generation = self.generation
        with self._sock_lock:
            if self._closed:
                return
            for identity in identities:
                identity = in_generation(identity, generation)  # the ranks' current connections
                try:
                    send_frames(self._router, [identity, *signed])
                except zmq.ZMQError:  # peer not (or no longer) connected
                    self.undeliverable += 1
            # A send may have taken the ZMQ_FD signal of a message that arrived meanwhile, which
            # the I/O thread sleeps on: tell it, or that message would wait for its next wake.
            waiting = self._waiting()
        if waiting and threading.get_ident() != self._thread.ident:
            self._poke()

    def _waiting(self) -> bool:
        """Whether a message waits on the ROUTER (with the lock held: reading EVENTS consumes its FD's signal)."""
        return bool(int(self._router.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _poke(self) -> None:
        with self._sock_lock:  # not after close() let the descriptor go (its number may be reused)
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)

    # -- the I/O thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._router_fd, select.POLLIN)
        poller.register(self._wake_fd, select.POLLIN)
        next_beat = time.monotonic() + self._heartbeat
        while not self._closed:
            try:
                self._step(poller, next_beat)
            except zmq.ContextTerminated:
                return
            except Exception:  # never let the lifeline die; a hot failure loop is slowed down below
                self._failed("the I/O loop")
                time.sleep(0.05)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._heartbeat
                self._beat()
            self._run_due()

    def _next_timer(self) -> float | None:
        """When the next wanted follow-up is due; those no longer wanted are dropped."""
        while True:
            with self._timers_lock:
                if not self._timers:
                    return None
                when, _, follow_up = self._timers[0]
            try:
                wanted = follow_up.wanted()
            except Exception:
                self._failed("a follow-up's check")
                wanted = False
            if wanted:
                return when
            with self._timers_lock:
                if self._timers and self._timers[0][2] is follow_up:
                    heapq.heappop(self._timers)

    def _run_due(self) -> None:
        now = time.monotonic()
        while True:
            with self._timers_lock:
                if not self._timers or self._timers[0][0] > now:
                    return
                follow_up = heapq.heappop(self._timers)[2]
            try:
                if follow_up.wanted():
                    follow_up.fn()
            except Exception:
                self._failed("a follow-up")

    def _take(self) -> list[list[bytes]]:
        """The messages waiting on the ROUTER (up to ``_TAKE_MAX``), received under the lock."""
        with self._sock_lock:
            if self._closed:
                return []
            return list(itertools.islice(drain(self._router), _TAKE_MAX))

    def _step(self, poller: select.poll, next_beat: float) -> None:
        """Handle what waits; else sleep until something comes, a follow-up or the next beat."""
        taken = self._take()
        if taken:
            # Outside the socket's lock: handlers take the tracker's, which a sending thread may hold.
            for frames in taken:
                self._receive(frames)
            return  # look again before sleeping: more may have come meanwhile
        self._planned_wake = math.inf  # a follow-up registered from here on wakes us (see send_many)
        timer = self._next_timer()
        wake = next_beat if timer is None else min(next_beat, timer)
        self._planned_wake = wake
        with self._sock_lock:  # something may have come since _take: its FD signal may be spent
            waiting = not self._closed and self._waiting()
        if not waiting:
            poller.poll(max(0, math.ceil((wake - time.monotonic()) * 1000)))
        self._planned_wake = 0.0
        try:
            os.eventfd_read(self._wake_fd)
        except BlockingIOError:
            pass

    def _beat(self) -> None:
        """Heartbeats first (workers shut down without them), then the pool's periodic checks."""
        now = time.monotonic()
        # A tick that comes early by less than a poll's rounding still pings: not a tick later.
        pinging = now >= self._next_ping - self._heartbeat / 2
        if pinging:
            self._next_ping = now + self._ping_every
        if pinging and self.heartbeat_peers:
            # Supervisors and node agents keep their names in every generation: _route leaves them be.
            self._route(list(self.heartbeat_peers), self._codec.encode({"t": Msg.PING}))
        if self._on_tick is None:
            return
        try:
            self._on_tick()
        except Exception:
            self._failed("the periodic check (tick)")

    def _failed(self, what: str) -> None:
        """Count and keep the exception being handled; log each failure site once at ERROR."""
        self.caught.caught(what)

    @property
    def errors(self) -> int:
        return self.caught.count

    @property
    def last_error(self) -> str | None:
        return self.caught.last

    def _receive(self, frames: list[bytes]) -> None:
        try:
            peer = parse_identity(frames[0])
            raw = self._codec.decode(frames[1:])
            if raw.get("_s") != frames[0].decode():
                raise BadFrame("sender name does not match its connection")
            if peer.kind in (PeerKind.EXEC, PeerKind.CONTROL) and generation_of(frames[0]) != self.generation:
                return  # signed, but from a rank a respawn replaced, heard late: its pool is gone
            # Only now: a frame carrying another peer's name must not move that peer's counter
            # forward, or the real peer's next frames would all look like replays.
            self._guard.check(raw["_s"], raw["_n"])
        except BadFrame as exc:
            self._rejected += 1
            log.debug("dropped a frame: %s", exc)
            return
        try:
            msg = accept(peer.kind, raw)
        except BadFrame as exc:  # signed by the pool's key, so a bug or another version: said, not only counted
            self._rejected += 1
            self._failed(f"a malformed message from {frames[0].decode(errors='replace')} ({exc})")
            return
        try:
            self._on_message(peer, msg)
        except Exception:  # a bug in a handler must not kill the I/O thread
            self._failed(f"handling {msg['t']!r} from {frames[0].decode(errors='replace')}")

    @property
    def alive(self) -> bool:
        """Whether the I/O thread runs (False only after ``close``, or if something truly fatal hit it)."""
        return self._thread.is_alive()

    @property
    def rejected(self) -> int:
        """Frames dropped unread (bad signature, replay, wrong sender) plus CURVE handshakes refused."""
        return self._rejected + (self._gate.refused if self._gate else 0)

    def _close_sockets(self) -> None:
        self._router.close(linger=0)
        if self._gate is not None:
            self._gate.stop()
        self._ctx.term()

    def close(self) -> None:
        if self._closed:
            return
        with self._sock_lock:  # no send is half done when the I/O thread and the socket go
            self._closed = True
        self._poke()
        self._thread.join(5.0)
        with self._sock_lock:
            self._close_sockets()
            os.close(self._wake_fd)
            self._wake_fd = -1
