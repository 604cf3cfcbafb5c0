"""Constants written into where they are read: a minimal case without its configuration block.

A pasted training script opens with twenty settings (``n_embd = 32``, ``log_interval = 1``), and
a failure that reads a few of them keeps each as a statement of its own: more than the rest of the
case. A name bound exactly once in the whole session, at a cell's top level, to a literal, can be
replaced by that literal wherever it is read, and its assignment dropped, without changing what the
code does. Reading a name through ``globals()``, ``eval`` or a string is not seen here: the
minimizer keeps the inlined case only when a try still fails the same way."""

from __future__ import annotations

import ast
import builtins
import sys
import warnings

from distnb.analysis.branches import drop_dead_branches
from distnb.analysis.names import bindings, parse_cells, read_before_bound

__all__ = ["fold_constants", "inline_constants"]


def _literal(node: ast.expr) -> bool:
    """A number, a string, a bool or None, a signed number, a tuple of them: written back as they were."""
    if isinstance(node, ast.Constant):
        return not isinstance(node.value, bytes) or len(node.value) < 64
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, (int, float, complex))
    if isinstance(node, ast.Tuple):
        return all(_literal(e) for e in node.elts)
    return False


def _in_fstring(tree: ast.AST) -> set[int]:
    """The ids of the Name nodes inside f-strings' expressions."""
    return {id(n) for f in ast.walk(tree) if isinstance(f, ast.JoinedStr) for n in ast.walk(f) if isinstance(n, ast.Name)}


