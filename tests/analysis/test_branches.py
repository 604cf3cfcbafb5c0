"""Branches the settings decide (analysis/branches.py): written as the branch that runs, and what
a program does stays the same."""

from __future__ import annotations

import random

import pytest
from exec_cells import printed

from distnb.analysis.branches import drop_dead_branches
from distnb.analysis.inlining import inline_constants


def test_a_pasted_scripts_settings_choose_its_branches() -> None:
    cells = ["init_from = 'scratch'\ndevice_type = 'cpu'\nwandb_log = False",
             "if init_from == 'scratch':\n    model = make()\nelif init_from == 'resume':\n    print(f'Resuming from {init_from}')\n"
             "    model = load()\nelse:\n    model = None\n"
             "def get_batch():\n    x = data()\n    if device_type == 'cuda':\n        x = x.pin_memory()\n    else:\n        x = x.to('cpu')\n    return x\n"
             "if wandb_log:\n    import wandb\n    wandb.init()"]
    got = inline_constants(cells)
    assert got is not None
    # init_from is read in an f-string (before 3.12 a string is not written into one): it is written
    # in elsewhere, the branch that read it goes, and a later round takes its assignment too.
    assert got[1] == ["device_type", "init_from", "wandb_log"], got
    assert got[0] == ["", "model = make()\ndef get_batch():\n    x = data()\n    x = x.to('cpu')\n    return x"], got[0]


@pytest.mark.parametrize("code, expected", [
    ("if False:\n    a = 1\nelif c:\n    b = 2\nelse:\n    e = 3", "if c:\n    b = 2\nelse:\n    e = 3"),
    ("for i in r:\n    if False:\n        a = 1", "for i in r:\n    pass"),
    ("while False:\n    q = 1\nwhile True:\n    break", "while True:\n    break"),
    ("if 0:\n    a = 1\nelse:\n    # why\n    @dec\n    def g():\n        pass", "@dec\ndef g():\n    pass"),
    ("if True: x = 1", "if True: x = 1"),  # on its header's line
    ("if True:\n    s = '''a\n    b'''", "if True:\n    s = '''a\n    b'''"),  # a string across lines
    ("def f():\n    if False:\n        x = 1\n    return x", "def f():\n    if False:\n        x = 1\n    return x"),  # x local
    ("def f():\n    if False:\n        yield 1", "def f():\n    if False:\n        yield 1"),  # a generator
    ("def f():\n    x = 0\n    if False:\n        x = 1\n    return x", "def f():\n    x = 0\n    return x"),
])
def test_each_shape(code: str, expected: str) -> None:
    assert drop_dead_branches(code) == expected


# -- random programs: the same output once their constant branches go ----------------------------
def _block(rng: random.Random, depth: int, indent: str, in_function: bool) -> list[str]:
    out: list[str] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(7 if depth else 3)
        name = rng.choice("xyz")
        if kind == 0:
            out.append(f"{indent}{name} = {rng.randint(0, 9)}")
        elif kind == 1:
            out.append(f"{indent}print('{name}', {name} if '{name}' in dir() else None)")
        elif kind == 2:
            out.append(f"{indent}print('at', ({rng.randint(0, 9)},\n{indent}       {rng.choice('xyz') if in_function else 1}))")
        elif kind == 3:
            out.append(f"{indent}if {rng.choice(['True', 'False', '0', '1', repr(''), repr('s'), 'None', 'x > 2'])}:")
            out += _block(rng, depth - 1, indent + "    ", in_function)
            for _ in range(rng.randrange(3)):
                out.append(f"{indent}elif {rng.choice(['True', 'False', 'x > 3', '0'])}:")
                out += _block(rng, depth - 1, indent + "    ", in_function)
            if rng.random() < 0.5:
                out.append(f"{indent}else:")
                out += _block(rng, depth - 1, indent + "  ", in_function)
        elif kind == 4:
            out.append(f"{indent}while {rng.choice(['False', '0', 'x > 100'])}:")
            out += _block(rng, depth - 1, indent + "    ", in_function)
        elif kind == 5:
            out.append(f"{indent}for _ in range(2):")
            out += _block(rng, depth - 1, indent + "    ", in_function)
        else:
            out.append(f"{indent}try:")
            out += _block(rng, depth - 1, indent + "    ", in_function)
            out.append(f"{indent}except NameError:\n{indent}    print('unbound')")
    return out


def _run(code: str) -> str:
    return printed([code], {"x": 1, "y": 2, "z": 3}) or ""


def test_random_programs_print_the_same_once_their_constant_branches_go() -> None:
    rng = random.Random(5)
    changed = 0
    for _ in range(1500):
        if rng.random() < 0.5:
            code = "\n".join(_block(rng, 3, "", False))
        else:
            body = _block(rng, 3, "    ", True)
            generator = "def g():\n    yield 1\nprint(list(g()))" if rng.random() < 0.2 else ""
            code = "def f(x=1):\n" + "\n".join(body) + "\n    return (x, y)\nprint(f())\n" + generator
        out = drop_dead_branches(code)
        changed += out != code
        assert _run(out) == _run(code), (code, out)
    assert changed > 700, changed
