"""The script cut into cells (services/cases/script_cells.py), checked as a property over every line of
scripts shaped like training jobs: each cell compiles, the cells run one after another in one
namespace print what the script printed, and the cell marked failing holds the line asked for."""

from __future__ import annotations

import contextlib
import io
import textwrap

import pytest

from distnb.services.cases.script_cells import split_script

#: Scripts in the shapes training jobs take; pure Python, so that running them is cheap and exact.
SCRIPTS = {
    "main_guard": '''
        """A job with a main() and the usual guard."""
        import argparse
        import math

        # The model, such as it is.
        def build(width):
            return [math.sqrt(i) for i in range(width)]


        def main(steps, lr=0.5, *, tag="run"):
            print("start", tag, steps, lr)
            params = build(4)
            for step in range(steps):
                params = [p - lr for p in params]
                print("step", step, round(sum(params), 3))
            if steps > 1:
                print("rank-only branch")
            print("end")


        if __name__ == "__main__":
            main(3, tag="job")
        ''',
    "flat": '''
        import os; import sys
        total = 0
        for i in range(4):
            total += i
        print("total", total)
        try:
            value = 1 / (total - 6 + 1)
        finally:
            print("finally")
        with contextlib.suppress(ZeroDivisionError):
            print("in with", value)
        class Config:
            depth = 2
        print("depth", Config.depth)
        ''',
    "chain": '''
        def step(x):
            print("step", x)
            y = x * 2
            print("double", y)


        def train(n):
            for i in range(n):
                print("iter", i)
            step(n)
            print("trained")


        def main():
            print("main")
            train(2)
            print("done")


        main()
        ''',
    "returns": '''
        def main():
            out = 0
            for i in range(3):
                out += i
            return out


        result = main()
        print("result", result)


        def gen():
            yield 1


        print(list(gen()))
        ''',
    "decorated": '''
        import functools


        @functools.lru_cache(maxsize=None)
        def table(n):
            return tuple(range(n))


        def run():
            rows = table(3)
            print("rows", rows)
            print("sum", sum(rows))
            return


        if __name__ == "__main__":
            run()
        ''',
}


def _run(code: str, ns: dict[str, object]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<cell>", "exec"), ns)
    return out.getvalue()


def _printed(source: str) -> str:
    return _run(source, {"__name__": "__main__", "contextlib": contextlib})


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_line_cut_keeps_what_the_script_does(name: str) -> None:
    source = textwrap.dedent(SCRIPTS[name]).lstrip("\n")
    expected = _printed(source)
    lines = source.splitlines()
    for line in [None, *range(1, len(lines) + 1)]:
        cut = split_script(source, line, f"{name}.py")
        ns: dict[str, object] = {"__name__": "__main__", "contextlib": contextlib}
        printed = "".join(_run(cell, ns) for cell in cut.cells)
        assert printed == expected, (name, line, cut.cells)
        text = lines[line - 1].strip() if line else ""
        if cut.failing is not None:
            # The line itself, or (in a function that cannot be brought up) the statement calling into it.
            called = any("the cell that calls it holds the failure" in n for n in cut.notes)
            assert text in cut.cells[cut.failing] or called, (name, line, cut.cells[cut.failing], cut.notes)
            # Nothing but the failing statement shares its cell.
            assert cut.before()[-1] == cut.cells[cut.failing] and cut.after() == cut.cells[cut.failing + 1 :]
        elif line is not None and text and not text.startswith("#"):
            assert cut.notes, (name, line)  # a line of code that no cell holds alone: the notes say why


def test_main_is_inlined_with_its_arguments_and_the_call_gets_its_own_cell() -> None:
    source = textwrap.dedent(SCRIPTS["main_guard"]).lstrip("\n")
    line = source.splitlines().index('        print("rank-only branch")') + 1
    cut = split_script(source, line, "train.py")
    assert cut.cells[cut.failing] == 'if steps > 1:\n    print("rank-only branch")'
    assert cut.cells[cut.failing - 1].startswith("steps = 3\nlr = 0.5\ntag = \"job\"\nprint(\"start\", tag, steps, lr)")
    assert not any(c.startswith("def main") for c in cut.cells)  # called only there: its definition is gone
    assert cut.after() == ['print("end")']
    assert "main()'s body is inlined where it was called (line 22)" in cut.notes[0]


def test_a_line_three_calls_deep_is_brought_up() -> None:
    source = textwrap.dedent(SCRIPTS["chain"]).lstrip("\n")
    cut = split_script(source, 4, "chain.py")  # print("double", y) in step(), called by train(), called by main()
    assert cut.cells[cut.failing] == 'print("double", y)'
    assert [n.split("()")[0] for n in cut.notes] == ["main", "train", "step"]


def test_what_cannot_be_inlined_is_said() -> None:
    source = textwrap.dedent(SCRIPTS["returns"]).lstrip("\n")
    cut = split_script(source, 4, "returns.py")
    assert cut.cells[cut.failing] == "result = main()" and "main() leads to the failing line but is not called at the top level as a statement" in cut.notes[0]
    flat = textwrap.dedent(SCRIPTS["flat"]).lstrip("\n")
    cut = split_script(flat, 4, "flat.py")
    assert cut.cells[cut.failing] == "for i in range(4):\n    total += i"
    assert "inside the for loop at line 3: the whole statement is its cell" in cut.notes[0]


def test_a_script_that_does_not_parse_names_itself() -> None:
    with pytest.raises(SyntaxError) as err:
        split_script("def f(:\n  pass\n", 1, "broken.py")
    assert err.value.filename == "broken.py"