def _has_text(node: ast.expr) -> bool:
    """Before Python 3.12 an f-string's expression may not hold its own quotes or a backslash: a
    string is not written into one."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)) for n in ast.walk(node))


def _offsets(code: str) -> list[int]:
    """Where each line of ``code`` starts, in characters."""
    starts, total = [], 0
    for line in code.splitlines(keepends=True):
        starts.append(total)
        total += len(line)
    return starts


#: Rounds of writing settings in: a setting made of others (``device_type = 'cuda' if 'cuda' in
#: device else 'cpu'``) is a literal once they are written in and folded.
_ROUNDS = 5


def inline_constants(codes: list[str]) -> tuple[list[str], list[str]] | None:
    """The cells with every name bound once, at a top level, to a literal, written in where it is
    read (and its assignment gone), again while that folds another setting to a literal, and the
    names inlined; None when there is none to inline or a cell does not parse."""
    names: set[str] = set()
    for _ in range(_ROUNDS):
        got = _inline_once(codes)
        if got is None or got[0] == codes:
            break
        codes, more = got
        names.update(more)
    return (codes, sorted(names)) if names else None


def _inline_once(codes: list[str]) -> tuple[list[str], list[str]] | None:
    trees = parse_cells(codes)
    if trees is None:
        return None
    counts: dict[str, int] = {}
    for tree in trees:
        for name in bindings(tree):
            counts[name] = counts.get(name, 0) + 1
    constants: dict[str, ast.Assign] = {}
    for tree in trees:
        shared = [n for s in tree.body for n in {s.lineno, s.end_lineno}]  # lines holding more than one statement
        for stmt in tree.body:
            if (shared.count(stmt.lineno) == 1 and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and counts.get(stmt.targets[0].id) == 1 and _literal(stmt.value) and stmt.lineno == stmt.end_lineno):
                constants[stmt.targets[0].id] = stmt
    # A setting named as a builtin (`compile = False`) is written in only where nothing reads the
    # name before the assignment runs: such a read is the builtin's.
    early = read_before_bound(codes, builtins_too=True) if any(hasattr(builtins, name) for name in constants) else set()
    for name in list(constants):
        if hasattr(builtins, name) and (early is None or name in early):
            del constants[name]
    # Before 3.12 a string is not written into an f-string: its reads there stay, and so does its
    # assignment; it is written in everywhere else (`if init_from == 'scratch':` folds, and the
    # f-string in the branch that goes with it takes the last read along: a later round drops it).
    hidden: set[int] = set()
    if sys.version_info < (3, 12):
        in_fstrings = set().union(*(_in_fstring(tree) for tree in trees))
        hidden = {id(node) for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Name) and id(node) in in_fstrings
                  and node.id in constants and _has_text(constants[node.id].value)}
    reads = {name: [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id == name]
             for name in constants}
    kept = {name for name, nodes in reads.items() if any(id(n) in hidden for n in nodes)}  # assigned still
    constants = {name: stmt for name, stmt in constants.items() if name not in kept or any(id(n) not in hidden for n in reads[name])}
    if not constants:
        return None
    out = []
    for code, tree in zip(codes, trees):
        starts = _offsets(code)
        edits: list[tuple[int, int, str]] = []  # (start, end, text) in characters of the cell
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in constants and id(node) not in hidden:
                value = constants[node.id].value
                text = ast.unparse(value)
                if isinstance(value, ast.UnaryOp):
                    text = f"({text})"  # (-1) ** 2 is not -1 ** 2 (a tuple is written with its parentheses)
                edits.append((*_span(code, starts, node), text))
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name) and constants.get(stmt.targets[0].id) is stmt \
                    and stmt.targets[0].id not in kept:
                start = starts[stmt.lineno - 1]
                end = starts[stmt.lineno] if stmt.lineno < len(starts) else len(code)
                edits.append((start, end, ""))
        out.append(_apply(code, edits).rstrip("\n"))
    try:
        # A setting read in `4 * n_embd` or `step % log_every == 0`, and the branches that decides.
        out = [drop_dead_branches(fold_constants(code)) for code in out]
    except SyntaxError:
        return None
    return out, sorted(constants)


_PURE = (ast.Constant, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


def _value(node: ast.expr) -> object:
    """The value of an expression of constants, or ``_VOID`` where it is not one worth writing:
    names, calls, a large power or repetition, an error, a long result."""
    if not all(isinstance(n, _PURE) for n in ast.walk(node)):
        return _VOID
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.Mult, ast.LShift)):
        left, right = _value(node.left), _value(node.right)
        if left is _VOID or right is _VOID or not _small(node.op, left, right):
            return _VOID
    try:
        with warnings.catch_warnings():  # `1 is 1`: Python warns at compile time, as it did when the cell ran
            warnings.simplefilter("ignore")
            value = eval(compile(ast.Expression(body=node), "<fold>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 (constants only)
    except Exception:
        return _VOID
    if not isinstance(value, (bool, int, float, str, type(None))) or len(repr(value)) > 40:
        return _VOID
    return value


_VOID = object()


def _small(op: ast.operator, left: object, right: object) -> bool:
    """A power, shift or repetition whose result stays small (``2 ** 10000``, ``'-' * 10**9`` are not)."""
    def count(v: object) -> bool:
        return isinstance(v, (int, float)) and abs(v) <= 64
    if isinstance(op, ast.Mult):
        texts = [isinstance(v, str) for v in (left, right)]
        return count(right if texts[0] else left) if any(texts) else True
    return count(right)


def fold_constants(code: str) -> str:
    """``code`` with each expression of constants written as its value (``4 * 32`` → ``128``,
    ``0 % 1 == 0`` → ``True``), a conditional expression whose test is one written as its branch,
    and an ``and``/``or`` whose leading operands are constants cut to what they give
    (``True and master`` → ``master``, ``False and master`` → ``False``): what writing settings
    in leaves behind.
    Nothing inside an f-string is touched. Raises SyntaxError when ``code`` does not parse."""
    tree = ast.parse(code)
    starts = _offsets(code)
    edits: list[tuple[int, int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.JoinedStr):
            return
        if isinstance(node, ast.expr) and not isinstance(node, ast.Constant) and (value := _value(node)) is not _VOID:
            edits.append((*_span(code, starts, node), repr(value)))
            return
        if isinstance(node, ast.IfExp) and (test := _value(node.test)) is not _VOID:
            branch = node.body if test else node.orelse  # `nullcontext() if 'cpu' == 'cpu' else autocast(…)`
            text = ast.get_source_segment(code, branch)
            if text is not None:
                edits.append((*_span(code, starts, node), f"({text})" if isinstance(branch, (ast.IfExp, ast.Lambda, ast.NamedExpr)) else text))
                return
        if isinstance(node, ast.BoolOp):
            values = [_value(v) for v in node.values]
            lead = 0
            while lead < len(values) - 1 and values[lead] is not _VOID and bool(values[lead]) == isinstance(node.op, ast.And):
                lead += 1  # True and x is x; False or x is x
            if lead < len(values) - 1 and values[lead] is not _VOID:  # False and x is False; True or x is True: x never runs
                edits.append((*_span(code, starts, node), repr(values[lead])))
                return
            if lead:  # the operands left, as written (what is inside them is not folded too)
                op = " and " if isinstance(node.op, ast.And) else " or "
                weak = (ast.BoolOp, ast.IfExp, ast.Lambda, ast.NamedExpr)  # written in parentheses as operands
                left = [f"({text})" if isinstance(v, weak) else text for v in node.values[lead:]
                        if (text := ast.get_source_segment(code, v)) is not None]
                if len(left) == len(node.values) - lead:
                    edits.append((*_span(code, starts, node), op.join(left)))
                    return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    code = _apply(code, edits)
    ast.parse(code)
    return code


def _apply(code: str, edits: list[tuple[int, int, str]]) -> str:
    """``code`` with each ``(start, end, text)`` written over its span; spans do not overlap."""
    for start, end, text in sorted(edits, reverse=True):
        code = code[:start] + text + code[end:]
    return code


def _span(code: str, starts: list[int], node: ast.expr) -> tuple[int, int]:
    """Where ``node`` is in ``code``, as indices (``starts``: :func:`_offsets`)."""
    return _at(code, starts, node.lineno, node.col_offset), _at(code, starts, node.end_lineno or node.lineno, node.end_col_offset or 0)


def _at(code: str, starts: list[int], line: int, col: int) -> int:
    """A node's position (line, UTF-8 byte column, as ast gives it) as an index into ``code``."""
    text = code[starts[line - 1]:]
    return starts[line - 1] + len(text.encode()[:col].decode(errors="ignore"))
