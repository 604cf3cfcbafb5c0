"""A pool's credentials: the frame-signing key, optional CURVE keys, and the key file nodes read.

Every frame on the control plane is signed with the pool's key (see :mod:`distnb.wire.protocol`),
so a peer without the key is never unpickled. CURVE (libzmq's encryption) is optional on top: it
hides cell code, outputs and values from anyone who can watch the network, and with it the
controller refuses, at the handshake, every client that does not hold the pool's client key.

The key file handed to other nodes holds the signing key and, with CURVE, the server's public key
and the client key pair; never the server's secret key. Like ssh, a key file that other users can
read is refused.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Mapping, MutableMapping

import zmq

from distnb.wire.codec import new_key

__all__ = ["Credentials", "KeyFileError", "default_key_file"]

_FORMAT = "distnb-key-1"


class KeyFileError(ValueError):
    """A key file that is missing, unreadable, malformed or readable by other users."""


def default_key_file(pool_id: str) -> Path:
    """``~/.distnb/keys/<pool>.key``: in the home folder, which cluster nodes usually share."""
    return Path.home() / ".distnb" / "keys" / f"{pool_id}.key"


@dataclass(frozen=True)
class Credentials:
    key: bytes
    curve_server_public: bytes | None = None
    curve_server_secret: bytes | None = None  # the controller's alone
    curve_client_public: bytes | None = None
    curve_client_secret: bytes | None = None

    @classmethod
    def new(cls, curve: bool = False) -> Credentials:
        if not curve:
            return cls(new_key())
        if not zmq.has("curve"):
            raise RuntimeError("this pyzmq's libzmq was built without CURVE; install pyzmq from its wheels (pip install -U pyzmq).")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(new_key(), server_public, server_secret, client_public, client_secret)

    @property
    def curve(self) -> bool:
        return self.curve_server_public is not None

    def for_nodes(self) -> Credentials:
        """What other nodes get: everything but the server's secret key."""
        return replace(self, curve_server_secret=None)

    # -- the key file ---------------------------------------------------------------------------
    def dumps(self) -> str:
        data: dict[str, str] = {"format": _FORMAT, "key": self.key.hex()}
        if self.curve:
            assert self.curve_server_public and self.curve_client_public and self.curve_client_secret
            data.update(curve_server=self.curve_server_public.decode(), curve_public=self.curve_client_public.decode(),
                        curve_secret=self.curve_client_secret.decode())
        return json.dumps(data)

    @classmethod
    def loads(cls, text: str, source: str = "the key") -> Credentials:
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != _FORMAT:
                raise ValueError("not a distnb key")
            key = bytes.fromhex(data["key"])
            if len(key) < 16:
                raise ValueError("key too short")
            if "curve_server" in data:
                return cls(key, data["curve_server"].encode(), None, data["curve_public"].encode(), data["curve_secret"].encode())
            return cls(key)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeyFileError(f"{source} is not a distnb key file ({exc}); use the file the controller printed with its join command.") from None

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the nodes' share to ``path``, readable by this user only."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.for_nodes().dumps())
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | os.PathLike[str] | IO[str]) -> Credentials:
        """Read a key file (``"-"``: standard input), refusing one that other users can read."""
        if path == "-":
            return cls.loads(sys.stdin.readline(), "standard input")
        if not isinstance(path, (str, os.PathLike)):
            return cls.loads(path.read(), "the key stream")
        path = Path(path).expanduser()
        try:
            mode = path.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise KeyFileError(f"key file {path} can be read by other users; run `chmod 600 {path}` first.")
            text = path.read_text()
        except OSError as exc:
            raise KeyFileError(f"can't read key file {path}: {exc.strerror}. Copy it from the controller's machine "
                               "(it is printed with the join command) or pass the path it has on this node.") from None
        return cls.loads(text, f"key file {path}")

    # -- worker environment ---------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment variables that carry the nodes' share to worker processes."""
        out = {"DISTNB_KEY": self.key.hex()}
        if self.curve:
            assert self.curve_server_public and self.curve_client_public and self.curve_client_secret
            out.update(DISTNB_CURVE_SERVER=self.curve_server_public.decode(), DISTNB_CURVE_PUBLIC=self.curve_client_public.decode(),
                       DISTNB_CURVE_SECRET=self.curve_client_secret.decode())
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] | MutableMapping[str, str], pop: bool = False) -> Credentials:
        def take(name: str) -> str | None:
            # Popped, so the key stays out of what the user's code and its subprocesses can read.
            if pop and isinstance(env, MutableMapping):
                return env.pop(name, None)
            return env.get(name)

        hex_key = take("DISTNB_KEY")
        if hex_key is None:
            raise KeyError("DISTNB_KEY")
        key = bytes.fromhex(hex_key)
        server, public, secret = (take(n) for n in ("DISTNB_CURVE_SERVER", "DISTNB_CURVE_PUBLIC", "DISTNB_CURVE_SECRET"))
        if server and public and secret:
            return cls(key, server.encode(), None, public.encode(), secret.encode())
        return cls(key)

    # -- sockets --------------------------------------------------------------------------------
    def secure_client(self, sock: zmq.Socket[bytes]) -> None:
        """Call before ``connect``."""
        if self.curve:
            sock.curve_serverkey = self.curve_server_public
            sock.curve_publickey = self.curve_client_public
            sock.curve_secretkey = self.curve_client_secret

    def secure_server(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> HandshakeGate | None:
        """Call before ``bind``. With CURVE, returns the gate that admits only the pool's client key."""
        if not self.curve:
            return None
        if self.curve_server_secret is None:
            raise ValueError("only the controller (which holds the server's secret key) can serve CURVE.")
        gate = HandshakeGate(ctx, self.curve_client_public or b"")
        sock.curve_secretkey = self.curve_server_secret
        sock.curve_publickey = self.curve_server_public
        sock.curve_server = True
        return gate


class HandshakeGate:
    """A ZAP handler (pyzmq's authenticator thread) that admits only the pool's client key and
    counts the handshakes it refused."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], allowed: bytes) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.refused = 0
        self._allowed = allowed
        self._lock = threading.Lock()
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self._allowed
        if not ok:
            with self._lock:
                self.refused += 1
        return ok

    def stop(self) -> None:
        self._auth.stop()
