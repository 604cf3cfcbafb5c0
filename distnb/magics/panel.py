"""JupyterLab's debugger panel on ``%%on_ranks`` cells: the kernel's debugger, extended to the ranks.

ipykernel answers the panel's debug requests (DAP over the control channel) with its
:class:`ipykernel.debugger.Debugger`, driving debugpy in the kernel. :func:`install` wraps that
object's ``process_request`` so that, with a pool running:

- breakpoints the panel sets go to the kernel's debugpy as before *and* to every rank's
  (services/rank_debug.py); a ``%%on_ranks`` cell is known to the ranks by the file ipykernel
  compiles it as (its text's hash), mapped to their ``<cell-N>`` (worker/process/panel_link.py);
- ``threads`` lists the ranks' threads (``rank 2 · MainThread``) after the kernel's, ``debugInfo``
  their stopped threads, and a rank's stop reaches the panel as a ``debug_event``;
- a request about a rank's thread, frame or variables (the ids say which) goes to that rank;
  continue / next / step act on the rank whose frame the user selected.

Everything else — plain cells, the kernel's own variables — stays the kernel's. distnb's own threads
in the kernel are marked as pydevd marks its own, so a breakpoint in a plain cell never suspends
the thread that hears the ranks.
"""

from __future__ import annotations

import asyncio
import os
import threading
from functools import partial
from typing import Any

from distnb.worker.process.panel_link import private_thread

__all__ = ["STOPS_FILTER", "cell_source", "install"]

#: Requests about the paused code's ids: a rank's when the id is one of the ranks' (rank_debug).
_BY_FRAME = {"scopes": "frameId", "evaluate": "frameId", "richInspectVariables": "frameId", "variables": "variablesReference",
             "setVariable": "variablesReference", "setExpression": "frameId", "copyToGlobals": "srcFrameId"}
_STEPS = {"continue", "next", "stepIn", "stepOut", "pause"}
#: The "pause on exceptions" option distnb adds to the panel: every rank stops before each
#: collective it calls (nothing issued), the Callstack naming what each is about to call.
STOPS_FILTER = "distnbCollectives"
STOPS_OPTION = {"filter": STOPS_FILTER, "label": "Before each collective (distnb ranks)", "default": False,
                "description": "Every rank stops before each torch.distributed collective it calls, nothing issued yet; "
                               "the Callstack shows what each is about to call, side by side."}
_raw_cell: dict[str, str] = {"text": ""}  # the cell running now, as the user wrote it (pre_run_cell)


def install(shell: Any) -> bool:
    """Extend the kernel's debugger to the ranks; False when this is not an ipykernel with one."""
    debugger = getattr(getattr(shell, "kernel", None), "debugger", None)
    if debugger is None or getattr(debugger, "_distnb", False):
        return debugger is not None
    original = debugger.process_request

    async def process_request(message: dict[str, Any]) -> dict[str, Any]:
        return await _route(debugger, original, message)

    debugger.process_request = process_request
    debugger._distnb = True
    shell.events.register("pre_run_cell", _remember)
    return True


def _remember(info: Any) -> None:
    _raw_cell["text"] = getattr(info, "raw_cell", "") or ""


