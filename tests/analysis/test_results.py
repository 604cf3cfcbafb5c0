"""RankResult's output grows chunk by chunk without copying what it holds, and reads as plain text."""

from __future__ import annotations

import dataclasses
import pickle
import threading

from distnb.results import RankResult


def test_output_is_joined_when_read_and_set_as_text() -> None:
    r = RankResult(0, stdout="a")
    for chunk in ("b", "c"):
        r.add_output("stdout", chunk)
    r.add_output("stderr", "e")
    assert (r.stdout, r.stderr) == ("abc", "e") and RankResult(1).stdout == ""
    assert "stdout='abc'" in repr(r) and dataclasses.asdict(r)["stderr"] == "e"
    assert pickle.loads(pickle.dumps(r)).stdout == "abc"
    r.stdout = ""
    r.add_output("stdout", "z")
    assert r.stdout == "z"


def test_reading_while_another_thread_appends_loses_no_chunk() -> None:
    r = RankResult(0)
    n = 20_000

    def write() -> None:
        for i in range(n):
            r.add_output("stdout", f"{i}\n")

    writer = threading.Thread(target=write)
    writer.start()
    while writer.is_alive():
        _ = r.stdout  # joins what has come so far, as the notebook may while a cell runs
    writer.join()
    assert r.stdout.split() == [str(i) for i in range(n)]


def test_appending_costs_no_copy_of_what_is_held() -> None:
    r = RankResult(0)
    for _ in range(10_000):
        r.add_output("stdout", "y" * 100)
    parts = r.__dict__["_stdout"]
    assert len(parts) == 10_000  # held as chunks until read
    assert len(r.stdout) == 1_000_000 and len(parts) == 1
