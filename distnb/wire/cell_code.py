"""A cell's source compiled once, in the notebook, for every rank.

Compiling even ``x = 1`` takes ~50 µs of a rank's CPU on a busy machine (the parser and compiler
are cold between cells), and every rank compiled every cell: at 8 ranks on 2 cores that was an
eighth of a trivial cell's time. The controller compiles the cell anyway (a SyntaxError is raised
there, before anything is sent), so it sends the code objects along, marshalled, and a rank only
loads them. A rank whose Python compiles differently (another version on another machine) finds
a tag that is not its own and compiles the source itself: ``marshal`` is not portable across
versions, and loading it anyway could crash the interpreter.

Semantics are IPython's: the last statement, when it is an expression not ended by ``;``, is
evaluated for the cell's value. Cells are compiled without inheriting this module's ``__future__``
imports, as IPython compiles them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import marshal
import tokenize
from types import CodeType
from typing import Any, NamedTuple

from distnb.wire.protocol import Exec, Msg

__all__ = ["CELL_PREFIX", "RANK_NAMES", "CompiledCell", "cell_filename", "compile_cell", "compile_source", "exec_request", "pack", "renamed", "unpack"]

#: The names every rank's namespace starts with, for the first cell (``%dist_launch`` lists them).
RANK_NAMES = ("torch", "dist", "rank", "local_rank", "world_size", "device")

#: Cells' code objects are named ``<cell-N>``: tracebacks, linecache and the debugger use it.
CELL_PREFIX = "<cell-"

#: Marshalled code is readable only by the interpreter that wrote it (same bytecode magic).
_TAG = b"distnb-code/" + importlib.util.MAGIC_NUMBER
#: Above this many bytes of marshalled code the ranks compile the source themselves: a huge cell
#: is rare, and its code objects would make every rank's EXEC larger than its source.
_PACK_MAX = 1 << 20


def cell_filename(cell_id: int) -> str:
    return f"{CELL_PREFIX}{cell_id}>"


class CompiledCell(NamedTuple):
    """``body`` runs the cell's statements; ``last``, when not None, evaluates its final
    expression (the cell's value)."""

    body: CodeType
    last: CodeType | None


def _ends_with_semicolon(code: str) -> bool:
    """IPython's rule: a cell whose last statement ends in ``;`` shows no value."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(code).readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER,
                                    tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, SyntaxError):
        return False
    return bool(tokens) and tokens[-1].string == ";"


def compile_cell(code: str, filename: str) -> CompiledCell:
    """Compile ``code`` as a cell named ``filename`` (raises SyntaxError as ``compile`` does)."""
    tree = ast.parse(code, filename, "exec")
    last: CodeType | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(code):
        tail = tree.body.pop()
        assert isinstance(tail, ast.Expr)
        last = compile(ast.Expression(tail.value), filename, "eval", dont_inherit=True)
    return CompiledCell(compile(tree, filename, "exec", dont_inherit=True), last)


@functools.lru_cache(maxsize=32)
def compile_source(code: str) -> CompiledCell:
    """``compile_cell`` under a placeholder name (see :func:`renamed`), remembered for the cells
    that are run again and again while a bug is cut down."""
    return compile_cell(code, "<cell>")


def _renamed(code: CodeType, filename: str) -> CodeType:
    """``code`` and the code objects nested in it (functions, classes, lambdas) as if compiled
    under ``filename``: tracebacks and the debugger then name the right cell."""
    consts = tuple(_renamed(c, filename) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def renamed(cell: CompiledCell, filename: str) -> CompiledCell:
    """``cell`` under another name (compiled before its cell number was known)."""
    return CompiledCell(_renamed(cell.body, filename), _renamed(cell.last, filename) if cell.last is not None else None)


def pack(cell: CompiledCell) -> bytes | None:
    """``cell`` for the wire, tagged with this interpreter's bytecode magic; None when too large."""
    blob = _TAG + marshal.dumps((cell.body, cell.last))
    return blob if len(blob) <= _PACK_MAX else None


def unpack(blob: bytes | None) -> CompiledCell | None:
    """The code objects in ``blob``; None when absent or written by another interpreter (the rank
    then compiles the source)."""
    if not blob or not blob.startswith(_TAG):
        return None
    try:
        body, last = marshal.loads(memoryview(blob)[len(_TAG):])
    except (ValueError, EOFError, TypeError):
        return None
    if not isinstance(body, CodeType) or not (last is None or isinstance(last, CodeType)):
        return None
    return CompiledCell(body, last)


def exec_request(cell: int, code: str, compiled: CompiledCell | None, flags: dict[str, Any]) -> Exec:
    """The EXEC that runs ``code`` as cell number ``cell``, with its code objects when they fit."""
    msg = Exec(t=Msg.EXEC, cell=cell, code=code)
    msg.update({k: v for k, v in flags.items() if v})  # type: ignore[typeddict-item]
    if compiled is not None and (blob := pack(renamed(compiled, cell_filename(cell)))) is not None:
        msg["compiled"] = blob
    return msg
