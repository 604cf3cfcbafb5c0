"""Group creations keyed so that every rank's are in step on every torch: a group made with
use_local_synchronization (only its members make it) takes no place in the count, whether this
torch's own counter skips it (2.13 and older) or counts it on the members alone (2.14 and newer)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest

from distnb.worker.torch_hooks.call_log import CallLog, needs


def fake_c10d(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    world = SimpleNamespace(group_count=1, pg_names={}, default_pg=None)
    module = ModuleType("torch.distributed.distributed_c10d")
    module._world = world  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", module)
    return world


@pytest.mark.parametrize("counts_local", [False, True], ids=["torch<=2.13", "torch>=2.14"])
def test_a_local_group_takes_no_place_among_the_groups_every_rank_makes(monkeypatch: pytest.MonkeyPatch, counts_local: bool) -> None:
    world = fake_c10d(monkeypatch)

    def create(log: CallLog, ranks: list[int], local: bool = False) -> dict:
        rec = log.begin("new_group", None, {"ranks": ranks, "use_local_synchronization": local})
        if counts_local or not local:
            world.group_count += 1  # what torch's _process_group_name does
        log.end(rec, None)
        return rec

    member, other = CallLog("<cell-"), CallLog("<cell-")
    start = world.group_count
    first = create(member, [0, 1], local=True)
    assert first["count"] is None and first["local"] is True
    world.group_count = start  # the other rank's process: its own counter, the local group never made there
    rec_other = create(other, [0, 1, 2, 3])
    world.group_count = start + (1 if counts_local else 0)  # back in the member's process
    rec_member = create(member, [0, 1, 2, 3])
    assert rec_member["count"] == rec_other["count"] == start


def test_destroying_the_groups_starts_the_count_over(monkeypatch: pytest.MonkeyPatch) -> None:
    world = fake_c10d(monkeypatch)
    log = CallLog("<cell-")
    rec = log.begin("new_group", None, {"ranks": [0], "use_local_synchronization": True})
    world.group_count += 1
    log.end(rec, None)
    world.group_count = 1  # destroy_process_group, then init_process_group
    again = log.begin("new_group", None, {"ranks": [0, 1], "use_local_synchronization": False})
    assert again["count"] == 1


def test_a_local_group_needs_only_its_members() -> None:
    assert needs("new_group", None, {"ranks": [0, 1], "use_local_synchronization": True}, frozenset({2})) is False
    assert needs("new_group", None, {"ranks": [0, 1], "use_local_synchronization": True}, frozenset({1})) is True
    assert needs("new_group", None, {"ranks": [0, 1], "use_local_synchronization": False}, frozenset({2})) is True
