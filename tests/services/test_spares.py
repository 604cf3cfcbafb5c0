"""Spare rank processes only where they fit: a spare is a second Python with torch per rank, and
64 ranks' spares on one machine are ~10 GB more (issue 27: 64 ranks on 8 local nodes)."""

from __future__ import annotations

from typing import Any

from distnb import _processes
from distnb.config import LaunchConfig
from distnb.transport.startup import request_spares
from distnb.wire.protocol import Msg

from synthetic import SyntheticPool

GIB = 2**30


def spares_sent(world: int, rank_size: int, available: int, monkeypatch: Any, local_nodes: bool = True) -> tuple[list[int], list[str]]:
    pool = SyntheticPool(world)
    monkeypatch.setattr(_processes, "memory_of", lambda pid: rank_size)
    monkeypatch.setattr(_processes, "memory_available", lambda: available)
    config = LaunchConfig(nproc=8, nnodes=world // 8, local_nodes=local_nodes, backend="gloo")
    sent: list[int] = []
    notes: list[str] = []

    class Channel:
        def send_many(self, identities: Any, msg: dict[str, Any]) -> None:
            assert msg["t"] == Msg.SPARE
            sent.extend(int(i[1:]) for i in identities)

    request_spares(Channel(), config, pool.tracker, notes.append)  # type: ignore[arg-type]
    return sent, notes


def test_spares_start_where_they_fit(monkeypatch) -> None:
    sent, notes = spares_sent(16, GIB // 4, 64 * GIB, monkeypatch)
    assert sent == list(range(16)) and notes == []


def test_no_spares_on_this_machine_when_they_would_crowd_it_and_the_user_is_told(monkeypatch) -> None:
    sent, notes = spares_sent(64, 230 * 2**20, 11 * GIB, monkeypatch)
    assert sent == []
    assert len(notes) == 1 and notes[0].startswith("no spare rank processes on this machine: 64 would need ~14.4 GiB of the 11.0 GiB"), notes
