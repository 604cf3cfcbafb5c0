"""A cell's parts, as the minimizer cuts them: its top-level statements with their source as
written, and the bodies of its functions and blocks (loops, ``with``, an ``if``'s first branch),
nested ones too. One reader, so that the slice (analysis/slicing.py) and the minimizer's cuts
(services/cases/minimize.py) count the same statements."""

from __future__ import annotations

import ast

__all__ = ["first_line", "function_bodies", "replace_body", "statements", "top_level"]


def first_line(node: ast.stmt) -> int:
    """Where a statement starts as written: a decorated function's or class's first decorator
    (``ast`` puts its ``lineno`` at the ``def``, and a cut that keeps that line loses
    ``@torch.no_grad()`` or ``@torch.compile``)."""
    decorators: list[ast.expr] = getattr(node, "decorator_list", None) or []
    return min([node.lineno, *(d.lineno for d in decorators)])


def _source(code: str, lines: list[str], node: ast.stmt) -> str:
    """A top-level statement's source as written, padded to its column, decorators included."""
    if first_line(node) < node.lineno:
        return "\n".join(lines[first_line(node) - 1 : node.end_lineno or node.lineno])
    text = ast.get_source_segment(code, node, padded=True)
    return text if text is not None else ast.unparse(node)


def top_level(code: str) -> list[tuple[ast.stmt, str]] | None:
    """A cell's top-level statements with their source as written (comments between them
    dropped); None when it does not parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    lines = code.splitlines()
    return [(node, _source(code, lines, node)) for node in tree.body]


def statements(code: str) -> list[str]:
    """A cell's top-level statements as source (comments between them dropped); the whole cell as
    one when it does not parse."""
    parsed = top_level(code)
    return [code] if parsed is None else [text for _, text in parsed]


_Block = ast.FunctionDef | ast.AsyncFunctionDef | ast.For | ast.AsyncFor | ast.While | ast.With | ast.AsyncWith | ast.If


def _blocks(code: str) -> list[_Block]:
    """The cell's functions and blocks (a loop, a ``with``, an ``if``'s first branch) whose body
    can be cut apart, outermost first, nested ones too: a training loop's body holds most of what
    a failure in it does not need (the schedule, the clipping, the logging), and the gradient
    accumulation loop inside it more."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    # A block written on one line (``def f(): return 1``) has no body to cut apart.
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.If)
    return [n for n in ast.walk(tree) if isinstance(n, kinds) and first_line(n.body[0]) > n.lineno]


def _block_name(node: _Block, code: str) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{node.name}()"
    return f"`{code.splitlines()[node.lineno - 1].strip()}`"


def function_bodies(code: str) -> list[tuple[str, list[str]]]:
    """Each function or block the cell has (:func:`_blocks`): its name (``step()``, or its first line in
    backticks) and its body's statements as source (indented as written)."""
    lines = code.splitlines()
    return [(_block_name(fn, code), ["\n".join(lines[first_line(node) - 1 : node.end_lineno or node.lineno]) for node in fn.body])
            for fn in _blocks(code)]


def replace_body(code: str, k: int, body: list[str]) -> str:
    """The cell with the body of its ``k``-th function or block (:func:`_blocks`) made of ``body`` (``pass``
    when empty: the function stays callable, the loop runs). What follows the body (an ``else``
    branch, the statements after) stays as written."""
    fn = _blocks(code)[k]
    lines = code.splitlines()
    head = lines[: first_line(fn.body[0]) - 1]
    tail = lines[(fn.body[-1].end_lineno or fn.body[-1].lineno):]
    indent = " " * fn.body[0].col_offset
    return "\n".join([*head, *(body or [indent + "pass"]), *tail])
