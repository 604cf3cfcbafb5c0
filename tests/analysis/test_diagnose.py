"""Hang diagnosis as pure functions: positions, stacks and collective logs in, words and culprits
out. No process: the end-to-end hang tests are in test_hangs.py."""

from __future__ import annotations

import time

from distnb.analysis.verdicts.diagnose import diagnose
from distnb.analysis.verdicts.position import Position, position_from_stack
from distnb.analysis.verdicts.stacks import Frame, RankStack, ThreadStack, parse_faulthandler
from distnb.analysis.verdicts.verdict import Certainty, Kind


def test_diagnose_rank_conditional() -> None:
    d = diagnose([Position(0, "collective", op="barrier", line=3, since=5.0), Position(1, "finished")], 3.0, 5.0)
    assert d.state == "hang" and "a collective only some ranks reached" in d.summary and d.culprits == [1]
    assert "barrier at cell line 3" in d.summary


def test_diagnose_slow_but_consistent() -> None:
    d = diagnose([Position(r, "collective", op="all_reduce", since=9.0) for r in range(3)], 3.0, 9.0)
    assert d.state == "slow" and "not a hang" in d.summary


def test_diagnose_waits_below_threshold_are_ok() -> None:
    d = diagnose([Position(0, "collective", op="all_reduce", since=1.0), Position(1, "finished")], 3.0, 1.0)
    assert d.state == "ok"


def test_diagnose_a_wait_that_just_began_is_not_the_whole_cell() -> None:
    # Every rank entered the collective a moment ago, late in a long cell: nothing is hung yet.
    d = diagnose([Position(0, "collective", op="all_reduce", since=0.0), Position(1, "finished")], 3.0, 20.0)
    assert d.state == "ok"


def test_diagnose_a_silent_rank_is_named_even_with_nobody_waiting() -> None:
    d = diagnose([Position(0, "finished"), Position(1, "unresponsive", detail="its process (pid 7) is stopped")], 3.0, 4.0)
    assert d.state == "hang" and d.culprits == [1] and "rank 1 is not answering: its process (pid 7) is stopped" in d.summary
    assert diagnose([Position(1, "unresponsive", detail="x")], 3.0, 1.0).state == "ok"  # not yet past the threshold


def test_diagnose_dead_rank_is_root_cause() -> None:
    d = diagnose([Position(0, "collective", op="all_reduce", since=4.0), Position(1, "dead", detail="killed (SIGKILL)")], 3.0, 4.0)
    assert d.state == "hang" and d.culprits == [1] and "Root cause: rank 1" in d.summary


def test_diagnosis_groups_ranks_waiting_in_the_same_place_whatever_their_wait() -> None:
    d = diagnose([Position(0, "collective", op="all_reduce", seq=1, group="0", line=3, since=3.04),
                  Position(1, "failed", line=2, detail="KeyError: 'label'"),
                  Position(2, "collective", op="all_reduce", seq=1, group="0", line=3, since=2.96)], 3.0, 3.1)
    assert "ranks 0,2: waiting in all_reduce #1 on group 0 for 3.0 s at cell line 3" in d.text()
    d = diagnose([Position(0, "collective", op="all_reduce", since=3.0), Position(1, "collective", op="all_reduce", since=4.5),
                  Position(2, "finished")], 3.0, 4.5)
    assert "ranks 0,1: waiting in all_reduce for 3.0–4.5 s" in d.text()


def test_a_rank_still_importing_is_slow_not_hung() -> None:
    frames = [Frame("<cell-4>", 2, "<module>", "model = DDP(model)"),
              Frame("/site-packages/torch/nn/parallel/distributed.py", 10, "__init__", "import torch._dynamo"),
              Frame("<frozen importlib._bootstrap>", 1176, "_find_and_load", ""),
              Frame("/site-packages/torch/_dynamo/__init__.py", 3, "<module>", "from . import config")]
    stack = RankStack(1, "running cell 4 for 5.0 s", "control thread", [ThreadStack("MainThread", True, frames)])
    pos = position_from_stack(stack)
    assert pos.state == "computing" and pos.detail.startswith("importing") and "_dynamo/__init__.py" in pos.detail
    pos.since = 5.0
    d = diagnose([Position(0, "collective", op="all_reduce", since=5.0), pos], 3.0, 5.0)
    assert d.state == "slow" and "still importing modules" in d.summary and "not a hang yet" in d.summary
    assert "rank 1: running Python code (not in a collective, importing" in d.text()
    pos.detail = ""
    assert diagnose([Position(0, "collective", op="all_reduce", since=5.0), pos], 3.0, 5.0).state == "hang"


def test_post_mortem_keeps_the_abort_message_not_the_cpp_frames() -> None:
    from distnb.results import RankResult

    stderr = "\n".join([
        "[rank 1] before the crash",
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4",
        "Exception raised from recv at pair.cc:446 (most recent call first):",
        *[f"frame #{i}: <unknown function> + 0x{i:x} (libtorch_cpu.so)" for i in range(60)],
        "Fatal Python error: Aborted",
        "Current thread 0x00007f (most recent call first):",
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 2870 in all_reduce',
        '  File "<cell-7>", line 3 in <module>',
    ])
    text = RankResult(1, status="dead", returncode=-6, stderr_tail=stderr, first_death=True).death_text()
    assert "what():  [enforce fail at pair.cc:446]" in text and "Fatal Python error: Aborted" in text
    assert '<cell-7>", line 3' in text and "frame #" not in text and "distributed_c10d.py" not in text
    assert text.startswith("rank 1 died first: aborted (SIGABRT")


