"""What a failure needs of the cells, read from their code (analysis/slicing.py), and the
minimizer trying that slice first: on sessions shaped like the gallery's, the slice is the case's
statements or a few more, so the tries after it are few; where the code hides what the failure
needs (a file one cell writes and another reads), the slice fails alone and the tries cut as before."""

from __future__ import annotations

import random

from test_ddmin import _Ranks, session

from distnb.analysis.cell_parts import statements
from distnb.analysis.slicing import read_statements, slice_cells
from distnb.services.cases.minimize import Runs, minimize

NOISE = [
    "import math\nlr = 0.1\nsteps = 3",
    "def helper(v):\n    return v * 2\nmodel = torch.nn.Linear(4, 4)",
    "print('setup done on rank', rank)\nwarm = helper(torch.ones(2))",
]


def _kept(cells: list[str], lines: set[int]) -> list[list[str]]:
    kept = slice_cells(cells, lines)
    assert kept is not None
    return [[statements(code)[i] for i in keep] for code, keep in zip(cells, kept)]


def test_a_raise_needs_the_names_its_line_reads_back_to_where_they_were_set() -> None:
    failing = ("note = math.sqrt(4)\nbatch = [{'label': 3}, {}, {'label': 1}][rank]\nscaled = helper(lr)\n"
               "loss = torch.tensor(float(batch['label']))\ndist.all_reduce(loss)")
    assert _kept([*NOISE, failing], {4}) == [[], [], [], [
        "batch = [{'label': 3}, {}, {'label': 1}][rank]", "loss = torch.tensor(float(batch['label']))", "dist.all_reduce(loss)"]]


def test_a_collective_under_an_if_keeps_the_if_what_it_reads_and_the_imports_they_need() -> None:
    cells = [*NOISE, "import os, tempfile\nckpt_path = os.path.join(tempfile.mkdtemp(), f'ckpt{rank}.pt')",
             "state = {'step': 100}\nextra = model(torch.ones(4)).sum()\nif rank == 0:\n    torch.save(state, ckpt_path)\n"
             "    dist.barrier()\ndone = True"]
    assert _kept(cells, {5}) == [[], [], [], ["import os, tempfile", "ckpt_path = os.path.join(tempfile.mkdtemp(), f'ckpt{rank}.pt')"],
                                 ["state = {'step': 100}", "if rank == 0:\n    torch.save(state, ckpt_path)\n    dist.barrier()"]]


def test_every_call_into_torch_distributed_stays_and_a_function_that_makes_one() -> None:
    cells = ["from torch.distributed.device_mesh import init_device_mesh\nmesh = init_device_mesh('cpu', (2, 2))",
             "def sync(t):\n    dist.all_reduce(t)\nunused = 1",
             "x = torch.ones(2)\nsync(x)\ny = 3\nraise ValueError(y)"]
    kept = _kept(cells, {4})
    assert kept == [["from torch.distributed.device_mesh import init_device_mesh", "mesh = init_device_mesh('cpu', (2, 2))"],
                    ["def sync(t):\n    dist.all_reduce(t)"], ["x = torch.ones(2)", "sync(x)", "y = 3", "raise ValueError(y)"]], kept


def test_an_import_from_torch_distributed_stays_only_where_its_names_are_read() -> None:
    """A pasted script's ``from torch.distributed import init_process_group, destroy_process_group``
    calls nothing: once the set-up that called them is cut, it goes too (it was kept as a call)."""
    cells = ["from torch.distributed import init_process_group, destroy_process_group\nfrom torch.distributed import all_reduce",
             "def helper():\n    from torch.distributed import barrier\n    barrier()\nt = torch.ones(1)\nhelper()\nall_reduce(t)\nraise ValueError(t)"]
    kept = _kept(cells, {7})
    assert kept == [["from torch.distributed import all_reduce"],  # the set-up's import gone, the collective's kept
                    ["def helper():\n    from torch.distributed import barrier\n    barrier()", "t = torch.ones(1)", "helper()",
                     "all_reduce(t)", "raise ValueError(t)"]], kept


def test_a_call_changes_what_it_is_given_and_the_object_whose_method_it_calls() -> None:
    (s,) = read_statements(["opt.step(grads, lr=rate)"])[0]  # type: ignore[index]
    assert {"opt", "grads", "rate"} <= s.sets and {"opt", "grads", "rate"} <= s.reads
    (t,) = read_statements(["cfg.batch[rank] = 4"])[0]  # type: ignore[index]
    assert "cfg" in t.sets and "rank" in t.reads


def test_a_counter_a_kept_loop_steps_and_state_the_process_shares_stay() -> None:
    cells = ["import os, random\nsteps = 0\nunused = 1\nrandom.seed(rank)\ntorch.manual_seed(7)\nos.environ['FLAG'] = '1'\n"
             "torch.backends.cudnn.benchmark = False",
             "while steps < 3:\n    dist.barrier()\n    steps += 1\nraise ValueError(os.environ['FLAG'])"]
    assert _kept(cells, {4}) == [["import os, random", "steps = 0", "random.seed(rank)", "torch.manual_seed(7)",
                                  "os.environ['FLAG'] = '1'", "torch.backends.cudnn.benchmark = False"],
                                 ["while steps < 3:\n    dist.barrier()\n    steps += 1", "raise ValueError(os.environ['FLAG'])"]]


