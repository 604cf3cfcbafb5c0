"""A ``with`` over a context that does nothing, written as its body (analysis/null_contexts.py):
what the cells do stays the same, and anything that could change it keeps the ``with``."""

from __future__ import annotations

import random

from exec_cells import printed

from distnb.analysis.cell_parts import statements
from distnb.analysis.inlining import inline_constants
from distnb.analysis.null_contexts import unwrap_null_contexts


def test_a_pasted_scripts_autocast_context_on_the_cpu_goes_with_its_assignment_and_import() -> None:
    cells = ["import os\nfrom contextlib import nullcontext\ndevice = 'cpu'\n"
             "device_type = 'cuda' if 'cuda' in device else 'cpu'\n"
             "ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)",
             "for step in range(3):\n    with ctx:\n        # the forward\n        logits, loss = model(X,\n"
             "                             Y)\n    loss.backward()\n"
             "with ctx:\n    @torch.no_grad()\n    def evaluate():\n        return 1\nprint(evaluate())"]
    inlined = inline_constants(cells)
    assert inlined is not None and inlined[1] == ["device", "device_type"], inlined  # a setting made of settings, in two rounds
    got = unwrap_null_contexts(inlined[0])
    assert got is not None
    out, count = got
    assert count == 2
    assert out == ["import os",
                   "for step in range(3):\n    logits, loss = model(X,\n                         Y)\n    loss.backward()\n"
                   "@torch.no_grad()\ndef evaluate():\n    return 1\nprint(evaluate())"], out
    assert len(statements(out[1])) == 3  # the decorator stays with its function


def test_each_way_of_naming_it_and_nested_withs() -> None:
    cells = ["import contextlib as cl\nfrom contextlib import nullcontext as nc, contextmanager\nouter = cl.nullcontext()",
             "with outer:\n    with nc():\n        x = 1\n    with cl.nullcontext():\n        y = 2\nprint(x, y)"]
    got = unwrap_null_contexts(cells)
    assert got is not None
    assert got == (["import contextlib as cl\nfrom contextlib import contextmanager", "x = 1\ny = 2\nprint(x, y)"], 3), got


def test_what_could_change_meaning_keeps_its_with() -> None:
    kept = [
        ["from contextlib import nullcontext\nctx = nullcontext()", "with ctx:\n    x = 1\nrun(ctx)"],  # read elsewhere
        ["from contextlib import nullcontext", "with nullcontext(5) as v:\n    print(v)"],  # `as`, an argument
        ["from contextlib import nullcontext\nctx = nullcontext()\nctx = autocast()", "with ctx:\n    x = 1"],  # bound twice
        ["from contextlib import nullcontext", "def f(nullcontext):\n    with nullcontext():\n        pass"],  # a parameter's name
        ["from contextlib import nullcontext", "with nullcontext():\n    s = '''a\n    b'''"],  # a string across lines
        ["from contextlib import nullcontext", "with nullcontext(), open('f'):\n    pass"],  # two contexts
        ["from mylib import nullcontext", "with nullcontext():\n    pass"],  # not contextlib's
        ["from contextlib import nullcontext", "with nullcontext(): x = 1"],  # on one line
    ]
    for cells in kept:
        assert unwrap_null_contexts(cells) is None, cells
    assert unwrap_null_contexts(["with (", "x"]) is None


# -- random sessions: the unwrapped cells print what the session printed --------------------------
def _block(rng: random.Random, depth: int, indent: str) -> list[str]:
    lines: list[str] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6 if depth else 3)
        if kind == 0:
            lines.append(f"{indent}x = x + {rng.randint(1, 9)}")
        elif kind == 1:
            lines.append(f"{indent}print('at', x, [x,\n{indent}  {rng.randint(0, 9)}])")
        elif kind == 2:
            lines.append(f"{indent}if x % 3 == 0:\n{indent}    raise ValueError(x)")
        else:
            head = rng.choice(["with ctx:", "with nullcontext():", "with other:", "for _ in range(2):", "with ctx, other:"])
            lines.append(f"{indent}{head}")
            lines += _block(rng, depth - 1, indent + rng.choice(["    ", "  ", "\t"] if "\t" not in indent else ["\t"]))
    return lines


def _run(cells: list[str]) -> str:
    return printed(cells, messages=True) or ""


def test_random_sessions_print_the_same_once_unwrapped() -> None:
    rng = random.Random(11)
    unwrapped = 0
    for _ in range(600):
        setup = ("from contextlib import nullcontext\nimport contextlib\nctx = nullcontext()\n"
                 "other = contextlib.ExitStack()\nx = 0")
        cells = [setup, *("\n".join(_block(rng, 3, "")) for _ in range(rng.randint(1, 3)))]
        before = _run(cells)
        got = unwrap_null_contexts(cells)
        if got is None:
            continue
        unwrapped += 1
        assert _run(got[0]) == before, (cells, got)
    assert unwrapped > 120, unwrapped  # `with ctx, other:` keeps ctx, and its other withs, in the rest
