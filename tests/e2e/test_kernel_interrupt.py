"""A real Jupyter interrupt during a ``%%on_ranks`` cell: SIGINT to the kernel process, as the
notebook's stop button sends it. The cell stops on the ranks; the kernel and the pool live on."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import kernels
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

MARK = "DISTNB_INTERRUPT_TEST"


class Kernel(kernels.Kernel):
    """One ipykernel with this test's mark in its environment (and so in its pool's)."""

    def __init__(self, cwd: Path) -> None:
        super().__init__(cwd, MARK)

    def execute(self, code: str, timeout: float = 120, interrupt_after: float | None = None,
                interrupt_on: str = "") -> tuple[dict[str, Any], str, float]:
        """Run ``code``; optionally interrupt the kernel ``interrupt_after`` seconds in, once the cell
        has shown ``interrupt_on`` (however long a loaded machine took to start it). Returns the
        reply's content, every text the cell showed (streams, text/plain of displays, errors) and
        how long it took — from the interrupt, when there was one."""
        # One cell at a time, as a person runs them: without stop_on_error. With it, ipykernel 6.25
        # aborts any request that reaches it before its abort flag is cleared, on the event loop's
        # next turn after the error's reply; a loaded kernel (distnb's threads holding the GIL)
        # took longer than this client's next request once (CI, the oldest leg), which no person's
        # next cell is fast enough to meet. Run All's stop is tested in test_kernel_session.py.
        msg_id = self.kc.execute(code, stop_on_error=False)
        t0 = time.monotonic()
        interrupted = False
        texts: list[str] = []
        while True:
            if (interrupt_after is not None and not interrupted and time.monotonic() - t0 >= interrupt_after
                    and interrupt_on in "".join(texts)):
                self.km.interrupt_kernel()
                interrupted, t0 = True, time.monotonic()
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                assert time.monotonic() - t0 < timeout, f"the cell did not finish within {timeout} s:\n{''.join(texts)}"
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                texts.append(content["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                texts.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                texts.append("\n".join(content["traceback"]) + "\n")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        took = time.monotonic() - t0
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"], "".join(texts), took


@pytest.mark.timeout(240)
def test_jupyter_interrupt_stops_the_cell_and_keeps_kernel_and_pool(leak_check, tmp_path: Path) -> None:
    kernel = Kernel(tmp_path)
    try:
        content, out, _ = kernel.execute("%load_ext distnb\n%dist_launch -n 2 --backend gloo")
        assert content["status"] == "ok", out
        pids = kernel.execute("print(sorted(__import__('distnb').current_pool().pids()))")[1]

        code = "%%on_ranks\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)\nprint('never got here')"
        content, out, took = kernel.execute(code, interrupt_after=1.0, interrupt_on="sleeping")
        # The first interrupt reached the ranks: their sleep raised, and the cell ended long before 60 s.
        assert took < 20, f"the interrupted cell took {took:.1f} s after the interrupt:\n{out}"
        assert "sleeping" in out and "never got here" not in out, out
        assert "KeyboardInterrupt" in out, out

        # The kernel and the very same ranks carry on.
        content, out, _ = kernel.execute("%%on_ranks\nrank * 10")
        assert content["status"] == "ok" and "10" in out, out
        content, out, _ = kernel.execute("pool = __import__('distnb').current_pool()\nprint(pool.state.value, sorted(pool.pids()))")
        assert out.split()[0] == "ready" and out.split(None, 1)[1].strip() == pids.strip(), out
        content, out, _ = kernel.execute("%dist_shutdown")
        assert "no process left" in out, out
    finally:
        left = kernel.close()
    assert not left, "the kernel left processes behind:\n  " + "\n  ".join(left)


@pytest.mark.timeout(240)
def test_one_jupyter_interrupt_unblocks_ranks_stuck_in_a_gloo_collective(leak_check, tmp_path: Path) -> None:
    """Rank 1 never joins the all_reduce: rank 0 waits inside gloo (C++), where no signal handler
    runs. One interrupt is still enough: the notebook says at once what happens, the rank's
    connections are shut down ESCALATE_AFTER later, the cell ends, the group is rebuilt and the
    namespaces stay."""
    from distnb.worker.torch_hooks.group_abort import ESCALATE_AFTER

    kernel = Kernel(tmp_path)
    try:
        content, out, _ = kernel.execute("%load_ext distnb\n%dist_launch -n 2 --backend gloo")
        assert content["status"] == "ok", out
        content, out, _ = kernel.execute("%%on_ranks\nkept = 10 + rank\nt = torch.ones(1)")
        assert content["status"] == "ok", out

        code = "%%on_ranks\nif rank == 0:\n    print('entering', flush=True)\n    dist.all_reduce(t)\n    print('never got here')"
        # A second after rank 0 said it enters the all_reduce: it waits in gloo then.
        content, out, took = kernel.execute(code, interrupt_after=1.0, interrupt_on="entering")
        # Bounded by the product's own delay (plus the rebuild and messages), not by --pg-timeout (30 min).
        assert took < ESCALATE_AFTER + 15, f"the interrupted cell took {took:.1f} s after the interrupt:\n{out}"
        assert "entering" in out and "never got here" not in out, out
        assert "interrupting In[" in out and "Rank 0 is blocked in all_reduce" in out, out
        assert "shutting down its 1 gloo connection so the cell can stop" in out, out
        assert "Every rank has a fresh default process group" in out, out
        assert "pool." not in out.replace("pool.submit", ""), out  # hints name magics, not methods

        content, out, _ = kernel.execute("%%on_ranks\nu = torch.ones(1)\ndist.all_reduce(u)\n(u.item(), kept)")
        assert content["status"] == "ok" and "(2.0, 10)" in out and "(2.0, 11)" in out, out
        content, out, _ = kernel.execute("%dist_shutdown")
        assert "no process left" in out, out
    finally:
        left = kernel.close()
    assert not left, "the kernel left processes behind:\n  " + "\n  ".join(left)
