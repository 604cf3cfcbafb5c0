"""Which names a cell's code binds and reads, over every scope: what the minimizer asks of a
candidate before it spends a try on it, and what inlining asks of a setting."""

from __future__ import annotations

import ast
import builtins

__all__ = ["bindings", "imported", "parse_cells", "read_before_bound", "unbound_reads"]


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The names an import binds: ``import os.path`` binds ``os``, ``import numpy as np`` ``np``."""
    return [(a.asname or a.name).split(".")[0] for a in node.names]


def bindings(tree: ast.AST) -> list[str]:
    """Every name ``tree`` binds anywhere (assignments, loops, imports, parameters, definitions,
    ``with … as``, ``except … as``, ``global``/``nonlocal``, a walrus, a match's capture)."""
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.append(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, ast.arg):
            out.append(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.extend(imported(node))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.append(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out.extend(node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            out.append(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            out.append(node.rest)
    return out


def unbound_reads(codes: list[str]) -> set[str] | None:
    """The names the cells read that nothing in them binds, in any scope, and that are not
    builtins: each is a NameError where it is reached, unless the namespace the cells run in
    provides it (the pool's ``rank``, ``dist``; a name pushed with ``%dist_push``). None when a
    cell does not parse."""
    trees = parse_cells(codes)
    return None if trees is None else _unbound(trees)


def parse_cells(codes: list[str]) -> list[ast.Module] | None:
    """Each cell's tree; None when one does not parse."""
    try:
        return [ast.parse(code) for code in codes]
    except SyntaxError:
        return None


def _unbound(trees: list[ast.Module]) -> set[str]:
    bound = {name for tree in trees for name in bindings(tree)}
    read = {n.id for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return {name for name in read - bound if not hasattr(builtins, name)}


class _Flow(ast.NodeVisitor):
    """The cells' module-level code in the order it runs (a loop's body once, both branches of an
    ``if``): each name read before anything bound it. Function and class bodies run later, when
    called; only their defaults and decorators are read where they stand."""

    def __init__(self, builtins_too: bool = False) -> None:
        self.bound: set[str] = set()
        self.early: set[str] = set()
        self.builtins_too = builtins_too

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.bound and (self.builtins_too or not hasattr(builtins, node.id)):
                self.early.add(node.id)
        else:
            self.bound.add(node.id)

    def _defined(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda) -> None:
        if isinstance(node, ast.ClassDef):
            for part in [*node.decorator_list, *node.bases, *node.keywords]:
                self.visit(part)
        else:
            for part in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None),
                         *getattr(node, "decorator_list", [])]:
                self.visit(part)
        if not isinstance(node, ast.Lambda):
            self.bound.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = _defined

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self.visit(ast.Name(node.target.id, ast.Load()))  # ``n += 1`` reads n
        self.visit(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for stmt in [*node.body, *node.orelse]:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        self.visit(node.generators[0].iter)  # evaluated where the comprehension stands
        before = set(self.bound)
        targets = {n.id for gen in node.generators for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
        self.bound |= targets
        for gen in node.generators:
            for part in [*([gen.iter] if gen is not node.generators[0] else []), *gen.ifs]:
                self.visit(part)
        for part in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
            self.visit(part)
        self.bound = (self.bound - targets) | before  # its targets stay inside it (a walrus's name leaks out)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.bound.update(imported(node))

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bound.add(node.name)
        for stmt in node.body:
            self.visit(stmt)

    def visit_Match(self, node: ast.Match) -> None:
        self.bound.update(bindings(node))  # a match's captures: bound before its cases are read
        self.generic_visit(node)


def read_before_bound(codes: list[str], builtins_too: bool = False) -> set[str] | None:
    """The names the cells' module-level code reads before anything bound them, in the order the
    cells run (a loop's body read once through: ``dt = time() - t0`` before ``t0 = time()`` in
    the same loop is a read before), with the names read in function bodies that nothing binds
    anywhere (:func:`unbound_reads`). Each is a NameError where it is reached, unless the
    namespace the cells run in provides it. ``builtins_too``: a builtin's name read before the
    cells bind it too (there it is the builtin). None when a cell does not parse."""
    trees = parse_cells(codes)
    if trees is None:
        return None
    flow = _Flow(builtins_too)
    for tree in trees:
        flow.visit(tree)
    return _unbound(trees) | flow.early
