"""README's main job: ``python -m distnb demo`` on a CPU pool, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from conftest import kill_pids, marked_processes, started_pids, wait_gone

pytestmark = pytest.mark.slow  # every test here starts processes


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc", [4, 1])
def test_demo_runs_and_leaves_nothing(nproc: int) -> None:
    token = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "distnb", "demo", "-n", str(nproc)], capture_output=True, text=True,
                          timeout=140, env={**os.environ, "DISTNB_DEMO_TEST": token})
    left = marked_processes("DISTNB_DEMO_TEST", token)
    started_pids.update(left)
    survivors = wait_gone(left, 5.0)
    kill_pids(survivors)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    last = nproc - 1
    total = float(sum(range(nproc)))
    assert f"Out[{'rank 0' if nproc == 1 else f'ranks 0-{last}'}]: tensor([{total:g}., {total:g}.])" in out, out
    assert f"I am rank {last} of {nproc} on cpu" in out
    assert f"ValueError on rank {last} at cell line 2" in out and f"rank {last} got a bad batch" in out
    assert "pool shut down; no process left." in out
    assert not survivors, f"the demo left processes behind: {survivors}"


def test_demo_rejects_a_bad_rank_count() -> None:
    proc = subprocess.run([sys.executable, "-m", "distnb", "demo", "-n", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "-n takes 1 to 64 ranks" in proc.stderr
