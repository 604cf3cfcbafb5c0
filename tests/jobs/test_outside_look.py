"""Reading a job from outside, in parts: py-spy's JSON as stacks (main thread first, frames
outermost first, each frame's source line), a process of this test read over a window (a thread
asleep stands still; one that wakes in a loop does not, whatever line it is caught on), a
worker's script and arguments from its command line."""

from __future__ import annotations

import json
import linecache
import os
import subprocess
import sys
import time

import pytest

from distnb.jobs.outside_look import _threads, look_from_outside
from distnb.launching.bare_jobs import BareRank, script_argv
from distnb.services.native_stacks import py_spy_path

DUMP = [
    {"pid": 10, "thread_id": 1, "thread_name": "loader", "os_thread_id": 12, "frames": [
        {"name": "run", "filename": "/lib/python3.12/threading.py", "line": 1010}]},
    {"pid": 10, "thread_id": 2, "thread_name": "MainThread", "os_thread_id": 10, "frames": [
        {"name": "all_reduce", "filename": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 3252},
        {"name": "train", "filename": __file__, "line": 1},
        {"name": "<module>", "filename": __file__, "line": 2, "locals": None}]},
]


def test_py_spys_json_reads_as_stacks_main_thread_first_outermost_first() -> None:
    threads = _threads(json.dumps(DUMP), 10)
    assert [t.name for t in threads] == ["MainThread", "loader"] and threads[0].main and not threads[1].main
    main = threads[0]
    assert [f.name for f in main.frames] == ["<module>", "train", "all_reduce"]
    assert main.frames[0].line == linecache.getline(__file__, 2) != ""  # the source line, read here
    assert main.program  # a program's own frames: no cell, no serve loop


def test_without_os_thread_ids_the_thread_started_first_is_main() -> None:
    dump = [{**t, "os_thread_id": None} for t in DUMP]
    assert [t.main for t in _threads(json.dumps(dump), 10)] == [True, False]


@pytest.mark.parametrize(("argv", "script"), [
    (("/usr/bin/python3", "-u", "train.py", "--lr", "3"), ("train.py", "--lr", "3")),
    (("python", "-X", "faulthandler", "-W", "ignore", "t.py"), ("t.py",)),
    (("python", "-m", "pkg.train", "--steps", "2"), ("pkg.train", "--steps", "2")),
    (("python",), ()),
])
def test_a_workers_script_comes_from_its_command_line(argv: tuple[str, ...], script: tuple[str, ...]) -> None:
    assert script_argv(BareRank(0, 1, 0, argv, "/", {}, 0.0)) == script


_SLEEPER = """import time
def wait():
    time.sleep(60)
wait()
"""
_LOOPER = """import time
def step():
    time.sleep(0.001)
while True:
    step()
"""


@pytest.mark.skipif(py_spy_path() is None, reason="py-spy is not installed (the test extra installs it)")
@pytest.mark.parametrize(("code", "still"), [(_SLEEPER, True), (_LOOPER, False)])
def test_a_look_over_a_window_tells_a_wait_from_a_loop(code: str, still: bool) -> None:
    """Both are caught in time.sleep at both reads; only the sleeper did not wake in between."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        seen = None
        for _ in range(20):  # until the interpreter is in the code (not starting up)
            seen = look_from_outside({0: proc.pid}, window=0.5)[0]
            if seen.threads and any(f.name in ("wait", "step") for f in seen.threads[0].frames):
                break
        assert seen is not None and seen.threads, seen
        assert seen.still is still and seen.state is None and seen.cpu is not None, seen
    finally:
        proc.kill()
        proc.wait()
    assert not os.path.exists(f"/proc/{proc.pid}/status") or proc.returncode is not None
