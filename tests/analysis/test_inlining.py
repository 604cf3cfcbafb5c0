"""Constants written into where they are read (analysis/inlining.py): the session's settings stop
being statements of the minimal case, and what the code does stays the same."""

from __future__ import annotations

import random
import sys
import warnings

from exec_cells import printed

from distnb.analysis.inlining import inline_constants


def test_settings_read_once_bound_are_written_in_and_their_assignments_go() -> None:
    cells = ["n_embd = 32\nbias = False\nlr = -1e-3\nname = 'gpt'\nshape = (2, -3)\nsteps = 0",
             "layer = torch.nn.Linear(n_embd, 4 * n_embd, bias=bias)\nsteps += 1\nprint(lr * 2, name, shape[1])"]
    got = inline_constants(cells)
    assert got is not None
    out, names = got
    assert names == ["bias", "lr", "n_embd", "name", "shape"]  # steps is bound twice: it stays
    # … and what the settings leave is folded: 4 * 32 is 128.
    assert out == ["steps = 0", "layer = torch.nn.Linear(32, 128, bias=False)\nsteps += 1\nprint(-0.002, 'gpt', (2, -3)[1])"]


def test_what_could_change_meaning_stays() -> None:
    cells = ["a = 1\nb = 2\nc = 3; d = 4\nlen = 5\nf = 's'\ng = 7\nh = 8",
             "def use(a):\n    return a\nfor b in range(2):\n    pass\nprint(f'{f}', len, c, d)\n"
             "def glob():\n    global g\n    g = 9\nclass K:\n    h = 1\nprint(use(a), g, h)"]
    got = inline_constants(cells)
    # a (a parameter elsewhere), b (a loop's), c and d (a shared line), g (global), h (a class
    # attribute): none inlined; len (a builtin's name) read only after its assignment runs is; f only
    # after Python 3.11 (a string in an f-string) — before, its assignment stays and nothing else reads it.
    assert got is not None and "print(f'{" + ("'s'" if sys.version_info >= (3, 12) else "f") + "}', 5, c, d)" in got[0][1], got
    assert got[1] == (["f", "len"] if sys.version_info >= (3, 12) else ["len"]), got
    # A builtin's name read before the assignment runs is the builtin there: it stays.
    assert inline_constants(["n = len([1])\nlen = 5", "print(len)"]) is None


def test_no_cell_that_does_not_parse_and_nothing_to_inline_give_none() -> None:
    assert inline_constants(["x = (", "print(x)"]) is None
    assert inline_constants(["x = f()", "print(x)"]) is None


# -- random sessions: the inlined one prints what the session printed -------------------------------
NAMES = ["a", "b", "c", "d", "e"]
LITERALS = ["1", "-2", "2.5", "'s'", "'ü€'", "None", "True", "(1, -2)", "0x10", "-0.5"]


def _statement(rng: random.Random, k: int) -> str:
    n, m = rng.choice(NAMES), rng.choice(NAMES)
    if rng.random() < 0.6:  # reads only
        return rng.choice([f"print({n!s}, {m})", f"print('é€', {n}, [{m}, {n}])", f"print(f'{{{n}}} {{{m}!r}}')",
                           f"if {n}:\n    print({m}, {n})", f"print({n} * 2 if isinstance({n}, (int, float)) else {m}, {n} == {m})",
                           f"print(str({n})[:3], ({n}, {m}))", f"print({n} ** 2 if type({n}) is int else {n})",
                           f"print(f'{{{n}!r:>{{len(str({m}))}}}}')"])
    return rng.choice([
        f"{n} = {rng.choice(LITERALS)}",
        f"print('é€', {n}, [{m}, {n}])",
        f"def f{k}({n}):\n    return repr({n}) + repr({m})\nprint(f{k}({rng.choice(LITERALS)}))",
        f"print(f'{{{n}}} {{{m}!r}}')",
        f"for {n} in range(2):\n    print({m})",
        f"{n} = {m}",
        f"{n} = {rng.choice(LITERALS)}; print({m})",
        f"if {n}:\n    print({m}, {n})",
        f"print((lambda {n}: {n})({m}), {{{m}: {n}}})",
    ])


def _run(cells: list[str]) -> str | None:
    """What the cells print; None when one raised NameError (a read before the name was bound:
    inlining gives it a value — no session that ran gets there)."""
    return printed(cells, none_on=(NameError,))


def test_random_sessions_print_the_same_once_inlined() -> None:
    rng = random.Random(3)
    inlined = compared = 0
    for _ in range(1500):
        # The settings first (each name bound there once), as a pasted script's opening block.
        settings = "\n".join(f"{n} = {rng.choice(LITERALS)}" for n in NAMES)
        cells = [settings, *("\n".join(_statement(rng, 10 * c + s) for s in range(rng.randint(1, 5))) for c in range(rng.randint(1, 3)))]
        before = _run(cells)
        if before is None:
            continue
        got = inline_constants(cells)
        compared += 1
        if got is None:
            continue
        inlined += 1
        assert _run(got[0]) == before, (cells, got)
    assert compared > 500 and inlined > 150, (compared, inlined)


