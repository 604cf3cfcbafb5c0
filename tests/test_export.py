"""%dist_export: the exported script, run under torchrun, prints what the notebook showed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import distnb
from distnb.export import _show_last_value, select_cells

pytestmark = pytest.mark.timeout(180)

CELLS = [
    ("x = torch.full((2,), float(rank))\ndist.all_reduce(x)\nprint('sum', x.tolist())", None),
    ("print('only', rank)\nrank * 100", "0,2"),
    ("y = x * 2; y.sum().item()", None),
    ("1/0", None),  # failed: left out by default
]


def test_last_value_rewrite() -> None:
    assert _show_last_value("a = 1\na + 1").splitlines() == ["a = 1", "_ = (a + 1)", "if _ is not None:", "    print(repr(_))"]
    assert _show_last_value("y = 2; y").splitlines()[:2] == ["y = 2", "_ = (y)"]
    assert _show_last_value("a = 1") == "a = 1"


def test_export_script_matches_notebook_output(tmp_path: Path) -> None:
    with distnb.Pool(nproc=3, backend="gloo") as pool:
        for code, ranks in CELLS:
            pool.run(code, ranks)
        script = Path(pool.export(str(tmp_path / "repro.py")))
        nb_path = Path(pool.export(str(tmp_path / "repro.ipynb")))
        with pytest.raises(ValueError, match="did not run"):
            pool.export(str(tmp_path / "x.py"), cells="1-40")
        expected = {}
        for r in range(3):
            lines = []
            for res in pool.history[:3]:
                if r in res.results:
                    lines += res.results[r].stdout.splitlines()
                    if res.results[r].value_text is not None:
                        lines.append(res.results[r].value_text)
            expected[r] = lines
    text = script.read_text()
    assert "if rank in {0, 2}:" in text and "1/0" not in text
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
    assert sources[1].startswith("%load_ext distnb\n%dist_launch -n 3")
    assert sources[3].startswith("%%on_ranks 0,2\n") and sources[-1] == "%dist_shutdown"


def test_select_cells_errors() -> None:
    with pytest.raises(ValueError, match="can't read"):
        select_cells([], "a-b")
