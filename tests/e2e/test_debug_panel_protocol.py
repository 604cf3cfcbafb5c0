"""JupyterLab's debugger panel on ``%%on_ranks`` cells, at the protocol level: a real ipykernel with
distnb loaded and a gloo pool, driven with the requests JupyterLab's debugger sends (the Jupyter
debug protocol: DAP in ``debug_request`` on the control channel, events as ``debug_event`` on
iopub). The browser test (tests/display/test_debug_panel.py) clicks the same path."""

from __future__ import annotations

import itertools
import queue
import time
from pathlib import Path
from typing import Any, Callable

import kernels
import pytest

from distnb.magics.panel import STOPS_FILTER
from distnb.services.rank_debug import ATTACH_TIMEOUT

from conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MARK = "DISTNB_PANEL_TEST"
CELL = "%%on_ranks\nimport torch.distributed as dist\nx = dist.get_rank() * 10 + 7\ny = x + 1\nprint('y is', y)\n"
#: Run before the panel is turned on; its function is called later, under a breakpoint in its body.
EARLIER = "%%on_ranks\ndef scaled(v):\n    w = v * 2\n    return w\n"
LATER = "%%on_ranks\nz = scaled(x)\nprint('z is', z)\n"
#: Seconds for one DAP round trip through the kernel and the ranks (the first attaches them): the
#: bound services/rank_debug.py gives an attach, with margin for a loaded machine. Waits end as
#: soon as the answer is there.
ANSWER = ATTACH_TIMEOUT + 30.0


class PanelKernel(kernels.Kernel):
    """A kernel driven as JupyterLab's debugger drives it."""

    def __init__(self, cwd: Path) -> None:
        super().__init__(cwd, MARK)
        self.seq = itertools.count(1)
        self.iopub: list[dict[str, Any]] = []

    def debug(self, command: str, **arguments: Any) -> dict[str, Any]:
        msg = self.kc.session.msg("debug_request", {"type": "request", "seq": next(self.seq), "command": command, "arguments": arguments})
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + ANSWER
        while True:
            reply = self.kc.get_control_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    def wait_iopub(self, pred: Callable[[dict[str, Any]], bool], timeout: float = ANSWER) -> dict[str, Any]:
        """The first iopub message (seen before or now) that ``pred`` accepts; it is used up."""
        deadline = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self.iopub):
                if pred(msg):
                    return self.iopub.pop(i)
            try:
                self.iopub.append(self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"no such iopub message within {timeout} s; seen: "
                                     f"{[(m['msg_type'], m['content'].get('event')) for m in self.iopub]}") from None

    def stopped(self, why: str | None = None) -> dict[str, Any]:
        """The next ``stopped`` event (with ``why``: whose description is that, e.g. "rank 1 breakpoint";
        "kernel": the kernel's own thread), older ones included."""
        def wanted(m: dict[str, Any]) -> bool:
            event = m["content"]
            if m["msg_type"] != "debug_event" or event.get("event") != "stopped":
                return False
            if why == "kernel":
                return bool(event["body"]["threadId"] < 1_000_000_000)
            return why is None or event["body"].get("description") == why

        return self.wait_iopub(wanted)["content"]

    def reply_of(self, msg_id: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            reply = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]


@pytest.fixture
def kernel(tmp_path: Path, leak_check: None):
    k = PanelKernel(tmp_path)
    try:
        k.run("%load_ext distnb\n%dist_launch -n 2 --backend gloo")
        k.run(EARLIER)
        yield k
    finally:
        left = k.close()
        assert not left, left


def _start_panel(k: PanelKernel) -> None:
    assert k.debug("debugInfo")["body"]["isStarted"] is False
    init = k.debug("initialize", clientID="jupyterlab", clientName="JupyterLab", adapterID="python", pathFormat="path",
                   linesStartAt1=True, columnsStartAt1=True, supportsVariableType=True, supportsVariablePaging=True,
                   supportsRunInTerminalRequest=False, locale="en")
    assert init["success"], init
    assert STOPS_FILTER in [f["filter"] for f in init["body"]["exceptionBreakpointFilters"]]  # distnb's option in the panel's menu
    assert k.debug("attach")["success"]
    k.debug("configurationDone")


def _variable(k: PanelKernel, frame: dict[str, Any], name: str) -> str:
    scopes = k.debug("scopes", frameId=frame["id"])
    assert scopes["success"], scopes
    ref = scopes["body"]["scopes"][0]["variablesReference"]
    found = {v["name"]: v["value"] for v in k.debug("variables", variablesReference=ref)["body"]["variables"]}
    return found[name]