def test_the_names_cells_read_and_nothing_in_them_sets() -> None:
    from distnb.analysis.names import unbound_reads

    cells = ["import os.path\nfrom math import *\ndef f(x, *args, k=1, **kw):\n    return x + y + len(args) + [i for i in kw][0]",
             "z = f(1)\nfor a, (b, c) in items:\n    print(a, b, c, os, undefined)\nwith open('f') as fh:\n    pass\n"
             "try:\n    pass\nexcept Exception as err:\n    print(err)\nif (n := 3):\n    print(n, rank)"]
    assert unbound_reads(cells) == {"y", "items", "undefined", "rank"}
    assert unbound_reads(["x = ("]) is None


def test_names_read_before_the_code_binds_them_in_the_order_it_runs() -> None:
    from distnb.analysis.names import read_before_bound

    # A loop's body read once through; a comprehension's names stay in it; a function's body runs
    # later (a global it reads may be bound after it); n += 1 reads n.
    assert read_before_bound(["while True:\n    dt = now - t0\n    t0 = 1\n    now = 2"]) == {"now", "t0"}
    assert read_before_bound(["x = [i * j for i in range(3) for j in range(i)]\nprint(i)"]) == {"i"}
    assert read_before_bound(["def f(a=b):\n    return later\nlater = 1\nn += 1", "print(f())"]) == {"b", "n"}
    assert read_before_bound(["import os.path as p, sys\nfrom math import pi\nprint(p, sys, pi, os)"]) == {"os"}
    assert read_before_bound(["try:\n    pass\nexcept ValueError as e:\n    print(e)\nfor k, v in {}.items():\n    print(k, v)"]) == set()
    assert read_before_bound(["x = ("]) is None


def test_random_sessions_raise_name_error_only_where_a_read_comes_before_its_binding() -> None:
    """Sessions of random statements: where the reading says no name is read before it is bound,
    running them raises no NameError (the reading may say more than happens: a branch not taken).
    A function's body is read only for names bound nowhere (it runs when called, which the reading
    does not follow): sessions with a ``def`` are left out."""
    from distnb.analysis.names import read_before_bound

    rng = random.Random(9)
    said_clean = 0
    for _ in range(2000):
        settings = "\n".join(f"{n} = {rng.choice(LITERALS)}" for n in NAMES if rng.random() < 0.8) or "pass"
        cells = [settings, *("\n".join(_statement(rng, 10 * c + s) for s in range(rng.randint(1, 4))) for c in range(rng.randint(1, 3)))]
        if read_before_bound(cells) or any("def " in c for c in cells):
            continue
        said_clean += 1
        assert _run(cells) is not None, cells  # None: a NameError
    assert said_clean > 200, said_clean


def test_what_writing_settings_in_leaves_is_folded_to_values() -> None:
    from distnb.analysis.inlining import fold_constants

    code = ("while 0 < 6:\n    if 0 % 1 == 0 and master:\n        x = nn.Linear(32, 4 * 32)\n"
            "    y = f'{4 * 32}' + str(2 ** 10000) + ('-' * 3)\n    z = (True and (a if b else c)) or d\n    w = -(2 - 3) + v\n"
            "    if False and master:\n        import wandb\n    u = True and 0 and log(x)")
    assert fold_constants(code) == (
        "while True:\n    if master:\n        x = nn.Linear(32, 128)\n"
        "    y = f'{4 * 32}' + str(2 ** 10000) + ('---')\n    z = ((a if b else c)) or d\n    w = 1 + v\n"
        "    if False:\n        import wandb\n    u = 0")


def test_folded_random_expressions_keep_their_values() -> None:
    from distnb.analysis.inlining import fold_constants

    rng = random.Random(4)
    atoms = ["1", "2", "-3", "0", "2.5", "True", "False", "None", "x", "y", "'s'"]

    def expr(depth: int) -> str:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(atoms)
        kind = rng.randrange(5)
        a, b = expr(depth - 1), expr(depth - 1)
        if kind == 0:
            return f"({a} {rng.choice(['+', '-', '*', '%', '//', '**'])} {b})"
        if kind == 1:
            return f"{a} {rng.choice(['and', 'or'])} {b}"
        if kind == 2:
            return f"({a} {rng.choice(['<', '==', '!=', 'is', 'is not'])} {b})"
        if kind == 3:
            return f"(not {a})"
        return f"({a} if {b} else {expr(depth - 1)})"

    def value(code: str) -> str:
        try:
            with warnings.catch_warnings():  # `1 is 1`
                warnings.simplefilter("ignore")
                return repr(eval(code, {"__builtins__": {}}, {"x": 7, "y": 0}))  # noqa: S307 (the test's own expressions)
        except Exception as exc:
            return type(exc).__name__

    folded = 0
    for _ in range(3000):
        code = expr(4)
        out = fold_constants(code)
        folded += out != code
        assert value(out) == value(code), (code, out)
    assert folded > 1000, folded
