"""A cell is named as the notebook knows it (its In[n]) in every message, and by distnb's number
only where it has none (run from Python)."""

from __future__ import annotations

from distnb.cell_names import cell_label, cell_name, cell_tag, name_cell, name_cells_in, next_cell_number
from distnb.controller.session import SessionLog


def test_a_cell_with_an_in_number_is_named_by_it_everywhere_and_others_by_their_number() -> None:
    labelled, plain = next_cell_number(), next_cell_number()
    name_cell(labelled, 7)
    name_cell(plain, None)
    assert (cell_name(labelled), cell_tag(labelled), cell_label(labelled)) == ("In[7]", "In[7]", 7)
    assert (cell_name(plain), cell_tag(plain), cell_label(plain)) == (f"cell {plain}", f"c{plain}", None)
    assert cell_name(str(labelled)) == "In[7]" and cell_name(None) == "a cell" and cell_tag(None) == ""
    tb = f'  File "<cell-{labelled}>", line 2, in <module>\n  File "<cell-{plain}>", line 1, in f\n'
    assert name_cells_in(tb) == f'  File "In[7]", line 2, in <module>\n  File "<cell-{plain}>", line 1, in f\n'


def test_a_replay_keeps_the_name_and_two_pools_never_share_a_number() -> None:
    first, second = SessionLog(), SessionLog()
    a, b = first.next_cell(), second.next_cell()
    assert a != b  # one table of names serves every pool in the kernel
    name_cell(a, 3)
    replayed = first.next_cell()
    name_cell(replayed, 3)  # a replay re-runs In[3] under a new number
    assert cell_name(replayed) == cell_name(a) == "In[3]" and cell_name(b) == f"cell {b}"
