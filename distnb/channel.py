"""Controller-side ZMQ: one ROUTER socket owned by one I/O thread.

ZMQ sockets are not thread-safe, so every other thread hands outgoing frames to the I/O thread
through an in-process PUSH/PULL pair. Incoming frames are verified (signature, replay, sender
identity) before anything is unpickled, then handed to ``on_message`` on the I/O thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable

import zmq

from distnb.protocol import BadFrame, Codec, Msg, ReplayGuard, parse_identity
from distnb.security import Credentials

__all__ = ["Channel"]

log = logging.getLogger("distnb")

OnMessage = Callable[[str, int, dict[str, Any]], None]
_STOP = b"stop"


class Channel:
    """The controller's end of the control plane.

    ``on_message(kind, rank, msg)`` is called on the I/O thread with ``kind`` one of ``"x"``
    (rank main thread), ``"c"`` (rank control thread), ``"s"`` (rank supervisor) or ``"n"``
    (node agent; ``rank`` is then the agent's id).
    """

    def __init__(self, creds: Credentials, on_message: OnMessage, bind: str = "127.0.0.1", port: int = 0, heartbeat: float = 1.0) -> None:
        self._codec = Codec(creds.key, "C")
        self._guard = ReplayGuard()
        self._on_message = on_message
        self._heartbeat = heartbeat
        self._ctx = zmq.Context(1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
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
        self._inbox = f"inproc://distnb-out-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inbox)
        self._local = threading.local()
        self._pushers: list[zmq.Socket] = []
        self._pushers_lock = threading.Lock()
        #: Peers (supervisors, node agents) pinged every heartbeat so they know the controller lives.
        self.heartbeat_peers: set[bytes] = set()
        self._rejected = 0
        self.undeliverable = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="distnb-io", daemon=True)
        self._thread.start()

    # -- sending (any thread) -------------------------------------------------------------------
    def _pusher(self) -> zmq.Socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._inbox)
            self._local.sock = sock
            with self._pushers_lock:
                self._pushers.append(sock)
        return sock

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        if self._closed:
            return
        frames = [identity, *self._codec.encode(msg)]
        if threading.get_ident() == self._thread.ident:
            # Handlers on the I/O thread own the ROUTER: send directly, no hand-over socket.
            try:
                self._router.send_multipart(frames, copy=False)
            except zmq.ZMQError:
                self.undeliverable += 1
            return
        self._pusher().send_multipart(frames, copy=False)

    def send_many(self, identities: Iterable[bytes], msg: dict[str, Any]) -> None:
        for identity in identities:
            self.send(identity, dict(msg))

    # -- the I/O thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_beat = time.monotonic() + self._heartbeat
        while True:
            timeout_ms = max(0.0, (next_beat - time.monotonic()) * 1000)
            events = dict(poller.poll(timeout_ms))
            if self._pull in events:
                while True:
                    try:
                        frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) == 1 and frames[0].bytes == _STOP:
                        return
                    try:
                        self._router.send_multipart(frames, copy=False)
                    except zmq.ZMQError:  # peer not (or no longer) connected
                        self.undeliverable += 1
            if self._router in events:
                while True:
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive(frames)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self._heartbeat
                for peer in list(self.heartbeat_peers):
                    try:
                        self._router.send_multipart([peer, *self._codec.encode({"t": Msg.PING})])
                    except zmq.ZMQError:
                        self.undeliverable += 1
                self._on_message("", -1, {"t": "tick"})

    def _receive(self, frames: list[bytes]) -> None:
        try:
            kind, rank = parse_identity(frames[0])
            msg = self._codec.decode(frames[1:], self._guard)
            if msg.get("_s") != frames[0].decode():
                raise BadFrame("sender name does not match its connection")
        except BadFrame as exc:
            self._rejected += 1
            log.debug("dropped a frame: %s", exc)
            return
        try:
            self._on_message(kind, rank, msg)
        except Exception:  # a bug in a handler must not kill the I/O thread
            log.exception("distnb: error while handling %s from rank %s", msg.get("t"), rank)

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
        self._closed = True
        stopper = self._ctx.socket(zmq.PUSH)
        stopper.setsockopt(zmq.LINGER, 1000)
        stopper.connect(self._inbox)
        stopper.send(_STOP)
        self._thread.join(5.0)
        stopper.close()
        with self._pushers_lock:
            for sock in self._pushers:
                sock.close(linger=0)
            self._pushers.clear()
        self._pull.close(linger=0)
        self._close_sockets()
