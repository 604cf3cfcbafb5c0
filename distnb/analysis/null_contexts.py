"""A ``with`` over a context that does nothing, written as its body: a minimal case without it.

A pasted training script picks its autocast context once (``ctx = nullcontext() if device_type ==
'cpu' else torch.amp.autocast(…)``) and enters it around every forward. On a CPU case, with its
settings written in (analysis/inlining.py), ``ctx`` is ``nullcontext()``: its ``with`` blocks, its
assignment and its import are three statements that change nothing. ``contextlib.nullcontext()``
entered with no ``as`` does nothing on entry or exit and swallows no exception, so its body alone
runs the same. A name is written out only when it is bound once in the whole session, to
``nullcontext()`` with no argument, and every read of it is such a ``with``: anything else
(passed to a function, entered ``as c``) keeps it."""

from __future__ import annotations

import ast

from distnb.analysis.cell_parts import dedented, first_line, spans_strings
from distnb.analysis.names import bindings, parse_cells

__all__ = ["unwrap_null_contexts"]

#: Rewrites of one case, at most: each takes one ``with`` out (nested ones come out one by one).
_MOST = 100


def unwrap_null_contexts(codes: list[str]) -> tuple[list[str], int] | None:
    """The cells with each ``with`` over a null context written as its body (dedented), the names
    bound to one and their imports gone once nothing reads them, and how many ``with`` blocks went;
    None when there is none, or a cell does not parse."""
    codes = list(codes)
    count = 0
    while count < _MOST:
        trees = parse_cells(codes)
        if trees is None:
            return None
        found = _first_null_with(trees)
        if found is None:
            break
        cell, node = found
        codes[cell] = _unwrapped(codes[cell], node)
        count += 1
    if not count:
        return None
    trees = parse_cells(codes)
    return None if trees is None else (_without_unread(codes, trees), count)


class _Nulls:
    """What means ``contextlib.nullcontext`` in these cells, and the names bound once to a call of it."""

    def __init__(self, trees: list[ast.Module]) -> None:
        counts: dict[str, int] = {}
        for tree in trees:
            for name in bindings(tree):
                counts[name] = counts.get(name, 0) + 1
        once = {name for name, n in counts.items() if n == 1}
        self.functions: set[str] = set()  # from contextlib import nullcontext [as X]
        self.modules: set[str] = set()  # import contextlib [as C]
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "contextlib" and not node.level:
                    self.functions |= {a.asname or a.name for a in node.names if a.name == "nullcontext"} & once
                elif isinstance(node, ast.Import):
                    self.modules |= {a.asname or a.name for a in node.names if a.name == "contextlib"} & once
        self.names: set[str] = set()
        for tree in trees:
            for stmt in tree.body:
                if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(target := stmt.targets[0], ast.Name)
                        and target.id in once and self.call(stmt.value)):
                    self.names.add(target.id)

    def call(self, node: ast.expr) -> bool:
        """``nullcontext()``, with no argument (its argument is what ``as`` binds)."""
        if not isinstance(node, ast.Call) or node.args or node.keywords:
            return False
        func = node.func
        if isinstance(func, ast.Name):
            return func.id in self.functions
        return isinstance(func, ast.Attribute) and func.attr == "nullcontext" and isinstance(func.value, ast.Name) \
            and func.value.id in self.modules

    def null(self, node: ast.expr) -> bool:
        return self.call(node) or isinstance(node, ast.Name) and node.id in self.names


def _plain_with(node: ast.With, nulls: _Nulls) -> bool:
    """A ``with`` of one null context, no ``as``, its body on lines of its own, no string in it
    spanning lines (dedenting would change the string)."""
    return (len(node.items) == 1 and node.items[0].optional_vars is None
            and nulls.null(node.items[0].context_expr) and first_line(node.body[0]) > node.lineno
            and not spans_strings([node]))


def _first_null_with(trees: list[ast.Module]) -> tuple[int, ast.With] | None:
    nulls = _Nulls(trees)
    withs = {id(w.items[0].context_expr): (c, w) for c, tree in enumerate(trees) for w in ast.walk(tree)
             if isinstance(w, ast.With) and _plain_with(w, nulls)}
    # A null name read anywhere but as such a with's context keeps all of its withs.
    kept = {n.id for tree in trees for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in nulls.names and id(n) not in withs}
    for cell, node in withs.values():
        context = node.items[0].context_expr
        if not (isinstance(context, ast.Name) and context.id in kept):
            return cell, node
    return None


def _unwrapped(code: str, node: ast.With) -> str:
    """``code`` with the ``with`` at ``node`` replaced by its body, dedented to the ``with``'s column."""
    lines = code.splitlines()
    body = dedented(lines, node.body, node.body[0].col_offset - node.col_offset)
    return "\n".join([*lines[: node.lineno - 1], *body, *lines[node.end_lineno or node.lineno :]])


def _without_unread(codes: list[str], trees: list[ast.Module]) -> list[str]:
    """The cells without the assignments of null names that nothing reads any more and the imports
    of ``nullcontext`` that only those read (each alone on its line; other names an import binds stay)."""
    nulls = _Nulls(trees)

    def loads(nodes: list[ast.stmt]) -> set[str]:
        return {n.id for s in nodes for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}

    alone: list[list[ast.stmt]] = []  # statements alone on their one line: `a = 1; ctx = nullcontext()` is left as written
    for tree in trees:
        ends = [n for t in tree.body for n in {t.lineno, t.end_lineno}]
        alone.append([s for s in tree.body if s.lineno == s.end_lineno and ends.count(s.lineno) == 1])
    read = loads([s for tree in trees for s in tree.body])
    gone: list[list[ast.stmt]] = [[s for s in stmts if isinstance(s, ast.Assign) and isinstance(t := s.targets[0], ast.Name)
                                   and t.id in nulls.names and t.id not in read] for stmts in alone]
    read = loads([s for tree, out in zip(trees, gone) for s in tree.body if s not in out])
    out: list[str] = []
    for code, stmts, dropped in zip(codes, alone, gone):
        lines: list[str | None] = list(code.splitlines())
        for stmt in dropped:
            lines[stmt.lineno - 1] = None
        for stmt in stmts:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "contextlib" and not stmt.level:
                keep = [a for a in stmt.names if not (a.name == "nullcontext" and (a.asname or a.name) not in read)]
                if len(keep) < len(stmt.names):
                    text = ast.unparse(ast.ImportFrom(module="contextlib", names=keep, level=0))
                    lines[stmt.lineno - 1] = " " * stmt.col_offset + text if keep else None
        out.append("\n".join(line for line in lines if line is not None))
    return out
