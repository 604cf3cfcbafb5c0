"""What a cell is called in every message: the notebook's ``In[n]`` where it has one.

distnb numbers the cells it runs itself (a replay or a restart runs a cell again under a new
number; cells run from Python, and the cells magics such as ``%dist_check`` run, have no ``In[n]``).
The user knows a cell by the kernel's execution count, so every report, table and verdict names a
cell through :func:`cell_name`: ``In[12]`` for a cell the notebook ran (and for its replays, which
keep that name), ``cell 17`` otherwise.

Cell numbers are unique in the process (every pool draws from :func:`next_cell_number`), so one
table serves every pool a kernel holds, without a pool to look the name up in: the analysis
layer renders its words from records that carry only the number.
"""

from __future__ import annotations

import itertools
import re
import threading

__all__ = ["cell_label", "cell_name", "cell_tag", "name_cell", "name_cells_in", "next_cell_number"]

_numbers = itertools.count(1)
_labels: dict[int, int] = {}  # distnb's cell number -> the notebook's In[n]; two ints a cell
_lock = threading.Lock()
_CELL_FILE = re.compile(r"<cell-(\d+)>")  # a cell's code objects' filename (wire.cell_code.cell_filename)


def next_cell_number() -> int:
    """A cell number no pool in this process has used."""
    with _lock:
        return next(_numbers)


def name_cell(cell: int, label: int | None) -> None:
    """Record that cell ``cell`` is the notebook's ``In[label]`` (None: it has no In[n])."""
    if label is not None:
        _labels[cell] = label


def cell_label(cell: int | None) -> int | None:
    """The notebook's In[n] of a cell, or None (run from Python, or unknown)."""
    return _labels.get(cell) if cell is not None else None


def cell_name(cell: int | str | None) -> str:
    """``"In[12]"`` for a cell the notebook ran, ``"cell 17"`` for one run from Python."""
    if isinstance(cell, str):
        cell = int(cell) if cell.isdigit() else None
    if cell is None:
        return "a cell"
    label = _labels.get(cell)
    return f"In[{label}]" if label is not None else f"cell {cell}"


def cell_tag(cell: int | None) -> str:
    """The short form a table cell fits: ``"In[12]"``, or ``"c17"`` for a cell with no In[n]."""
    if cell is None:
        return ""
    label = _labels.get(cell)
    return f"In[{label}]" if label is not None else f"c{cell}"


def name_cells_in(text: str) -> str:
    """A traceback with each notebook cell's ``<cell-17>`` written as its ``In[12]`` (as IPython's
    own tracebacks say "Cell In[12]"); cells with no In[n] keep their filename."""
    return _CELL_FILE.sub(lambda m: f"In[{label}]" if (label := _labels.get(int(m.group(1)))) is not None else m.group(0), text)
