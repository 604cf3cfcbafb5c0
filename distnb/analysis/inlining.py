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

from distnb.analysis.names import bindings

__all__ = ["inline_constants"]


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


def inline_constants(codes: list[str]) -> tuple[list[str], list[str]] | None:
    """The cells with every name bound once, at a top level, to a literal, written in where it is
    read (and its assignment gone), and the names inlined; None when there is none to inline or a
    cell does not parse."""
    try:
        trees = [ast.parse(code) for code in codes]
    except SyntaxError:
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
    # A string read inside an f-string before 3.12, or a name that shadows a builtin, stays.
    for tree in trees:
        hidden = _in_fstring(tree) if sys.version_info < (3, 12) else set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) in hidden
                    and node.id in constants and _has_text(constants[node.id].value)):
                del constants[node.id]
    for name in list(constants):
        if hasattr(builtins, name):
            del constants[name]
    if not constants:
        return None
    out = []
    for code, tree in zip(codes, trees):
        starts = _offsets(code)
        edits: list[tuple[int, int, str]] = []  # (start, end, text) in characters of the cell
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in constants:
                value = constants[node.id].value
                text = ast.unparse(value)
                if isinstance(value, ast.UnaryOp):
                    text = f"({text})"  # (-1) ** 2 is not -1 ** 2 (a tuple is written with its parentheses)
                edits.append((_at(code, starts, node.lineno, node.col_offset),
                              _at(code, starts, node.end_lineno or node.lineno, node.end_col_offset or 0), text))
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name) and constants.get(stmt.targets[0].id) is stmt:
                start = starts[stmt.lineno - 1]
                end = starts[stmt.lineno] if stmt.lineno < len(starts) else len(code)
                edits.append((start, end, ""))
        for start, end, text in sorted(edits, reverse=True):
            code = code[:start] + text + code[end:]
        out.append(code.rstrip("\n"))
    try:
        for code in out:
            ast.parse(code)
    except SyntaxError:
        return None
    return out, sorted(constants)


def _at(code: str, starts: list[int], line: int, col: int) -> int:
    """A node's position (line, UTF-8 byte column, as ast gives it) as an index into ``code``."""
    text = code[starts[line - 1]:]
    return starts[line - 1] + len(text.encode()[:col].decode(errors="ignore"))
