"""A real ipykernel for a test: started with the test's mark in its environment (and so in its
pool's), so that the test finds, and stops by PID, exactly the processes it started."""

from __future__ import annotations

import os
import queue
import time
import uuid
from pathlib import Path
from typing import Any

from conftest import reap_marked


class Kernel:
    """One ipykernel with ``mark=<fresh token>`` in its environment; ``close()`` stops it and
    describes whatever it left behind (killed by then)."""

    def __init__(self, cwd: Path, mark: str) -> None:
        from jupyter_client.manager import KernelManager

        self.mark, self.token = mark, uuid.uuid4().hex
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd), env={**os.environ, mark: self.token})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def close(self) -> list[str]:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        return reap_marked(self.mark, self.token)

    def run(self, code: str, timeout: float = 120) -> str:
        """Run ``code`` to the end; return what its streams printed (raising if it failed)."""
        texts: list[str] = []

        def output(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                texts.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, output_hook=output, timeout=timeout)
        assert reply["content"]["status"] == "ok", (code, reply["content"])
        return "".join(texts)

    def run_all(self, codes: list[str], timeout: float = 120) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Send every cell at once, each with ``stop_on_error``, as JupyterLab's Run All does (the
        kernel aborts the ones queued behind an error). Returns each cell's reply content and its
        outputs (iopub ``stream``, ``display_data``, ``update_display_data`` — a live view's final
        text —, ``execute_result`` and ``error`` contents)."""
        ids = [self.kc.execute(code, stop_on_error=True) for code in codes]
        replies: dict[str, dict[str, Any]] = {}
        outputs: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
        deadline = time.monotonic() + timeout
        while len(replies) < len(ids):
            reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") in outputs:
                replies[reply["parent_header"]["msg_id"]] = reply["content"]
        # The outputs came before the replies on iopub; an aborted cell may have no status message,
        # so read until iopub has been quiet for a moment.
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                break
            shown = ("stream", "display_data", "update_display_data", "execute_result", "error")
            if msg["parent_header"].get("msg_id") in outputs and msg["msg_type"] in shown:
                outputs[msg["parent_header"]["msg_id"]].append({"output_type": msg["msg_type"], **msg["content"]})
        return [(replies[i], outputs[i]) for i in ids]
