"""Credentials and key files: what other nodes get, how it is stored, and what is refused."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import zmq

from distnb.wire.security import Credentials, KeyFileError


def test_key_file_round_trip_is_private(tmp_path: Path) -> None:
    creds = Credentials.new()
    path = creds.write(tmp_path / "keys" / "pool.key")
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o077 == 0
    assert Credentials.read(path) == creds
    assert Credentials.read(io.StringIO(path.read_text())) == creds


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_nodes_never_get_the_servers_secret(tmp_path: Path) -> None:
    creds = Credentials.new(curve=True)
    assert creds.curve and creds.curve_server_secret
    path = creds.write(tmp_path / "pool.key")
    stored = json.loads(path.read_text())
    assert creds.curve_server_secret.decode() not in path.read_text()
    assert set(stored) == {"format", "key", "curve_server", "curve_public", "curve_secret"}
    node = Credentials.read(path)
    assert node == creds.for_nodes() and node.curve_server_secret is None
    with pytest.raises(ValueError, match="only the controller"):
        ctx = zmq.Context()
        try:
            node.secure_server(ctx, ctx.socket(zmq.ROUTER))
        finally:
            ctx.destroy(linger=0)


def test_worker_environment_round_trip() -> None:
    creds = Credentials.new(curve=zmq.has("curve"))
    env = {"OTHER": "1", **creds.env()}
    assert Credentials.from_env(env) == creds.for_nodes()
    assert Credentials.from_env(env, pop=True) == creds.for_nodes()
    assert env == {"OTHER": "1"}  # popped: user code on the rank doesn't see the key


def test_key_files_others_can_read_are_refused(tmp_path: Path) -> None:
    path = Credentials.new().write(tmp_path / "pool.key")
    path.chmod(0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        Credentials.read(path)


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "not a distnb key file"),
        ("{}", "not a distnb key file"),
        ('{"format": "distnb-key-1", "key": "zz"}', "not a distnb key file"),
        ('{"format": "distnb-key-1", "key": "00"}', "key too short"),
        ('{"format": "distnb-key-1", "key": "' + "ab" * 32 + '", "curve_server": "x"}', "not a distnb key file"),
    ],
)
def test_malformed_key_files_are_refused(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.key"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match=match):
        Credentials.read(path)


def test_missing_key_file_says_where_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="Copy it from the controller's machine"):
        Credentials.read(tmp_path / "absent.key")
