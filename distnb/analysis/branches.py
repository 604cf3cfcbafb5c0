"""Branches the settings decide, written as the branch that runs: a minimal case without the
others.

A pasted training script branches on its settings (``if init_from == 'scratch': … elif
init_from == 'resume': …``, ``if device_type == 'cuda': … else: …``, ``if compile: …``). Once
the settings are written in and folded (analysis/inlining.py), each such test is a constant: the
branch it takes is all that ever runs, and the others hold most of the statements — and the reads
— that a case would otherwise carry. ``if True: A else: B`` is ``A``; ``if False: A elif c: B`` is
``if c: B``; ``if False: A`` and ``while False: A`` are nothing (``pass`` where a block would be
left empty). A branch written on its header's line, or holding a string across lines that moving
it would change, stays."""

from __future__ import annotations

import ast

from distnb.analysis.cell_parts import dedented, first_line, spans_strings
from distnb.analysis.names import bindings

__all__ = ["drop_dead_branches"]

#: Rewrites of one cell, at most: each takes out one branch.
_MOST = 200


def drop_dead_branches(code: str) -> str:
    """``code`` with each ``if`` or ``while`` whose test is a constant written as what runs.
    Raises SyntaxError when ``code`` does not parse."""
    for _ in range(_MOST):
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, (ast.If, ast.While)) and isinstance(node.test, ast.Constant):
                rewritten = _rewrite(code, tree, node)
                if rewritten is not None:
                    code = rewritten
                    break
        else:
            return code
    return code


def _rewrite(code: str, tree: ast.Module, node: ast.If | ast.While) -> str | None:
    lines = code.splitlines()
    head, end = node.lineno, node.end_lineno or node.lineno
    taken = bool(node.test.value)  # type: ignore[attr-defined]
    gone = (node.orelse if taken else node.body) if isinstance(node, ast.If) else ([] if taken else node.body)
    if not _may_drop(tree, node, gone):
        return None
    if isinstance(node, ast.If) and lines[head - 1].lstrip().startswith("elif"):
        return _rewrite_elif(lines, node, taken)
    if isinstance(node, ast.While):
        if taken or node.orelse:
            return None  # `while True:` is the loop itself
        return _replace(lines, head, end, _nothing(tree, node))
    if taken:
        body = node.body
        if body[0].lineno == head or spans_strings(body):
            return None
        return _replace(lines, head, end, dedented(lines, body, body[0].col_offset - node.col_offset))
    if not node.orelse:
        return _replace(lines, head, end, _nothing(tree, node))
    first = node.orelse[0]
    text = lines[first.lineno - 1]
    if isinstance(first, ast.If) and len(node.orelse) == 1 and text.lstrip().startswith("elif"):
        # `elif c:` becomes `if c:` in the `if`'s place, its branches as written.
        indent = text[: len(text) - len(text.lstrip())]
        return _replace(lines, head, end, [indent + text.lstrip()[2:], *lines[first.lineno : first.end_lineno]])
    if text.lstrip().startswith("else") or spans_strings(node.orelse):
        return None  # `else: x = 1`, on its header's line
    return _replace(lines, head, end, dedented(lines, node.orelse, first.col_offset - node.col_offset))


def _rewrite_elif(lines: list[str], node: ast.If, taken: bool) -> str | None:
    """An ``elif`` whose test is a constant, within its chain: ``elif True: B …`` is ``else: B``,
    ``elif False: B`` goes (the next ``elif`` or ``else``, if any, follows the branch before it)."""
    head, end = node.lineno, node.end_lineno or node.lineno
    body_end = max(n.end_lineno or n.lineno for n in node.body)
    if node.body[0].lineno == head:
        return None  # `elif True: x = 1`, on its header's line
    if taken:
        indent = lines[head - 1][: len(lines[head - 1]) - len(lines[head - 1].lstrip())]
        return _replace(lines, head, end, [indent + "else:", *lines[first_line(node.body[0]) - 1 : body_end]])
    return _replace(lines, head, body_end, [])


def _may_drop(tree: ast.Module, node: ast.stmt, gone: list[ast.stmt]) -> bool:
    """Whether the statements ``gone`` can go without changing what a function around ``node`` is:
    a name assigned anywhere in a function is its local (``if False: x = 1`` makes a later read of
    ``x`` an UnboundLocalError, not a global's), ``global`` holds for the whole function, and a
    ``yield`` anywhere makes it a generator. Outside functions, what never runs changes nothing."""
    function = _enclosing_function(tree, node)
    if function is None:
        return True
    removed = [n for stmt in gone for n in ast.walk(stmt)]
    if any(isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await, ast.Global, ast.Nonlocal)) for n in removed):
        return False
    bound_there = set(bindings(ast.Module(body=gone, type_ignores=[])))
    ids = {id(n) for n in removed}
    elsewhere = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)) and id(n) not in ids}
    elsewhere |= {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}  # type: ignore[attr-defined]
    return bound_there <= elsewhere


def _enclosing_function(tree: ast.Module, node: ast.stmt) -> ast.AST | None:
    """The innermost function or lambda whose body holds ``node``."""
    found = None
    for outer in ast.walk(tree):
        if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and outer is not node \
                and any(n is node for n in ast.walk(outer)):
            if found is None or any(n is outer for n in ast.walk(found)):
                found = outer
    return found


def _nothing(tree: ast.Module, node: ast.stmt) -> list[str]:
    """No lines, or ``pass`` where the block holding ``node`` would be left empty."""
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and node in block and len(block) == 1 and not isinstance(parent, ast.Module):
                return [" " * node.col_offset + "pass"]
    return []


def _replace(lines: list[str], head: int, end: int, new: list[str]) -> str:
    return "\n".join([*lines[: head - 1], *new, *lines[end:]])