def test_parse_faulthandler_orders_frames_and_finds_main() -> None:
    dump = (
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/x/re/__init__.py", line 166 in match\n'
        '  File "<cell-4>", line 2 in <module>\n'
    )
    threads = parse_faulthandler(dump, {"<cell-4>": "import re\nre.match(p, s)"}, main_ident=0x7F0000000001)
    assert threads[0].main and [f.name for f in threads[0].frames] == ["<module>", "match"]
    assert threads[0].frames[0].line == "re.match(p, s)"


def test_a_one_thread_dump_is_the_main_threads() -> None:
    # The rank's SIGUSR1 dump is its main thread's own (all_threads=False): no thread header.
    dump = 'Stack (most recent call first):\n  File "/x/re/__init__.py", line 166 in match\n  File "<cell-4>", line 2 in <module>\n'
    threads = parse_faulthandler(dump, {"<cell-4>": "import re\nre.match(p, s)"}, main_ident=0x7F0000000001)
    assert len(threads) == 1 and threads[0].main and [f.name for f in threads[0].frames] == ["<module>", "match"]
    assert threads[0].frames[0].line == "re.match(p, s)"


def _entry(rid: int, seq: int, op: str = "all_reduce", cell: int | None = 1, done: bool = True, group: str = "0",
           sizes: list | None = None, dtypes: list | None = None, t: float = 0.0) -> dict:
    return {"id": rid, "group": group, "desc": "default_pg", "seq": seq, "p2p": False, "op": op, "sizes": sizes or [[2]],
            "dtypes": dtypes or ["Float"], "t": t, "done": done, "cell": cell}


def test_uneven_loops_are_recognised_however_much_history_the_log_let_go() -> None:
    from distnb.controller.collective_log import CollectiveLog

    # After thousands of collectives the log holds only the recent ones: rank 1's last all_reduce is
    # #7002 though the log holds 3 of its entries. The count of entries held is no sequence number.
    log = CollectiveLog()
    log.merge(0, {"entries": [_entry(i, 7000 + i, cell=9) for i in range(3)] + [_entry(3, 7003, cell=9, done=False)]})
    log.merge(1, {"entries": [_entry(i, 7000 + i, cell=9) for i in range(3)]})
    d = diagnose([Position(0, "collective", op="all_reduce", seq=7003, group="0", since=5.0), Position(1, "finished")],
                 3.0, 5.0, log.report([0, 1]))
    # Two ranks, one call apart: no majority says which ran the loop once too often or too few.
    assert d.summary.startswith("uneven loop: rank 0 ran 4 steps of (all_reduce [2] f32)"), d.summary
    assert "rank 1 ran 3" in d.summary and "No majority to tell which side went wrong: rank 0 against rank 1" in d.summary
    assert d.kind == Kind.LOOP_COUNT and d.culprits == [0, 1] and d.certainty == Certainty.LIKELY
    # Two calls apart, the same: two steps.
    log = CollectiveLog()
    log.merge(0, {"entries": [_entry(i, 7000 + i, cell=9) for i in range(3)] + [_entry(3, 7003, cell=9, done=False)]})
    log.merge(1, {"entries": [_entry(i, 7000 + i, cell=9) for i in range(2)]})
    d = diagnose([Position(0, "collective", op="all_reduce", seq=7003, group="0", since=5.0), Position(1, "finished")],
                 3.0, 5.0, log.report([0, 1]))
    assert d.summary.startswith("uneven loop: rank 0 ran 4 steps") and "rank 1 ran 2" in d.summary, d.summary


def test_same_op_at_different_places_says_what_differs() -> None:
    def at(rank: int, seq: int = 4, group: str = "0", sizes: list | None = None, dtypes: list | None = None) -> Position:
        sizes, dtypes = sizes or [[2]], dtypes or ["Float"]
        return Position(rank, "collective", op="all_reduce", seq=seq, group=group, since=5.0, sizes=sizes, dtypes=dtypes,
                        shapes=f"[{','.join(map(str, sizes[0]))}] {dtypes[0]}")

    seq = diagnose([at(0, seq=4), at(1, seq=5), at(2, seq=5)], 3.0, 5.0)
    assert "the same op (all_reduce) with a different sequence number:" in seq.summary and "shape" not in seq.summary.split(":")[0]
    assert seq.culprits == [0] and "The odd one out: rank 0." in seq.summary
    group = diagnose([at(0, group="1"), at(1), at(2)], 3.0, 5.0)
    assert "with a different group:" in group.summary and "rank 0 in all_reduce #4 on group 1" in group.summary
    dtype = diagnose([at(0, dtypes=["Double"]), at(1), at(2)], 3.0, 5.0)
    assert "with a different dtype:" in dtype.summary, dtype.summary
    shape = diagnose([at(0), at(1, sizes=[[3]]), at(2)], 3.0, 5.0)
    assert "with a different shape:" in shape.summary and shape.culprits == [1]


