"""Export the cells of a session as a standalone torchrun script or a notebook (the minimal case)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Iterable

from distnb.launch import LaunchConfig
from distnb.ranks import format_ranks
from distnb.results import CellResult

__all__ = ["export_script", "export_notebook", "select_cells"]

_PRELUDE = '''\
#!/usr/bin/env python
"""Exported by distnb from a notebook session ({n} cells).

Run:  torchrun --nproc-per-node {nproc} {name}
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

# The same names every distnb rank starts with.
rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size = int(os.environ["WORLD_SIZE"])
backend = {backend!r}
if backend == "auto":
    backend = "nccl" if torch.cuda.is_available() else "gloo"
if backend == "nccl":
    device = torch.device("cuda", local_rank)  # by LOCAL_RANK, before the process group
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
dist.init_process_group(backend, timeout=timedelta(seconds={pg_timeout!r}))


def display(*objs):
    for obj in objs:
        print(repr(obj))

'''

_EPILOGUE = '''
dist.destroy_process_group()
'''


def select_cells(history: list[CellResult], spec: str | None = None, include_failed: bool = False) -> list[CellResult]:
    """Cells by number (``"3-7,9"``), by default every cell that succeeded."""
    cells = history
    if spec:
        wanted: set[int] = set()
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            try:
                wanted.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
            except ValueError:
                raise ValueError(f"can't read cell range {part!r}; use e.g. 3-7,9.") from None
        known = {c.cell for c in history}
        missing = sorted(wanted - known)
        if missing:
            raise ValueError(f"cell(s) {', '.join(map(str, missing))} did not run in this session; cells run: {format_ranks(known).split(' ', 1)[-1]}.")
        cells = [c for c in history if c.cell in wanted]
        return cells
    return [c for c in cells if include_failed or c.ok]


def _show_last_value(code: str) -> str:
    """Make the last expression print its value, as the notebook showed it."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    lines = code.splitlines()
    head = lines[: last.lineno - 1]
    expr = "\n".join(lines[last.lineno - 1 : last.end_lineno])
    if last.col_offset:  # e.g. "x = 1; x": keep the statements before it on that line
        head.append(expr[: last.col_offset].rstrip().rstrip(";"))
        expr = expr[last.col_offset :]
    return "\n".join(head + [f"_ = ({expr})", "if _ is not None:", "    print(repr(_))"])


def export_script(cells: Iterable[CellResult], config: LaunchConfig, path: str | Path) -> Path:
    cells = list(cells)
    path = Path(path)
    parts = [_PRELUDE.format(n=len(cells), nproc=config.nproc, name=path.name, backend=config.backend, pg_timeout=config.pg_timeout)]
    for c in cells:
        body = _show_last_value(c.code.rstrip())
        everyone = list(c.ranks) == list(range(int(config.nproc or 0)))
        parts.append(f"# ---- cell {c.cell} ({'all ranks' if everyone else format_ranks(c.ranks)}) ----")
        if everyone:
            parts.append(body + "\n")
        else:
            parts.append(f"if rank in {{{', '.join(map(str, c.ranks))}}}:\n{textwrap.indent(body, '    ') or '    pass'}\n")
    parts.append(_EPILOGUE)
    path.write_text("\n".join(parts))
    return path


def export_notebook(cells: Iterable[CellResult], config: LaunchConfig, path: str | Path) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

    cells = list(cells)
    launch = f"%dist_launch -n {config.nproc} --backend {config.backend}"
    nb = new_notebook(
        cells=[
            new_markdown_cell(f"Exported by distnb: {len(cells)} cells, {config.nproc} ranks."),
            new_code_cell(f"%load_ext distnb\n{launch}"),
        ]
    )
    for c in cells:
        target = "" if list(c.ranks) == list(range(int(config.nproc or 0))) else " " + ",".join(map(str, c.ranks))
        nb.cells.append(new_code_cell(f"%%on_ranks{target}\n{c.code.rstrip()}"))
    nb.cells.append(new_code_cell("%dist_shutdown"))
    path = Path(path)
    nbformat.write(nb, str(path))
    return path