def test_unknown_lines_keep_the_whole_last_cell_and_code_that_does_not_parse_is_not_sliced() -> None:
    assert _kept(["a = 1\nb = 2", "c = a\nd = 4"], set()) == [["a = 1"], ["c = a", "d = 4"]]
    assert slice_cells(["a = (", "b = 1"], {1}) is None


class _Counting(_Ranks):
    """Records each try's cells (a try starts with a restart): none may be run twice."""

    def __init__(self) -> None:
        super().__init__()
        self.tries: list[tuple[str, ...]] = []

    def restart(self) -> None:
        super().restart()
        self.tries.append(())

    def run(self, code: str, ranks: list[int], limit: float):  # type: ignore[no-untyped-def]
        if self.tries:
            self.tries[-1] += (code,)
        return super().run(code, ranks, limit)


def test_the_minimizer_tries_the_slice_first_and_never_the_same_case_twice() -> None:
    ranks = _Counting()
    cells = [*(f"noise{i} = {i}\nmore{i} = noise{i} + 1" for i in range(6)),
             "label = [3, None][rank]\nspare = 1",
             "a = 1\nloss = float(label) * 2\nb = 2"]
    history = session(ranks, cells)
    history[-1].results[1].error["line"] = 2  # type: ignore[index]  # where rank 1 raised, as a real rank says
    ranks.tries.clear()
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert [c.code for c in found.cells] == ["label = [3, None][rank]", "loss = float(label) * 2"], found.code()
    assert "kept the 2 of 17 statements the failing line needs" in found.text(), found.text()
    assert len(ranks.tries) == len(set(ranks.tries)) == found.tries, ranks.tries
    assert found.tries <= 4, found.text()  # the slice, then each of its parts without the others


def test_a_failure_the_names_do_not_show_falls_back_to_the_tries() -> None:
    ranks = _Ranks()
    cells = ["import os, tempfile\nroot = tempfile.mkdtemp()", "open(os.path.join(root, 'flag'), 'w').write(str(rank))",
             "unrelated = 5", "if rank == 1 and os.listdir(root):\n    raise ValueError('flag seen')"]
    history = session(ranks, cells)
    history[-1].results[1].error["line"] = 2  # type: ignore[index]
    found = minimize(Runs(ranks.restart, ranks.run, ranks.stop), history, budget=60)
    assert "did not fail alone: cut by trying" in found.text(), found.text()
    assert "unrelated" not in found.code() and "write(str(rank))" in found.code(), found.code()


def _program(rng: random.Random) -> tuple[list[str], int]:
    """A random session over six lists: assignments from others, aliases (``b = a``, then a change
    through one seen in the other), changes by method, by a helper given the list, by item; prints;
    then a last cell that raises with the values it reads. The line of the raise."""
    v = [f"v{i}" for i in range(6)]

    def stmt() -> str:
        a, b = rng.sample(v, 2)
        return rng.choice([
            f"{a} = [x + {rng.randint(1, 9)} for x in {b}]", f"{a} = {b}", f"{a}.append(len({b}))", f"grow({a}, {b})",
            f"{a}[0] = {b}[-1]", f"print({a}, {b})", f"{a} += [{rng.randint(1, 9)}]", f"unused = sorted({a})",
            f"for item in {b}[:3]:\n    {a}.append(item % 3)", f"{a} = {b}[:]", f"box = [{a}]\nbox[0].append({rng.randint(1, 9)})",
            # helpers that change what is outside them, or only their own names; methods that only read
            "bump()", f"bump_via({a})", "shadow()", "reset()", f"n = {a}.count(1) + {b}.index({b}[0])",
            f"ps = list({a}.keys()) if isinstance({a}, dict) else {a}.copy()",
        ])

    helpers = ("def grow(a, b):\n    a.extend(b[:2])\ndef bump():\n    v0.append(7)\ndef bump_via(x):\n    bump()\n    x.append(1)\n"
               "def shadow():\n    v1 = [9]\n    v1.append(1)\n    return v1\ndef reset():\n    global v2\n    v2 = [5, len(v3)]\n")
    cells = [helpers + "\n".join(f"{name} = [{i}]" for i, name in enumerate(v))]
    cells += ["\n".join(stmt() for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(2, 6))]
    read = rng.sample(v, rng.randint(1, 3))
    last = "\n".join(stmt() for _ in range(rng.randint(0, 3)))
    cells.append((last + "\n" if last else "") + f"raise ValueError(repr(({', '.join(read)},)))")
    return cells, len(cells[-1].splitlines())


def _raised(cells: list[str]) -> str:
    ns: dict[str, object] = {"print": lambda *a: None}
    try:
        for code in cells:
            exec(code, ns)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_slice_of_random_sessions_raises_what_the_session_raised() -> None:
    """Sound on programs it was not written for: the statements kept give the failing line the
    values it had in the whole session, aliases and changes through helpers included."""
    rng = random.Random(5)
    smaller = 0
    for _ in range(400):
        cells, line = _program(rng)
        kept = slice_cells(cells, {line})
        assert kept is not None
        sliced = ["\n".join(statements(code)[i] for i in keep) for code, keep in zip(cells, kept)]
        assert _raised(sliced) == _raised(cells), (cells, sliced)
        smaller += sum(map(len, kept)) < sum(len(statements(c)) for c in cells)
    assert smaller > 200, smaller  # and it cuts: a slice of everything would pass the check above
