"""A real ipykernel for a test: started with the test's mark in its environment (and so in its
pool's), so that the test finds, and stops by PID, exactly the processes it started."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

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
