"""What a cell's own code says about a call: the ``if`` and the loops around it.

A diagnosis that offers a cause should show its evidence. When ranks differ in how many
collectives a line issued, the cell's code often says why: the call sits under ``if rank == 0:``
(a rank-conditional collective, certain), or inside a loop (a loop of another length per rank, or
a condition inside it — distnb counts calls, not iterations, so that one is a guess and reads as
one). Pure: code and line numbers in, words out.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable

from distnb._text import fit
from distnb.cell_names import cell_name

__all__ = ["Around", "around", "because", "condition_ranks", "loop_span", "may_branch", "other_branches", "rank_names"]

_RANK_NAMES = frozenset({"rank", "local_rank", "get_rank", "group_rank", "get_local_rank", "get_coordinate", "global_rank"})
#: The environment variables torchrun sets per rank: ``int(os.environ["RANK"])`` reads the rank.
_RANK_VARS = {"RANK", "LOCAL_RANK", "GROUP_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"}


def _reads_rank(node: ast.AST, names: frozenset[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names or isinstance(n, ast.Attribute) and n.attr in names
               or isinstance(n, ast.Constant) and n.value in _RANK_VARS for n in ast.walk(node))


_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.Match, ast.Break, ast.Continue, ast.Return, ast.Raise)


def may_branch(code: str, sources: Iterable[str]) -> bool:
    """Whether the notebook's own lines could run differently per rank in this cell: it has a
    statement that chooses lines (an ``if``, a loop, a ``try``, a ``return`` …), or it calls
    something while the session defines a function or class that has one (a model's
    ``forward`` is reached through an instance: which one is not told apart here). Recording
    paths (which lines ran) tells ranks apart only then; a value that differs on one line (``2 if
    rank == 2 else 4``), or a decision inside a library, leaves every rank on the same lines.
    Unparsable code: maybe."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return True
    if any(isinstance(n, _BRANCHES) for n in ast.walk(tree)):
        return True
    if not any(isinstance(n, ast.Call) for n in ast.walk(tree)):
        return False
    for source in sources:
        try:
            defined = ast.parse(source)
        except SyntaxError:
            return True
        for node in ast.walk(defined):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    any(isinstance(n, _BRANCHES) for stmt in node.body for n in ast.walk(stmt)):
                return True
    return False


