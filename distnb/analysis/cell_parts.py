"""A cell's parts, as the minimizer cuts them: its top-level statements with their source as
written, and the bodies of its functions and blocks (loops, ``with``, an ``if``'s first branch and
its ``else:``), nested ones too. One reader, so that the slice (analysis/slicing.py) and the minimizer's cuts
(services/cases/minimize.py) count the same statements."""

from __future__ import annotations

import ast

__all__ = ["dedented", "first_line", "function_bodies", "replace_body", "spans_strings", "statements", "top_level"]


def first_line(node: ast.stmt) -> int:
    """Where a statement starts as written: a decorated function's or class's first decorator
    (``ast`` puts its ``lineno`` at the ``def``, and a cut that keeps that line loses
    ``@torch.no_grad()`` or ``@torch.compile``)."""
    decorators: list[ast.expr] = getattr(node, "decorator_list", None) or []
    return min([node.lineno, *(d.lineno for d in decorators)])


def dedented(lines: list[str], block: list[ast.stmt], shift: int) -> list[str]:
    """The lines of ``block`` (a decorated definition from its first decorator), ``shift`` columns
    to the left where they have that much indentation (a continuation line inside brackets may not):
    a block written in its header's place."""
    out = lines[first_line(block[0]) - 1 : block[-1].end_lineno]
    return [line[min(shift, len(line) - len(line.lstrip(" "))):] for line in out]


def spans_strings(nodes: list[ast.stmt]) -> bool:
    """Whether a string in ``nodes`` spans lines: dedenting its lines would change it."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)) and n.lineno != n.end_lineno
               for stmt in nodes for n in ast.walk(stmt))


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
_KINDS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.If)


def _else(node: ast.If, lines: list[str]) -> bool:
    """Whether an ``if`` has an ``else:`` of its own (an ``elif`` is an ``if`` of the chain, cut as one)."""
    if not node.orelse:
        return False
    first = node.orelse[0]
    return not (isinstance(first, ast.If) and lines[first.lineno - 1].lstrip().startswith("elif"))


def _blocks(code: str) -> list[tuple[_Block, list[ast.stmt], str]]:
    """The cell's functions and blocks whose body can be cut apart — a loop, a ``with``, an ``if``'s
    first branch and its ``else:`` — outermost first, nested ones too, each with its statements and
    name: a training loop's body holds most of what a failure in it does not need (the schedule,
    the clipping, the logging), and the gradient accumulation loop inside it more; a pasted
    script's ``if ddp: … else: …`` keeps a branch the ranks never run."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    lines = code.splitlines()
    out: list[tuple[_Block, list[ast.stmt], str]] = []
    for n in ast.walk(tree):
        # A block written on one line (``def f(): return 1``) has no body to cut apart.
        if isinstance(n, _KINDS) and first_line(n.body[0]) > n.lineno:
            out.append((n, n.body, _block_name(n, lines)))
            if isinstance(n, ast.If) and _else(n, lines) and not lines[n.orelse[0].lineno - 1][: n.orelse[0].col_offset].strip():
                out.append((n, n.orelse, f"the `else:` of {_block_name(n, lines)}"))
    return out


def _block_name(node: _Block, lines: list[str]) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{node.name}()"
    return f"`{lines[node.lineno - 1].strip()}`"


def function_bodies(code: str) -> list[tuple[str, list[str]]]:
    """Each function or block the cell has (:func:`_blocks`): its name (``step()``, or its first line in
    backticks) and its body's statements as source (indented as written)."""
    lines = code.splitlines()
    return [(name, ["\n".join(lines[first_line(node) - 1 : node.end_lineno or node.lineno]) for node in body])
            for _, body, name in _blocks(code)]


def replace_body(code: str, k: int, body: list[str]) -> str:
    """The cell with the body of its ``k``-th function or block (:func:`_blocks`) made of ``body`` (``pass``
    when empty: the function stays callable, the loop runs). What follows the body (an ``else``
    branch, the statements after) stays as written."""
    _, old, _ = _blocks(code)[k]
    lines = code.splitlines()
    head = lines[: first_line(old[0]) - 1]
    tail = lines[(old[-1].end_lineno or old[-1].lineno):]
    indent = " " * old[0].col_offset
    return "\n".join([*head, *(body or [indent + "pass"]), *tail])
