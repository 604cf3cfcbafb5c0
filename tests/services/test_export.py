"""%dist_export: the exported script, run under torchrun, prints what the notebook showed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbtext import outputs_text

import distnb
from distnb.controller.session import CellRecord
from distnb.services.cases.export import _show_last_value, select_cells

from conftest import run_notebook

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CELLS = [
    ("x = torch.full((2,), float(rank))\ndist.all_reduce(x)\nprint('sum', x.tolist())", None),
    ("print('only', rank)\nrank * 100", "0,2"),
    # Pushed between cells 2 and 3 (see PUSHES): the export must re-create them there.
    ("y = x * scale + w.sum(); y.sum().item()", None),
    ("import os\nprint('env', os.environ.get('DISTNB_EXPORT_MARK'), float(z.sum()))", "1,2"),
    ("1/0", None),  # failed: left out by default
]
#: Cell index → values pushed before it: a literal, a tensor (pickled inline), one rank only.
PUSHES = {2: [({"scale": 3}, None), ({"w": "torch.arange(3.0)"}, None)], 3: [({"z": "torch.ones(2)"}, "1,2")]}


def run_session(pool: distnb.Pool) -> None:
    import torch

    made = {"torch.arange(3.0)": torch.arange(3.0), "torch.ones(2)": torch.ones(2)}
    for i, (code, ranks) in enumerate(CELLS):
        for values, push_ranks in PUSHES.get(i, []):
            pool.push(ranks=push_ranks, **{k: made.get(v, v) if isinstance(v, str) else v for k, v in values.items()})
        pool.run(code, ranks)


def test_last_value_rewrite() -> None:
    assert _show_last_value("a = 1\na + 1").splitlines() == ["a = 1", "_ = (a + 1)", "if _ is not None:", "    print(repr(_))"]
    assert _show_last_value("y = 2; y").splitlines()[:2] == ["y = 2", "_ = (y)"]
    assert _show_last_value("a = 1") == "a = 1"


def test_export_script_matches_notebook_output(tmp_path: Path) -> None:
    with distnb.Pool(nproc=3, backend="gloo", env={"DISTNB_EXPORT_MARK": "kept"}) as pool:
        run_session(pool)
        assert all(c.ok for c in pool.history[:4]), [c.text() for c in pool.history]
        # --ok: the cells that succeeded, a script that runs through (the default ends at the failure).
        script = Path(pool.export(str(tmp_path / "repro.py"), only_ok=True))
        nb_path = Path(pool.export(str(tmp_path / "repro.ipynb"), only_ok=True))
        # Cell numbers are unique in the process (every pool draws from one count): this pool's run from its first.
        first, last = pool.history[0].cell, pool.history[-1].cell
        with pytest.raises(ValueError, match=f"{last + 1} is not among this session's cell numbers; those run: {first}-{last}"):
            pool.export(str(tmp_path / "x.py"), cells=f"{first}-{last + 1}")
        expected = {}
        for r in range(3):
            lines = []
            for res in pool.history[:4]:
                if r in res.results:
                    lines += res.results[r].stdout.splitlines()
                    if res.results[r].value_text is not None:
                        lines.append(res.results[r].value_text)
            expected[r] = lines
    text = script.read_text()
    assert "if rank in {0, 2}:" in text and "1/0" not in text
    assert "scale = 3" in text and "pickle.loads(base64.b64decode(" in text
    # Python-run cells are named by their process-wide number (other tests' pools drew numbers before this one).
    third, fourth = f"# ---- cell {first + 2} ", f"# ---- cell {first + 3} "
    assert text.index("scale = 3") < text.index(third) and text.index("# ---- %dist_push z (ranks 1,2)") < text.index(fourth)
    assert "os.environ.setdefault('DISTNB_EXPORT_MARK', 'kept')" in text
    assert "env kept 2.0" in "\n".join(expected[1])
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         "--redirects", "3", "--log-dir", str(logs), str(script)],
        capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(3):
        [out] = list(logs.rglob(f"attempt_0/{r}/stdout.log"))
        assert out.read_text().splitlines() == expected[r]
    nb = nbformat.read(str(nb_path), as_version=4)
    sources = [c.source for c in nb.cells]
    assert sources[1].startswith("%load_ext distnb\n%dist_launch -n 3") and "--env DISTNB_EXPORT_MARK=kept" in sources[1]
    assert sources[3].startswith("%%on_ranks 0,2\n") and sources[-1] == "%dist_shutdown"
    assert "scale = 3\n%dist_push scale" in sources[4]

    # The exported notebook runs in a real kernel and shows what the session showed.
    ran = run_notebook(nb, str(tmp_path), "DISTNB_EXPORT_TEST")
    shown = "\n".join(outputs_text(c) for c in ran.cells if c.cell_type == "code")
    assert not any(o.get("output_type") == "error" for c in ran.cells for o in c.get("outputs", [])), shown
    assert "[ranks 1,2] env kept 2.0" in shown and "Out[ranks 0-2]: 24.0" in shown and "Out[rank 2]: 200" in shown, shown


def test_select_cells_errors() -> None:
    with pytest.raises(ValueError, match="can't read"):
        select_cells([], "a-b")
    with pytest.raises(ValueError, match=r"cells run from Python have no In\[n\]"):
        select_cells([CellRecord(1, "x", (0,), True)], "1", by_label=True)


def _records(oks: list[bool]) -> list[CellRecord]:
    return [CellRecord(i + 1, f"c{i + 1}", (0, 1), ok, label=i + 10) for i, ok in enumerate(oks)]


def test_the_default_export_is_the_minimal_failing_case() -> None:
    """The cells that succeeded up to the last failure, and that failure: an earlier, unrelated
    failure stays out (it would stop the script before the one being reported)."""
    history = _records([True, False, True, True, False, True])
    assert [c.cell for c in select_cells(history)] == [1, 3, 4, 5]
    assert [c.cell for c in select_cells(history, only_ok=True)] == [1, 3, 4, 6]
    assert [c.cell for c in select_cells(history, include_failed=True)] == [1, 2, 3, 4, 5, 6]
    assert [c.cell for c in select_cells(_records([True, True]))] == [1, 2]  # nothing failed: all of it
    # The notebook's own In[n] numbers (In[10] … In[15] here), as %dist_export --cells reads them.
    assert [c.cell for c in select_cells(history, "In[12]-13,15", by_label=True)] == [3, 4, 6]
    with pytest.raises(ValueError, match=r"20 is not among this session's In\[n\] numbers; those run: 10-15"):
        select_cells(history, "20", by_label=True)


def test_an_export_fails_the_way_the_session_did(tmp_path: Path) -> None:
    """Run under torchrun, the default export of a session whose last cell failed on one rank
    fails there, with the same error, after the cells before it ran."""
    with distnb.Pool(nproc=2, backend="gloo") as pool:
        assert pool.run("1/0").failed == [0, 1]  # an earlier failure, unrelated: left out
        assert pool.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nprint('sum', t.tolist())").ok
        bad = pool.run("if rank == 1:\n    raise ValueError(f'bad batch on rank {rank}')\n'fine'")
        assert bad.failed == [1]
        written = pool.export(str(tmp_path / "repro.py"))
    ok = bad.cell - 1  # run from Python: named by distnb's own numbers (no In[n])
    assert written.cells == (f"cell {ok}", f"cell {bad.cell}") and written.failing == f"cell {bad.cell}"
    # Said "reproduced" only once it was run: rank 1 raised the same error under torchrun.
    assert f"it ends with cell {bad.cell}, which failed in the session" in written.text()
    assert written.verified is not None and written.verified.reproduced, written.text()
    assert "verified: running it under torchrun reproduced the failure (rank 1 raised ValueError: bad batch on rank 1)" in written.text()
    assert "torchrun --nproc-per-node 2" in written.text()
    text = Path(written).read_text()
    assert "1/0" not in text and f"# ---- cell {bad.cell} (all ranks): it failed in the session ----" in text
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--redirects", "3", "--log-dir", str(logs), str(written)],
        capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    [err1] = list(logs.rglob("attempt_0/1/stderr.log"))
    assert "ValueError: bad batch on rank 1" in err1.read_text()
    [out0] = list(logs.rglob("attempt_0/0/stdout.log"))
    assert out0.read_text().splitlines() == ["sum [3.0, 3.0]", "'fine'"]


def test_an_exported_notebook_tags_its_failing_cell_so_it_runs_through_to_the_shutdown(tmp_path: Path) -> None:
    import nbformat

    from distnb.config import LaunchConfig
    from distnb.controller.session import CellRecord
    from distnb.services.cases.export import export_notebook

    steps = [CellRecord(1, "x = 1", (0, 1), True), CellRecord(2, "1/0", (0, 1), False)]
    nb = nbformat.read(str(export_notebook(steps, LaunchConfig(nproc=2, backend="gloo"), tmp_path / "r.ipynb")), as_version=4)
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert tags == [[], [], ["raises-exception"], []], tags  # launch, cell 1, the failing cell, the shutdown


def test_a_hang_exports_as_a_script_that_ends_by_itself_and_is_verified_as_the_command_runs(tmp_path: Path) -> None:
    """The session's last cell hung (rank 1 alone in an all_reduce on a group made after the
    launch, as init_device_mesh's are): the script times its collectives out after HANG_TIMEOUT —
    that group's too, not torch's 30 minutes for later groups — so the printed command ends by
    itself, and the check, run the same way, counts the rank that timed out as hung while rank 0
    finished and waited."""
    from distnb.services.cases.export import HANG_TIMEOUT

    with distnb.Pool(nproc=2, backend="gloo") as pool:
        assert pool.run("t = torch.ones(2)\ng = dist.new_group([0, 1])\ndist.all_reduce(t, group=g)").ok
        hung = pool.run("if rank == 1:\n    dist.all_reduce(t, group=g)\n'done'", timeout=8)
        assert hung.timed_out and hung.running == [1], hung.text()
        written = pool.export(str(tmp_path / "repro.py"))
    assert written.hang_timeout == HANG_TIMEOUT and "time out after 30 s (TIMEOUT in the script)" in written.text()
    assert written.verified is not None and written.verified.reproduced, written.text()
    assert "reproduced the failure (rank 1 never finished (a hang))" in written.text()
    assert f"TIMEOUT = {HANG_TIMEOUT!r}" in Path(written).read_text()
    logs = tmp_path / "logs"
    # The printed command, bounded only by the test: the script's own timeout ends it.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--redirects", "3",
                           "--log-dir", str(logs), str(written)], capture_output=True, text=True, timeout=HANG_TIMEOUT + 120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    [err1] = list(logs.rglob("attempt_0/1/stderr.log"))
    assert "Timed out waiting" in err1.read_text()
    [out0] = list(logs.rglob("attempt_0/0/stdout.log"))
    assert out0.read_text().splitlines() == ["'done'"]


def test_ranks_a_finished_rank_stopped_waiting_for_hung_even_if_their_connections_closed_after(tmp_path: Path) -> None:
    """A script's group that waits longer than the script's own wait (a group made with its own
    timeout): the finished rank says it stopped waiting and leaves, and the others' closed
    connections after it are that consequence — they hung, as in the session."""
    from distnb.services.cases.verify import GAVE_UP, _signature

    logs = tmp_path / "logs" / "run" / "attempt_0"
    closed = ("[rank{r}]: Traceback (most recent call last):\n[rank{r}]:   File \"repro.py\", line 9\n"
              "[rank{r}]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:8323. This is typically caused by a remote worker crashing.\n")
    for r in range(4):
        (logs / str(r)).mkdir(parents=True)
        (logs / str(r) / "stdout.log").write_text(f"rank {r} finished; {GAVE_UP} 40 s\n" if r in (0, 2) else "")
        (logs / str(r) / "stderr.log").write_text(closed.format(r=r) if r in (1, 3) else "")
    got = _signature(tmp_path / "logs", "", 4, {0, 2}, ran_out=False)
    assert got.hung == (1, 3) and not got.errors, got
    # Without the finished ranks' word, the closed connections are consequences of nothing seen: no failure.
    for r in (0, 2):
        (logs / str(r) / "stdout.log").write_text("")
    assert not _signature(tmp_path / "logs", "", 4, {0, 2}, ran_out=False).failed