def rank_names(sources: Iterable[str]) -> frozenset[str]:
    """The names that hold the rank or something made from it in these cells, besides torch's
    own: ``ddp_rank = int(os.environ["RANK"])``, then ``master_process = ddp_rank == 0`` — the
    idiom of most training scripts, whose ``if master_process:`` is as much a condition on the
    rank as ``if rank == 0:``."""
    trees = []
    for code in sources:
        try:
            trees.append(ast.parse(code))
        except SyntaxError:
            continue
    assigns = [(t, n.value) for tree in trees for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    names = _RANK_NAMES
    while True:  # to a fixed point: a name made from a name made from the rank
        more = {n.id for target, value in assigns for n in ast.walk(target) if isinstance(n, ast.Name) and n.id not in names
                and _reads_rank(value, names)}
        if not more:
            return names
        names = names | more


@dataclass
class Around:
    """The compound statements enclosing a line, outermost first: (kind, line, header)."""

    chain: list[tuple[str, int, str]]

    def rank_condition(self) -> tuple[int, str] | None:
        """The innermost ``if`` whose test reads the rank, with its line."""
        for kind, line, header in reversed(self.chain):
            if kind == "if-rank":
                return line, header
        return None

    def loop(self) -> tuple[int, str] | None:
        for kind, line, header in reversed(self.chain):
            if kind == "loop":
                return line, header
        return None


def around(code: str, line: int, names: frozenset[str] = _RANK_NAMES) -> Around | None:
    """The statements around ``line`` of ``code``; None when the code does not parse. An ``if``
    reads the rank when its test reads one of ``names`` (:func:`rank_names` of the session)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    lines = code.splitlines()
    chain: list[tuple[str, int, str]] = []

    def header(node: ast.stmt) -> str:
        text = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
        if isinstance(node, ast.If) and text.startswith(("if ", "elif ")):
            text = f"{text.split(' ', 1)[0]} {ast.unparse(node.test)}:"  # the condition without the line's comment
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            text = f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}:"
        elif isinstance(node, ast.While):
            text = f"while {ast.unparse(node.test)}:"
        return fit(text, 80)

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            end = getattr(node, "end_lineno", node.lineno) or node.lineno
            if not node.lineno <= line <= end:
                continue
            if isinstance(node, ast.If):
                reads_rank = _reads_rank(node.test, names)
                in_else = bool(node.orelse) and node.orelse[0].lineno <= line
                chain.append(("if-rank" if reads_rank else "if", node.lineno, header(node) + (" (its else branch)" if in_else else "")))
                walk(node.orelse if in_else else node.body)
            elif isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
                chain.append(("loop", node.lineno, header(node)))
                walk(node.body + node.orelse)
            elif isinstance(node, (ast.With, ast.AsyncWith, ast.Try)):
                walk([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                      *(s for h in getattr(node, "handlers", []) for s in h.body)])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                chain.append(("def", node.lineno, header(node)))
                walk(node.body)
            return

    walk(tree.body)
    return Around(chain)


def other_branches(code: str | None, a: int, b: int) -> bool:
    """Lines ``a`` and ``b`` of ``code`` lie in the two branches of one ``if`` (one in its body, the
    other in its ``else``/``elif``): a rank reaches one or the other, never both."""
    if not code:
        return False
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False

    def inside(body: list[ast.stmt], line: int) -> bool:
        return any(n.lineno <= line <= (getattr(n, "end_lineno", n.lineno) or n.lineno) for n in body)

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.orelse:
            if inside(node.body, a) and inside(node.orelse, b) or inside(node.body, b) and inside(node.orelse, a):
                return True
    return False


def loop_span(code: str | None, line: int) -> tuple[int, int] | None:
    """The first and last line of the innermost loop around ``line`` of ``code`` (None: in no
    loop, or the code does not parse)."""
    if not code:
        return None
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    best: tuple[int, int] | None = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
            end = getattr(node, "end_lineno", node.lineno) or node.lineno
            if node.lineno <= line <= end and (best is None or node.lineno >= best[0]):
                best = (node.lineno, end)
    return best


_SAFE = (ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Name, ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Load,
         ast.And, ast.Or, ast.Not, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Add, ast.Sub, ast.Mod,
         ast.FloorDiv, ast.Mult)


def condition_ranks(code: str | None, line: int, world: int) -> set[int] | None:
    """The ranks that reach ``line`` by the ``if`` statements around it that read only ``rank``
    and ``world_size`` (``if rank == 0:``, ``if not (rank == 3):``, ``if rank in (1, 2):``, an
    ``else`` branch); None when no such condition encloses it, or one reads anything else (a loop
    variable, a config) — the code then does not say which ranks run the line."""
    if not code:
        return None
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    ranks: set[int] | None = None

    def walk(body: list[ast.stmt]) -> bool:
        nonlocal ranks
        for node in body:
            end = getattr(node, "end_lineno", node.lineno) or node.lineno
            if not node.lineno <= line <= end:
                continue
            if isinstance(node, ast.If):
                in_else = bool(node.orelse) and node.orelse[0].lineno <= line
                names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
                if names & {"rank"}:
                    if not names <= {"rank", "world_size"} or not all(isinstance(n, _SAFE) for n in ast.walk(node.test)):
                        return False
                    expr = compile(ast.Expression(node.test), "<condition>", "eval")
                    taken = {r for r in range(world) if bool(eval(expr, {"__builtins__": {}}, {"rank": r, "world_size": world})) != in_else}
                    ranks = taken if ranks is None else ranks & taken
                return walk(node.orelse if in_else else node.body)
            if isinstance(node, (ast.For, ast.While, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Try)):
                return walk([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                             *(s for h in getattr(node, "handlers", []) for s in h.body)])
            return True
        return True

    return ranks if walk(tree.body) else None


def because(code: str | None, line: int | None, cell: int | None = None) -> str:
    """``under `if rank == 0:` (line 2)`` — the evidence the cell's code gives for a call made on
    some ranks only; ``likely …`` where it only suggests; ``""`` where it says nothing."""
    if not code or not line:
        return ""
    found = around(code, line)
    if found is None:
        return ""
    where = f"{cell_name(cell)} " if cell is not None else ""
    cond = found.rank_condition()
    if cond is not None:
        return f"the call at {where}line {line} is under `{cond[1]}` ({where}line {cond[0]}): a collective only some ranks reach"
    loop = found.loop()
    if loop is not None:
        return (f"the call at {where}line {line} is inside `{loop[1]}` ({where}line {loop[0]}): likely a loop of another length "
                "per rank, or a condition in it that differs per rank (distnb counts calls, not iterations)")
    return ""