def test_a_gutter_breakpoint_stops_both_ranks_shows_each_in_the_callstack_and_continues_each(kernel: PanelKernel, tmp_path: Path) -> None:
    k = kernel
    _start_panel(k)
    path = k.debug("dumpCell", code=CELL)["body"]["sourcePath"]
    bp = k.debug("setBreakpoints", source={"path": path}, breakpoints=[{"line": 4}], sourceModified=False)
    assert bp["success"] and bp["body"]["breakpoints"][0]["line"] == 4, bp
    msg_id = k.kc.execute(CELL)

    first, second = k.stopped(), k.stopped()  # one event per rank
    assert {first["body"]["description"], second["body"]["description"]} == {"rank 0 breakpoint", "rank 1 breakpoint"}
    assert len([t for t in k.debug("debugInfo")["body"]["stoppedThreads"] if t >= 1_000_000_000]) == 2
    names = [t["name"] for t in k.debug("threads")["body"]["threads"]]
    assert "rank 0 · MainThread" in names and "rank 1 · MainThread" in names, names
    assert not [n for n in names if n.startswith("distnb")], names  # the kernel's distnb threads stay hidden

    frames = k.debug("stackTrace", threadId=first["body"]["threadId"])["body"]["stackFrames"]
    by_rank = {f["name"].split(" · ")[0]: f for f in frames}
    assert set(by_rank) == {"rank 0", "rank 1"}, [f["name"] for f in frames]
    for frame in by_rank.values():
        assert frame["source"]["path"] == path and frame["line"] == 4, frame  # the cell itself, the clicked line
        assert frame["name"].endswith("· MainThread · <module>"), frame
    assert _variable(k, by_rank["rank 0"], "x") == "7"
    assert _variable(k, by_rank["rank 1"], "x") == "17"  # selected last: continue acts on rank 1

    # JupyterLab forgets the stopped thread before it sends continue, and names thread 1 (the kernel's).
    assert k.debug("continue", threadId=1)["success"]
    again = k.stopped()  # the panel is told which rank is still paused
    assert "rank 0" in again["body"].get("description", ""), again
    frames = k.debug("stackTrace", threadId=again["body"]["threadId"])["body"]["stackFrames"]
    assert [f["name"].split(" · ")[0] for f in frames] == ["rank 0"], frames
    assert k.debug("continue", threadId=again["body"]["threadId"])["success"]
    k.wait_iopub(lambda m: m["msg_type"] == "debug_event" and m["content"].get("event") == "continued")
    assert k.reply_of(msg_id)["status"] == "ok"
    out = k.run("print(_dist.text())")  # what the cell's view shows, as text
    assert "y is 8" in out and "y is 18" in out, out

    # A breakpoint in a function defined in a cell that ran before the panel was turned on.
    earlier = k.debug("dumpCell", code=EARLIER)["body"]["sourcePath"]
    assert k.debug("setBreakpoints", source={"path": earlier}, breakpoints=[{"line": 3}], sourceModified=False)["success"]
    later_id = k.kc.execute(LATER)
    k.stopped("rank 0 breakpoint"), k.stopped("rank 1 breakpoint")
    frames = k.debug("stackTrace", threadId=first["body"]["threadId"])["body"]["stackFrames"]
    assert [(f["name"], f["source"]["path"], f["line"]) for f in frames] == [
        ("rank 0 · MainThread · scaled", earlier, 3), ("rank 0 · MainThread · <module>", k.debug("dumpCell", code=LATER)["body"]["sourcePath"], 2),
        ("rank 1 · MainThread · scaled", earlier, 3), ("rank 1 · MainThread · <module>", frames[3]["source"]["path"], 2)], frames
    assert _variable(k, frames[2], "v") == "17"
    _continue_all(k, first["body"]["threadId"])
    assert k.reply_of(later_id)["status"] == "ok"
    assert k.debug("setBreakpoints", source={"path": earlier}, breakpoints=[], sourceModified=False)["success"]

    # Pause while a cell runs on the ranks (no breakpoint): every rank stops where it is.
    # The ranks spin until the test has seen them paused and asks them to stop (a file), however slow the machine.
    spin = ("%%on_ranks\nimport os, time\nspin_end = time.time() + 120\nopen(f'spin_{dist.get_rank()}', 'w').close()\n"
            "while time.time() < spin_end and not os.path.exists('spin_stop'):\n    time.sleep(0.02)\n")
    spin_id = k.kc.execute(spin)
    wait_until(lambda: (tmp_path / "spin_0").exists() and (tmp_path / "spin_1").exists(), ANSWER, "the ranks to start the cell")
    assert k.debug("pause", threadId=1)["success"]
    paused = [k.stopped("rank 0 pause"), k.stopped("rank 1 pause")]
    frames = k.debug("stackTrace", threadId=paused[0]["body"]["threadId"])["body"]["stackFrames"]
    cell_frames = [f for f in frames if f["name"].endswith("<module>")]
    (tmp_path / "spin_stop").touch()
    assert [f["name"].split(" · ")[0] for f in cell_frames] == ["rank 0", "rank 1"] and {f["line"] for f in cell_frames} <= {5, 6}, frames
    _continue_all(k, paused[0]["body"]["threadId"])
    assert k.reply_of(spin_id)["status"] == "ok"

    # "Before each collective", the option distnb adds to the panel's pause-on-exceptions menu.
    assert k.debug("setExceptionBreakpoints", filters=[STOPS_FILTER])["success"]
    coll_id = k.kc.execute("%%on_ranks\nt9 = torch.ones(2)\ndist.all_reduce(t9)\nprint('sum', t9)\n")
    stop = k.stopped("rank 0 before all_reduce")
    k.stopped("rank 1 before all_reduce")
    frames = k.debug("stackTrace", threadId=stop["body"]["threadId"])["body"]["stackFrames"]
    tops = [f["name"] for f in frames if "before" in f["name"]]
    assert tops == [f"rank {r} · MainThread · <module> · before all_reduce [2] f32 on group 0" for r in (0, 1)], frames
    assert k.debug("setExceptionBreakpoints", filters=[])["success"]
    _continue_all(k, stop["body"]["threadId"])
    assert k.reply_of(coll_id)["status"] == "ok"

    # A plain cell keeps the kernel's own debugger.
    plain = "a = 41\nb = a + 1\n"
    plain_path = k.debug("dumpCell", code=plain)["body"]["sourcePath"]
    assert k.debug("setBreakpoints", source={"path": plain_path}, breakpoints=[{"line": 2}], sourceModified=False)["success"]
    plain_id = k.kc.execute(plain)
    stop = k.stopped("kernel")
    assert stop["body"]["threadId"] < 1_000_000_000, stop
    top = k.debug("stackTrace", threadId=stop["body"]["threadId"])["body"]["stackFrames"][0]
    assert top["source"]["path"] == plain_path and top["line"] == 2 and not top["name"].startswith("rank"), top
    assert k.debug("continue", threadId=stop["body"]["threadId"])["success"]
    assert k.reply_of(plain_id)["status"] == "ok"

    # Fresh rank processes (a restart) are attached at the next %%on_ranks cell, breakpoints and all.
    k.run("%dist_restart")
    fresh_id = k.kc.execute(CELL)
    stop = k.stopped("rank 0 breakpoint")
    k.stopped("rank 1 breakpoint")
    frames = k.debug("stackTrace", threadId=stop["body"]["threadId"])["body"]["stackFrames"]
    assert [f["name"] for f in frames] == ["rank 0 · MainThread · <module>", "rank 1 · MainThread · <module>"], frames
    # The panel's Terminate: JupyterLab restarts its debug session (off, on, breakpoints restored);
    # every paused rank goes on.
    k.debug("disconnect", restart=False, terminateDebuggee=False)
    _start_panel(k)
    assert k.debug("setBreakpoints", source={"path": path}, breakpoints=[{"line": 4}], sourceModified=False)["success"]
    assert k.reply_of(fresh_id)["status"] == "ok"

    # Turning the debugger off (as JupyterLab does) leaves no rank stopped at the breakpoints it set;
    # turned on again, the ranks' debuggers serve it as before.
    k.debug("disconnect", restart=False, terminateDebuggee=False)
    again_id = k.kc.execute(CELL)
    assert k.reply_of(again_id, timeout=ANSWER + 60)["status"] == "ok"
    _start_panel(k)
    assert k.debug("setBreakpoints", source={"path": path}, breakpoints=[{"line": 5}], sourceModified=False)["success"]
    last_id = k.kc.execute(CELL)
    stop = k.stopped("rank 0 breakpoint")
    k.stopped("rank 1 breakpoint")
    assert {f["line"] for f in k.debug("stackTrace", threadId=stop["body"]["threadId"])["body"]["stackFrames"]} == {5}
    _continue_all(k, stop["body"]["threadId"])
    assert k.reply_of(last_id)["status"] == "ok"


def _continue_all(k: PanelKernel, thread: int) -> None:
    """Continue until no rank is paused (each continue acts on one rank)."""
    deadline = time.monotonic() + ANSWER
    while [t for t in k.debug("debugInfo")["body"]["stoppedThreads"] if t >= 1_000_000_000]:
        assert time.monotonic() < deadline, "ranks stayed paused"
        assert k.debug("continue", threadId=thread)["success"]
        time.sleep(0.2)
