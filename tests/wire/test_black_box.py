"""A rank's black box (wire/black_box.py): what the rank writes as each call begins, the
supervisor reads back after the rank is gone — the last calls, in order, and which of them ended."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from distnb.wire.black_box import ENV, SLOT, SLOTS, BlackBox


def _call(n: int, **more: object) -> dict[str, object]:
    return {"n": n, "op": "all_reduce", "group": "0", "args": {"op": 0}, "t": n * 1000, "end": None, "cell": 3, "line": 11,
            "func": "<module>", "sizes": [[]], "dtypes": ["Float"], "seq": n, **more}


def test_the_last_calls_come_back_in_order_with_the_ones_that_ended_marked() -> None:
    box = BlackBox.create()
    assert box is not None
    rank = BlackBox.attach(box.fd)
    assert rank is not None
    for n in range(1, SLOTS + 9):
        call = _call(n)
        rank.write(call, {"sizes": call.pop("sizes"), "dtypes": call.pop("dtypes")}, int(call.pop("seq")))
        if n < SLOTS + 8:
            rank.ended(n)
    got = box.read()
    assert [c["n"] for c in got] == list(range(9, SLOTS + 9))  # the oldest went round the ring
    assert all(c["end"] is not None for c in got[:-1]) and got[-1]["end"] is None
    assert got[-1]["sizes"] == [[]] and got[-1]["seq"] == SLOTS + 8 and got[-1]["args"] == {"op": 0}


def test_a_call_too_large_is_kept_without_its_arguments_and_a_torn_slot_is_dropped() -> None:
    box = BlackBox.create()
    assert box is not None
    box.write(_call(1, op="new_group", args={"ranks": list(range(SLOT))}))
    box.write(_call(2))
    [first, second] = box.read()
    assert first["op"] == "new_group" and "args" not in first and second["args"] == {"op": 0}
    # The death cut a write short: the slot's bytes no longer match its checksum.
    box._mem[12 + SLOT + 24] ^= 0xFF
    assert [c["n"] for c in box.read()] == [1]


def test_the_rank_process_finds_its_box_and_hides_it_from_its_children() -> None:
    box = BlackBox.create()
    assert box is not None
    code = textwrap.dedent(f"""
        import os
        from distnb.wire.black_box import BlackBox
        box = BlackBox.from_environ()
        assert box is not None and {ENV!r} not in os.environ
        box.write({{"n": 7, "op": "barrier", "group": "0", "args": {{}}, "t": 1, "end": None}})
    """)
    subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV: str(box.fd)}, pass_fds=[box.fd], check=True, timeout=60)
    assert [c["op"] for c in box.read()] == ["barrier"]


@pytest.mark.parametrize("value", ["", "x", "999"])
def test_no_box_where_the_environment_names_none(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV, value)
    assert BlackBox.from_environ() is None
