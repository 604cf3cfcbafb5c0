"""JupyterLab's debugger panel (the bug toggle, gutter breakpoints, Callstack, Variables, Continue:
the Jupyter debug protocol over the kernel's control channel) in headless Chromium, clicked as a
user does: on a plain cell of distnb's kernel, and across the ranks of an ``%%on_ranks`` cell.

Every debug_request, debug_reply and debug_event the page's kernel websocket carried is recorded; a
step that fails says which step it was and shows that transcript (also written to the test's
temporary folder as ``debug_protocol.txt``). With ``DISTNB_SCREENSHOTS=1`` the two-rank pause is
saved to ``docs/screenshots/debug_panel.png`` (shown in README).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
import pytest

from distnb.config import LaunchConfig
from distnb.services.rank_debug import ANSWER_TIMEOUT, ATTACH_TIMEOUT

from lab_harness import BROWSER_MARKS, jupyter_server, launch_chromium, open_notebook, playwright_api, shots_dir

pytestmark = BROWSER_MARKS

LAUNCH = "%load_ext distnb\n%dist_launch -n 2 --backend gloo"
PLAIN = "a = 3\nb = a + 4\nprint('b is', b)"
RANKS = "%%on_ranks\nimport torch.distributed as dist\nx = dist.get_rank() * 10 + 7\ny = x + 1\nprint('y is', y)"
AFTER = "c = 5\nd = c * 2\nprint('d is', d)"  # a plain cell while the pool runs: the kernel's own debugging

# Bounds, from the product's own timeouts with room for a loaded 2-core machine (each wait ends as
# soon as its condition holds; none is a sleep).
# A launch waits for every rank up to LaunchConfig.start_timeout.
LAUNCH_BOUND = LaunchConfig.start_timeout + 60
# One thing the panel shows after a click (a frame's scopes and their variables, a stack with its
# threads' names): a few requests, each of which a rank answers within ANSWER_TIMEOUT.
ROUND_TRIP = 3 * ANSWER_TIMEOUT + 30
# The first %%on_ranks cell with the panel on attaches every rank (ATTACH_TIMEOUT), then runs to
# the breakpoint and the panel asks for the stack.
PAUSE_BOUND = ATTACH_TIMEOUT + ROUND_TRIP + 60
# A cell's run once its ranks are up and nothing holds it (a plain cell; a continued one).
RUN_BOUND = 120.0
SEP = " \u00b7 "  # "rank 0 · MainThread · <module>"


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code) for code in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


def serve(served: Path) -> None:
    write_notebook(served / "plain.ipynb", ["%load_ext distnb", PLAIN])
    write_notebook(served / "ranks.ipynb", [LAUNCH, RANKS, AFTER, "%dist_shutdown"])


@pytest.fixture
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("jupyterlab")
    # No "get notified about Jupyter news?" toast over the debugger sidebar.
    yield from jupyter_server("lab", tmp_path_factory, serve,
                              settings={"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}})


class DebugProtocol:
    """The kernel messages of the debug protocol as the page's websockets carried them: Lab's
    binary v1 frames (offsets, channel, header, parent, metadata, content) or JSON text frames."""

    KINDS = ("debug_request", "debug_reply", "debug_event")

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.messages: list[tuple[float, str, str, dict[str, Any]]] = []  # (t, "->"/"<-", msg_type, content)
        self.console: list[str] = []

    def attach(self, page) -> None:
        def on_ws(ws) -> None:
            ws.on("framesent", lambda payload: self._frame("->", payload))
            ws.on("framereceived", lambda payload: self._frame("<-", payload))

        page.on("websocket", on_ws)
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)

    def _frame(self, direction: str, payload: str | bytes) -> None:
        try:
            if isinstance(payload, bytes):
                count = int.from_bytes(payload[:8], "little")
                offsets = [int.from_bytes(payload[8 * (i + 1):8 * (i + 2)], "little") for i in range(count)]
                parts = [payload[offsets[i]:offsets[i + 1]] for i in range(count - 1)]
                header, content = json.loads(parts[1]), json.loads(parts[4])
            else:
                msg = json.loads(payload)
                header, content = msg.get("header", {}), msg.get("content", {})
        except (ValueError, IndexError, TypeError):
            return
        if header.get("msg_type") in self.KINDS:
            self.messages.append((time.monotonic() - self.start, direction, header["msg_type"], content))

    def commands(self) -> list[str]:
        return [c.get("command", "") for _, _, kind, c in self.messages if kind == "debug_request"]

    @staticmethod
    def _line(kind: str, content: dict[str, Any], width: int) -> str:
        if kind == "debug_request":
            what = f"request {content.get('seq')} {content.get('command')} {json.dumps(content.get('arguments', {}))}"
        elif kind == "debug_reply":
            what = (f"reply to {content.get('request_seq')} {content.get('command')} success={content.get('success')} "
                    f"{content.get('message', '')} {json.dumps(content.get('body', {}))}")
        else:
            what = f"event {content.get('event')} {json.dumps(content.get('body', {}))}"
        return what if len(what) <= width else what[:width] + f"... ({len(what)} chars)"

    @staticmethod
    def _same(a: tuple[float, str, str, dict[str, Any]], b: tuple[float, str, str, dict[str, Any]]) -> bool:
        """Two requests alike but for their seq (Lab repeats some, e.g. inspectVariables)."""
        return a[2] == b[2] == "debug_request" and (a[3].get("command"), a[3].get("arguments")) == (b[3].get("command"), b[3].get("arguments"))

    def _runs(self, entries: list[tuple[float, str, str, dict[str, Any]]], width: int) -> list[str]:
        """One line per message, a run of alike requests as one line with its count."""
        lines: list[str] = []
        i = 0
        while i < len(entries):
            j = i
            while j + 1 < len(entries) and self._same(entries[i], entries[j + 1]):
                j += 1
            t, direction, kind, content = entries[i]
            line = f"{t:7.2f} {direction} {self._line(kind, content, width)}"
            if j > i:
                line += f"  [x{j - i + 1}, seq {content.get('seq')}..{entries[j][3].get('seq')}, until {entries[j][0]:.2f} s]"
            lines.append(line)
            i = j + 1
        return lines

    def unanswered(self) -> list[str]:
        """The requests no reply answered (the kernel answers the control channel in order; a
        reply without request_seq, as ipykernel's to ``modules``, answers the oldest one waiting)."""
        waiting: list[tuple[float, str, str, dict[str, Any]]] = []
        for entry in self.messages:
            _, _, kind, content = entry
            if kind == "debug_request":
                waiting.append(entry)
            elif kind == "debug_reply":
                key = (content.get("request_seq"), content.get("command"))
                match = next((w for w in waiting if (w[3].get("seq"), w[3].get("command")) == key), None)
                if match is None and content.get("request_seq") is None and waiting:
                    match = waiting[0]
                if match is not None:
                    waiting.remove(match)
        return self._runs(waiting, 300)

    def transcript(self, last: int | None = None, width: int = 700) -> str:
        lines = self._runs(self.messages, width)
        lines = lines[-last:] if last else lines
        if self.console:
            lines += ["", "browser console (errors, warnings):", *self.console[-20:]]
        return "\n".join(lines)


class Panel:
    """A notebook in Lab and its debugger sidebar, driven through the page as a user would."""

    def __init__(self, page, protocol: DebugProtocol, log: Path) -> None:
        self.page, self.protocol, self.log = page, protocol, log

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """A user-visible step; if it fails, say which and show the protocol so far."""
        try:
            yield
        except Exception as exc:
            self.log.write_text(self.protocol.transcript())
            raise AssertionError(f"step failed: {what}\n{type(exc).__name__}: {exc}\n\n"
                                 f"callstack: {self.frames()}\nvariables: {self.variables()}\n"
                                 f"cell outputs: {self.outputs()!r}\n"
                                 "requests never answered:\n  " + ("\n  ".join(self.protocol.unanswered()) or "none") + "\n\n"
                                 f"the debug protocol as the page carried it (all of it in {self.log}):\n"
                                 f"{self.protocol.transcript(last=80)}") from exc

    def cell(self, i: int):
        return self.page.locator(".jp-Notebook .jp-Cell").nth(i)

    def run_cell(self, i: int) -> None:
        """Select cell ``i`` (command mode) and run it in place (Ctrl+Enter)."""
        self.cell(i).locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Control+Enter")

    def wait_cell_done(self, i: int, timeout: float) -> str:
        """Wait until cell ``i`` has an execution count (it finished); return its output text."""
        self.page.wait_for_function(
            "(cell) => /\\[\\d+\\]/.test(cell.querySelector('.jp-InputPrompt').textContent)",
            arg=self.cell(i).element_handle(), timeout=timeout * 1000,
        )
        return self.cell(i).locator(".jp-OutputArea").inner_text()

    def outputs(self) -> list[str]:
        try:
            return self.page.evaluate("() => [...document.querySelectorAll('.jp-Notebook .jp-Cell .jp-OutputArea')].map(o => o.innerText)")
        except Exception:
            return []

    def enable_debugger(self) -> None:
        """The bug toggle in the notebook's toolbar (enabled once the kernel says it can debug);
        Lab opens the debugger sidebar."""
        bug = self.page.locator(".jp-DebuggerBugButton[aria-disabled='false']")
        bug.wait_for(timeout=ROUND_TRIP * 1000)
        bug.click()
        self.page.locator(".jp-DebuggerBugButton[aria-pressed='true']").wait_for(timeout=ROUND_TRIP * 1000)
        self.page.locator(".jp-DebuggerCallstack").wait_for(timeout=ROUND_TRIP * 1000)

    def toggle_breakpoint(self, i: int, line: int) -> None:
        """Click the breakpoint gutter of cell ``i`` beside its ``line`` (1-based, as the cell
        numbers its lines), and wait for the Breakpoints panel to list it (the kernel answered)."""
        # Lab adds the gutter to each cell's editor once the debugger is on for the notebook.
        self.cell(i).locator(".cm-gutter.cm-breakpoint-gutter").wait_for(timeout=ROUND_TRIP * 1000)
        spot = self.cell(i).evaluate(
            """(cell, line) => { const g = cell.querySelector('.cm-gutter.cm-breakpoint-gutter').getBoundingClientRect();
                                 const l = cell.querySelectorAll('.cm-content .cm-line')[line - 1].getBoundingClientRect();
                                 return {x: g.left + g.width / 2, y: l.top + l.height / 2}; }""",
            line,
        )
        self.page.mouse.click(spot["x"], spot["y"])
        self.page.wait_for_function(
            """(line) => [...document.querySelectorAll('.jp-DebuggerBreakpoint .jp-DebuggerBreakpoint-line')]
                         .some(e => e.textContent.trim() === String(line))""",
            arg=line, timeout=ROUND_TRIP * 1000,
        )

    def frames(self) -> list[str]:
        """The Callstack panel's frame names, "*" before the selected one."""
        try:
            return self.page.evaluate(
                """() => [...document.querySelectorAll('.jp-DebuggerCallstackFrame')].map(f =>
                       (f.classList.contains('selected') ? '*' : '') + f.querySelector('.jp-DebuggerCallstackFrame-name').textContent
                       + ' @ ' + f.querySelector('.jp-DebuggerCallstackFrame-location').textContent)""")
        except Exception:
            return []

    def wait_frames(self, present: list[str], absent: list[str], timeout: float) -> None:
        """Wait until the Callstack lists a frame starting with each of ``present`` and none
        starting with any of ``absent``."""
        self.page.wait_for_function(
            """([present, absent]) => { const names = [...document.querySelectorAll('.jp-DebuggerCallstackFrame-name')].map(e => e.textContent);
                                       return present.every(p => names.some(n => n.startsWith(p)))
                                              && !absent.some(p => names.some(n => n.startsWith(p))); }""",
            arg=[present, absent], timeout=timeout * 1000,
        )

    def select_frame(self, prefix: str) -> None:
        """Click the first frame whose name starts with ``prefix`` (the top one of its thread)."""
        frame = self.page.locator(".jp-DebuggerCallstackFrame").filter(
            has=self.page.locator(".jp-DebuggerCallstackFrame-name", has_text=prefix)).first
        frame.click()
        self.page.wait_for_function("(f) => f.classList.contains('selected')", arg=frame.element_handle(), timeout=ROUND_TRIP * 1000)

    def variables(self) -> dict[str, str]:
        """What the Variables panel's (tree) view shows at its top level: name -> value."""
        try:
            return dict(self.page.evaluate(
                """() => [...document.querySelectorAll('.jp-DebuggerVariables-body:not(.lm-mod-hidden) jp-tree-item')]
                         .filter(i => i.querySelector(':scope > .jp-DebuggerVariables-name'))
                         .map(i => [i.querySelector(':scope > .jp-DebuggerVariables-name').textContent,
                                    (i.querySelector(':scope > .jp-DebuggerVariables-detail') || {}).textContent || ''])"""))
        except Exception:
            return {}

    def wait_variable(self, name: str, value: str) -> None:
        self.page.wait_for_function(
            """([name, value]) => [...document.querySelectorAll('.jp-DebuggerVariables-body:not(.lm-mod-hidden) jp-tree-item')].some(i => {
                   const n = i.querySelector(':scope > .jp-DebuggerVariables-name'), d = i.querySelector(':scope > .jp-DebuggerVariables-detail');
                   return n && d && n.textContent === name && d.textContent === value; })""",
            arg=[name, value], timeout=ROUND_TRIP * 1000,
        )

    def show_variable(self, name: str) -> None:
        """Scroll the Variables panel to ``name`` (for the screenshot)."""
        self.page.locator(".jp-DebuggerVariables-body:not(.lm-mod-hidden) jp-tree-item").filter(
            has=self.page.locator(".jp-DebuggerVariables-name", has_text=name)).last.scroll_into_view_if_needed()

    def make_room(self) -> None:
        """For a readable screenshot: the debugger sidebar 250 px wider (its split handle dragged),
        and the Kernel Sources section folded, leaving its height to Variables and Callstack."""
        handle = self.page.evaluate(
            """() => { const right = document.querySelector('#jp-right-stack').getBoundingClientRect();
                       const hs = [...document.querySelectorAll('#jp-main-split-panel > .lm-SplitPanel-handle')]
                                  .map(h => h.getBoundingClientRect()).filter(r => r.width > 0 && r.left <= right.left + 2);
                       const h = hs.sort((a, b) => b.left - a.left)[0];
                       return h ? {x: h.left + h.width / 2, y: h.top + h.height / 2} : null; }""")
        if handle:
            self.page.mouse.move(handle["x"], handle["y"])
            self.page.mouse.down()
            self.page.mouse.move(handle["x"] - 250, handle["y"], steps=5)
            self.page.mouse.up()
        sources = self.page.locator(".jp-AccordionPanel-title.lm-mod-expanded", has_text="Kernel Sources")
        if sources.count():
            sources.first.locator(".lm-AccordionPanel-titleLabel, .jp-AccordionPanel-titleLabel").first.click()

    def press_continue(self) -> None:
        """The Callstack toolbar's Continue (F9). JupyterLab 4 sends it as ``continue`` with
        ``threadId`` 1 when one thread was reported stopped: its service forgets the stopped thread
        before reading it for the request (packages/debugger/src/service.ts, continue())."""
        button = self.page.locator(".jp-AccordionPanel-toolbar jp-button[data-command='debugger:continue'][aria-disabled='false']")
        button.wait_for(timeout=ROUND_TRIP * 1000)
        button.click()


@contextmanager
def lab_page(lab: str, notebook: str, tmp_path: Path) -> Iterator[Panel]:
    sync_api = playwright_api()
    protocol = DebugProtocol()
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            protocol.attach(page)
            panel = Panel(page, protocol, tmp_path / "debug_protocol.txt")
            with panel.step(f"open {notebook} and wait for an idle kernel"):
                open_notebook(page, f"{lab}/lab/tree/{notebook}")
            yield panel
            panel.log.write_text(protocol.transcript())
        finally:
            browser.close()


def test_the_debugger_panel_on_a_plain_cell(lab: str, tmp_path: Path) -> None:
    """The harness and its selectors, on the kernel's own debugging (distnb loaded, no pool): a
    gutter breakpoint stops a plain cell; Callstack shows its frame, Variables its value;
    Continue lets it finish."""
    with lab_page(lab, "plain.ipynb", tmp_path) as panel:
        with panel.step("run %load_ext distnb"):
            panel.run_cell(0)
            panel.wait_cell_done(0, RUN_BOUND)
        with panel.step("enable the debugger (the bug toggle)"):
            panel.enable_debugger()
        with panel.step("click the gutter of line 2 (b = a + 4)"):
            panel.toggle_breakpoint(1, 2)
        with panel.step("run the cell: it stops at line 2, Callstack shows <module>"):
            panel.run_cell(1)
            panel.wait_frames(["<module>"], [], RUN_BOUND)
            assert panel.frames()[0].endswith(":2"), panel.frames()
        with panel.step("Variables shows a = 3"):
            panel.select_frame("<module>")
            panel.wait_variable("a", "3")
            assert "b" not in panel.variables()
        with panel.step("Continue: the cell finishes with its output"):
            panel.press_continue()
            out = panel.wait_cell_done(1, RUN_BOUND)
            assert "b is 7" in out, out
            panel.wait_frames([], [""], ROUND_TRIP)  # no frame left in the Callstack
    assert {"debugInfo", "initialize", "attach", "setBreakpoints", "stackTrace", "continue"} <= set(panel.protocol.commands())


@pytest.mark.timeout(int(LAUNCH_BOUND + PAUSE_BOUND + 6 * RUN_BOUND + 16 * ROUND_TRIP + 120))
def test_the_debugger_panel_across_ranks(lab: str, tmp_path: Path) -> None:
    """Two gloo ranks stop at a gutter breakpoint in an %%on_ranks cell: the Callstack lists a
    frame per paused rank (``rank R · MainThread · <module>``); selecting one shows that rank's
    variables; Continue continues the selected rank, the panel keeps the one still paused, and
    once both continued the cell ends with both ranks' output. A plain cell afterwards keeps the
    kernel's own debugging."""
    shots = shots_dir(tmp_path)
    with lab_page(lab, "ranks.ipynb", tmp_path) as panel:
        page = panel.page
        # The file browser folded away: the notebook and the debugger sidebar side by side.
        page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
        with panel.step("launch the pool (%load_ext distnb, %dist_launch -n 2 --backend gloo)"):
            panel.run_cell(0)
            out = panel.wait_cell_done(0, LAUNCH_BOUND)
            assert "every rank starts with" in out, out
        with panel.step("enable the debugger (the bug toggle)"):
            panel.enable_debugger()
            panel.make_room()
        with panel.step("click the gutter of the %%on_ranks cell's line 4 (y = x + 1)"):
            panel.toggle_breakpoint(1, 4)
        with panel.step("run the cell: the Callstack shows both ranks paused"):
            panel.run_cell(1)
            panel.wait_frames([f"rank 0{SEP}MainThread", f"rank 1{SEP}MainThread"], [], PAUSE_BOUND)
            frames = panel.frames()
            assert any(f.lstrip("*").startswith(f"rank 0{SEP}MainThread{SEP}<module>") for f in frames), frames
            assert any(f.lstrip("*").startswith(f"rank 1{SEP}MainThread{SEP}<module>") for f in frames), frames
        with panel.step("select rank 0's frame: Variables shows x = 7"):
            panel.select_frame(f"rank 0{SEP}MainThread")
            panel.wait_variable("x", "7")
        with panel.step("select rank 1's frame: Variables shows x = 17"):
            panel.select_frame(f"rank 1{SEP}MainThread")
            panel.wait_variable("x", "17")
            assert "y" not in panel.variables(), panel.variables()
            panel.show_variable("x")
            page.screenshot(path=str(shots / "debug_panel.png"))
        with panel.step("Continue (rank 1 selected): rank 1 goes on, rank 0 stays paused"):
            panel.press_continue()
            panel.wait_frames([f"rank 0{SEP}"], [f"rank 1{SEP}"], RUN_BOUND)
        with panel.step("select rank 0's frame and Continue: no rank is paused, the cell ends"):
            panel.select_frame(f"rank 0{SEP}MainThread")
            panel.press_continue()
            out = panel.wait_cell_done(1, RUN_BOUND)
            panel.wait_frames([], [""], ROUND_TRIP)
            assert "y is 8" in out and "y is 18" in out, out
        with panel.step("a plain cell while the pool runs: the kernel's own debugging (line 2, d = c * 2)"):
            panel.toggle_breakpoint(2, 2)
            panel.run_cell(2)
            panel.wait_frames(["<module>"], ["rank "], RUN_BOUND)
            panel.select_frame("<module>")
            panel.wait_variable("c", "5")
            panel.press_continue()
            out = panel.wait_cell_done(2, RUN_BOUND)
            assert "d is 10" in out, out
        with panel.step("%dist_shutdown"):
            panel.run_cell(3)
            out = panel.wait_cell_done(3, RUN_BOUND)
            assert "pool stopped" in out, out
    assert (shots / "debug_panel.png").stat().st_size > 10_000