def cell_source(shell: Any, pool: Any) -> dict[str, Any] | None:
    """Before a ``%%on_ranks`` cell is sent: where its body stands in the panel's file for the cell
    ({"path", "line"}), and — with the panel's debugger on — the ranks attached and the file written
    (the panel shows frames from it, as ipykernel's dumpCell would)."""
    debugger = getattr(getattr(shell, "kernel", None), "debugger", None)
    raw = _raw_cell["text"]
    lines = raw.splitlines()
    first = next((i for i, text in enumerate(lines) if text.lstrip().startswith("%%") and "on_ranks" in text), None)
    if debugger is None or first is None:
        return None
    try:
        from ipykernel.compiler import get_file_name
    except ImportError:
        return None
    path = get_file_name(raw)
    if getattr(debugger, "is_started", False):
        _hide_threads()
        problems = pool.panel.attach(_breakpoints(debugger), getattr(debugger, "_distnb_exceptions", None),
                                     getattr(debugger, "_distnb_stops", None))
        if problems:
            print(f"[distnb] the debugger panel cannot reach every rank: {problems}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(raw)
    return {"path": path, "line": first + 2}


def _breakpoints(debugger: Any) -> dict[str, list[dict[str, Any]]]:
    return {path: list(points) for path, points in getattr(debugger, "breakpoint_list", {}).items()}


def _hide_threads() -> None:
    for t in threading.enumerate():
        if t.name.startswith("distnb"):
            private_thread(t)


def _panel(debugger: Any) -> Any:
    """The running pool's rank debugger, wired to publish on this kernel; None without a pool."""
    from distnb.jobs.pools import current_or_none

    pool = current_or_none()
    if pool is None:
        return None
    panel = pool.panel
    panel.on_event = debugger.event_callback
    return panel


async def _route(debugger: Any, original: Any, message: dict[str, Any]) -> dict[str, Any]:
    command = message.get("command", "")
    args = message.get("arguments") or {}
    if command == "setExceptionBreakpoints":
        # distnb's own filter is the ranks' alone: the kernel's debugpy never sees it.
        filters = list(args.get("filters") or [])
        debugger._distnb_stops = STOPS_FILTER in filters
        args = {**args, "filters": [f for f in filters if f != STOPS_FILTER]}
        message = {**message, "arguments": args}
        debugger._distnb_exceptions = dict(args)  # for the ranks of a pool started later
    panel = _panel(debugger)
    if panel is not None:
        key = _BY_FRAME.get(command)
        owner = panel.owner(args.get(key)) if key else None
        if command == "stackTrace" and panel.owner(args.get("threadId")):
            frames = await asyncio.to_thread(panel.stack)
            return _reply(message, {"stackFrames": frames, "totalFrames": len(frames)})
        if command in _STEPS and _for_ranks(debugger, panel, command, args.get("threadId")):
            step = panel.pause_all if command == "pause" and not panel.paused() else partial(panel.step, command, args.get("threadId"))
            return {**await asyncio.to_thread(step), "request_seq": message.get("seq"), "command": command, "type": "response"}
        if owner is not None and command == "richInspectVariables":
            reply = await asyncio.to_thread(panel.forward, owner[0], {"seq": message.get("seq"), "command": "evaluate", "arguments": {
                "expression": args.get("variableName", ""), "frameId": args.get("frameId"), "context": "hover"}})
            text = reply.get("body", {}).get("result", "")
            return _reply(message, {"data": {"text/plain": text}, "metadata": {}}, reply.get("success", False))
        if owner is not None:
            reply = await asyncio.to_thread(panel.forward, owner[0], message)
            return {**reply, "command": command, "type": "response"}
    reply = await original(message)
    body = reply.get("body") if isinstance(reply, dict) else None
    if command == "initialize" and isinstance(body, dict):  # with a pool or not: the menu is made once
        body["exceptionBreakpointFilters"] = [*body.get("exceptionBreakpointFilters", []), STOPS_OPTION]
    if panel is None or not isinstance(reply, dict):
        return reply
    if command == "attach" and reply.get("success"):
        _hide_threads()
        problems = await asyncio.to_thread(panel.attach, _breakpoints(debugger), getattr(debugger, "_distnb_exceptions", None),
                                           getattr(debugger, "_distnb_stops", None))
        if problems:
            debugger.event_callback({"type": "event", "event": "output", "body": {
                "category": "console", "output": f"distnb: the debugger panel cannot reach every rank: {problems}\n"}})
    elif command == "setBreakpoints" and panel.attached:
        await asyncio.to_thread(panel.set_breakpoints, args.get("source", {}).get("path", ""), args.get("breakpoints", []))
    elif command == "setExceptionBreakpoints":
        await asyncio.to_thread(panel.set_exception_breakpoints, args)
        await asyncio.to_thread(panel.set_collective_stops, debugger._distnb_stops)
    elif command == "disconnect":
        await asyncio.to_thread(panel.detach)
    elif command == "threads" and isinstance(body, dict):
        body["threads"] = [*body.get("threads", []), *panel.threads()]
    elif command == "debugInfo" and isinstance(body, dict):
        body["stoppedThreads"] = [*body.get("stoppedThreads", []), *(t for ts in panel.paused().values() for t in ts)]
    return reply


def _for_ranks(debugger: Any, panel: Any, command: str, thread: Any) -> bool:
    """Whether a continue / next / step / pause is the ranks'. JupyterLab names the thread of the
    last stop it heard of — but on continue it forgets that thread first and sends 1, the
    kernel's main thread, which is not stopped (debugpy would never answer for it). So: the
    ranks' when the thread is theirs, or when it is no stopped thread of the kernel's while a rank
    is paused; a pause while a cell runs on the ranks pauses the ranks."""
    if panel.owner(thread):
        return True
    if thread in getattr(debugger, "stopped_threads", ()):
        return False
    return bool(panel.paused()) or (command == "pause" and panel.running())


def _reply(message: dict[str, Any], body: dict[str, Any], success: bool = True) -> dict[str, Any]:
    return {"type": "response", "request_seq": message.get("seq"), "seq": message.get("seq"), "success": success,
            "command": message.get("command"), "body": body}