def test_a_tie_names_both_sides() -> None:
    d = diagnose([Position(0, "collective", op="barrier", seq=1, group="0", since=5.0),
                  Position(1, "collective", op="all_reduce", seq=1, group="0", since=5.0)], 3.0, 5.0)
    assert d.culprits == [0, 1] and "different collectives" in d.summary and "odd one" not in d.summary
    assert "check rank 0 and rank 1" in d.summary, d.summary
    d = diagnose([Position(r, "collective", op="barrier" if r < 2 else "all_reduce", since=5.0) for r in range(4)], 3.0, 5.0)
    assert d.culprits == [0, 1, 2, 3] and "No majority" in d.summary


def test_the_rank_that_died_first_is_the_root_cause_not_the_lowest() -> None:
    positions = [Position(0, "dead", detail="terminated (SIGTERM)"), Position(1, "collective", op="all_reduce", since=4.0),
                 Position(2, "dead", detail="killed (SIGKILL)")]
    d = diagnose(positions, 3.0, 4.0, first_death=2)
    assert d.summary.startswith("rank 2 died first (killed (SIGKILL)), then rank 0;") and "Root cause: rank 2." in d.summary
    assert d.culprits == [2] and 0 in d.victims and d.kind == Kind.DIED


def test_ranks_outside_the_cell_are_not_blamed_as_finished() -> None:
    # The cell runs on rank 0 only; rank 1 never had it, so it did not "finish without entering".
    d = diagnose([Position(0, "collective", op="all_reduce", seq=1, group="0", since=5.0), Position(1, "idle")], 3.0, 5.0)
    assert d.state == "hang" and d.culprits == [1] and "finished" not in d.summary, d.summary
    assert "rank 1, which is not part of this cell" in d.summary
    assert "rank 1: idle: not part of this cell" in d.text()
    d = diagnose([Position(0, "collective", op="barrier", since=5.0), Position(1, "finished"), Position(2, "idle")], 3.0, 5.0)
    assert "a collective only some ranks reached" in d.summary and d.culprits == [1] and "rank 1 finished the cell" in d.summary


def test_headline_is_the_same_a_second_later() -> None:
    # The live watch prints a diagnosis again only when its first line changes.
    def at(t: float) -> list[str]:
        slow = diagnose([Position(r, "collective", op="all_reduce", since=t) for r in range(2)], 3.0, t)
        busy = diagnose([Position(0, "collective", op="all_reduce", since=t), Position(1, "computing", since=t)], 3.0, t)
        running = diagnose([Position(0, "computing", since=t)], 3.0, t)
        return [slow.text(), busy.text(), running.text()]

    for before, after in zip(at(5.0), at(6.0)):
        assert before.split("\n")[0] == after.split("\n")[0], (before, after)
        assert before != after  # the durations are still there, in the per-rank lines
    assert "rank 1: running Python code (not in a collective) for 6.0 s" in at(6.0)[1]


def test_collective_ages_use_the_ranks_clock() -> None:
    from distnb.controller.collective_log import CollectiveLog

    # A rank on a machine whose clock runs 100 s ahead entered a collective 2 s ago (by its clock).
    log = CollectiveLog()
    rank_now = time.time() + 100.0
    log.merge(0, {"entries": [_entry(1, 1, cell=3, done=False, t=rank_now - 2.0)], "now": rank_now})
    pending = log.pending(0, cell=3)
    assert pending is not None and 1.9 <= log.age(0, pending) <= 2.5
    assert log.pending(0, cell=4) is None  # a later cell: the rank attributes entries to cells itself


def test_a_regroup_starts_a_new_generation_of_the_log() -> None:
    from distnb.controller.collective_log import CollectiveLog

    log = CollectiveLog()
    log.merge(0, {"entries": [_entry(1, 1), _entry(2, 2, done=False)]})  # #2 timed out, never retired
    log.new_generation({0: log.last_id(0)})
    log.merge(0, {"entries": [_entry(2, 2, done=False), _entry(3, 1, cell=5)]})  # the recorder still holds #2
    assert [(e["id"], e["seq"]) for e in log.sequence(0, "0")] == [(3, 1)] and log.pending(0) is None


def test_collective_from_the_stack_a_dying_rank_printed() -> None:
    from distnb.analysis.verdicts.position import collective_at_death

    stderr = ("Fatal Python error: Aborted\n\nThread 0x00007f0000000002 (most recent call first):\n"
              '  File "/x/distnb/worker/control.py", line 96 in run\n\n'
              "Thread 0x00007f0000000001 (most recent call first):\n"
              '  File "/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
              '  File "/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
              '  File "<cell-4>", line 2 in <module>\n'
              '  File "/x/distnb/worker/execute.py", line 124 in run\n')
    assert collective_at_death(stderr, 0x7F0000000001) == "all_reduce at cell line 2 (from the stack it printed as it died)"
    assert collective_at_death("Killed\n") is None
