"""Looks into the main thread's frames from another thread (worker/process/peek.py): what
``%dist_debug`` reads on a rank of a live job. The main thread here is pytest's, held in a wait
while a helper thread looks, as a rank's main thread is held in a collective."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from distnb.worker.process import peek as peek_module
from distnb.worker.process.peek import VALUE_CHARS, peek

pytestmark = pytest.mark.timeout(60)


def hold_here(entered: threading.Event, done: threading.Event) -> None:
    entered.set()
    done.wait(30)


def looked_at_while_waiting(looks: list[dict[str, Any]], hold: Callable[[threading.Event, threading.Event], None] = hold_here) -> list[Any]:
    """Run ``looks`` from a helper thread once this (the main) thread waits in ``hold``; their answers."""
    answers: list[Any] = []
    entered, done = threading.Event(), threading.Event()

    def helper() -> None:
        try:
            entered.wait(30)
            answers.extend(peek({"t": "peek", "id": "1", **look}) for look in looks)  # type: ignore[typeddict-item]
        finally:
            done.set()

    threading.Thread(target=helper, daemon=True).start()
    hold(entered, done)
    assert done.is_set()
    return answers


def test_frames_and_values_of_the_waiting_frame() -> None:
    marker = 41  # noqa: F841  (read by the looks, in this frame)
    table = {"a": list(range(30)), "b": "x" * 10}
    shown = looked_at_while_waiting([{"what": "frames"}])[0]["frames"]
    mine = max(i for i, f in enumerate(shown) if f.function == "test_frames_and_values_of_the_waiting_frame")
    assert shown[mine].user and shown[mine].filename == __file__
    assert all(not f.user for f in shown if "threading.py" in f.filename or "_pytest" in f.filename)
    value, pretty, local, source, function, bad, assign = looked_at_while_waiting([
        {"what": "eval", "expr": "marker + 1", "frame": mine}, {"what": "pretty", "expr": "table", "frame": mine},
        {"what": "locals", "frame": mine}, {"what": "source", "frame": mine}, {"what": "function", "frame": mine},
        {"what": "eval", "expr": "1 / 0", "frame": mine}, {"what": "exec", "expr": "table['c'] = marker", "frame": mine},
    ])
    assert value["value"] == "42" and "error" not in value
    assert pretty["value"].startswith("{'a': [0,\n") and "'b': 'xxxxxxxxxx'" in pretty["value"], pretty
    assert "marker = 41" in local["value"].splitlines(), local["value"]
    lines = dict(source["source"])
    here = next(n for n, text in lines.items() if text.strip().startswith("value, pretty, local"))  # the line it waits on now
    assert len(lines) == 11 and min(lines) == here - 5, source
    assert function["source"][0][1].startswith("def test_frames_and_values_of_the_waiting_frame")
    assert bad["error"] == "ZeroDivisionError: division by zero" and "value" not in bad
    assert assign["value"] == "" and table["c"] == 41  # a statement runs in the frame (the dict is shared)


def test_arguments_of_a_frame() -> None:
    def waits(entered: threading.Event, done: threading.Event, size: int = 3, *, name: str = "w") -> None:
        hold_here(entered, done)

    answers: list[Any] = []
    entered, done = threading.Event(), threading.Event()

    def helper() -> None:
        entered.wait(30)
        shown = peek({"t": "peek", "id": "1", "what": "frames"})["frames"]
        at = max(i for i, f in enumerate(shown) if f.function == "waits")
        answers.append(peek({"t": "peek", "id": "2", "what": "args", "frame": at}))
        done.set()

    threading.Thread(target=helper, daemon=True).start()
    waits(entered, done, 5, name="x")
    assert answers[0]["value"].splitlines()[2:] == ["size = 5", "name = 'x'"], answers


def test_a_long_value_is_cut_and_a_waiting_expression_goes_on_in_the_background(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peek_module, "EVAL_TIMEOUT", 0.2)
    release = threading.Event()
    frames = looked_at_while_waiting([{"what": "frames"}])[0]["frames"]
    mine = max(i for i, f in enumerate(frames) if f.function.startswith("test_a_long_value"))
    long, waiting = looked_at_while_waiting([
        {"what": "eval", "expr": "'y' * 10000", "frame": mine},
        {"what": "eval", "expr": "release.wait(30)", "frame": mine},
    ])
    assert len(long["value"]) < VALUE_CHARS + 40 and long["value"].endswith("(10,002 characters)"), long["value"][-40:]
    assert waiting["error"].startswith("still running after 0.2 s; it goes on in the rank in the background"), waiting
    release.set()


def test_no_such_frame_and_unknown_looks_are_said() -> None:
    missing, unknown = looked_at_while_waiting([{"what": "eval", "expr": "1", "frame": 999}, {"what": "nonsense", "frame": 0}])
    assert missing["error"].startswith("no frame 999: the main thread has ") and missing["frames"]
    assert unknown["error"] == "unknown look 'nonsense'"


def test_a_debuggers_frames_and_what_it_waits_in_are_not_shown(tmp_path: Path) -> None:
    """A thread held by debugpy waits inside pydevd (and the threading module under it): the
    frames end at the user's line where it was paused."""
    (tmp_path / "debugpy").mkdir()
    fake = tmp_path / "debugpy" / "pydevd_fake.py"  # debugpy vendors pydevd under its folder
    fake.write_text("def do_wait_suspend(entered, done):\n    entered.set()\n    done.wait(30)\n")
    namespace: dict[str, Any] = {}
    exec(compile(fake.read_text(), str(fake), "exec"), namespace)

    def users_line(entered: threading.Event, done: threading.Event) -> None:
        namespace["do_wait_suspend"](entered, done)  # the user's line the debugger paused on

    frames = looked_at_while_waiting([{"what": "frames"}], hold=users_line)[0]["frames"]
    assert frames[-1].function == "users_line" and frames[-1].code.startswith("namespace[\"do_wait_suspend\"](entered, done)"), frames[-3:]
    assert not any("threading" in f.filename or "pydevd" in f.filename for f in frames[-3:])


def test_a_look_at_a_frame_that_moved_finds_its_function_or_says_it_returned() -> None:
    """The notebook read the frames, the rank ran on: the index it sends may now be another frame.
    With the function it saw there, the look is made in that function's innermost frame, or says
    it has returned."""
    here = "moved"  # noqa: F841  (read by the looks, in this frame)
    found, gone = looked_at_while_waiting([
        {"what": "eval", "expr": "here", "frame": 0, "want": [__file__, "test_a_look_at_a_frame_that_moved_finds_its_function_or_says_it_returned"]},
        {"what": "eval", "expr": "here", "frame": 0, "want": [__file__, "a_function_that_returned"]},
    ])
    assert found["value"] == "'moved'" and found["frames"][found["frame"]].function.startswith("test_a_look_at_a_frame"), found
    assert gone["error"] == f"a_function_that_returned ({__file__}) has returned since: `where` shows the frames now", gone
