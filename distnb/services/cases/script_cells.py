"""A training script cut into notebook cells around one line of it: the call where the job failed
or hung gets a cell of its own (``%dist_reproduce``, services/cases/reproduce.py).

Cells are the script's top-level statements, kept in order with the comments between them. Two
rewrites bring a line buried in the usual structure up to the top level, where a cell can hold it:
the ``if __name__ == "__main__":`` block is unwrapped, and a function holding the line, called
once at the top level as a statement of its own (``main()``, ``train(args)``), is inlined there:
its parameters become assignments and its body top-level statements. A function that returns a
value, yields, or is called from an expression stays whole; then the cell that calls it holds the
failure, and the plan says so. A line inside a loop or ``with`` block at the top level leaves the
whole statement as its cell (a cell cannot stop mid-loop).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

__all__ = ["ScriptCells", "split_script"]

#: How many calls deep the line may be inlined from (main() → train() → step()).
MAX_INLINE = 4


@dataclass(frozen=True)
class ScriptCells:
    """The script as cells; ``failing`` indexes the cell holding the line (None: no line given,
    or not in the script); ``notes`` say what was rewritten and where the cut could not go."""

    cells: list[str]
    failing: int | None
    notes: list[str] = field(default_factory=list)

    def before(self) -> list[str]:
        """The cells up to and including the failing one (all of them without one)."""
        return self.cells if self.failing is None else self.cells[: self.failing + 1]

    def after(self) -> list[str]:
        return [] if self.failing is None else self.cells[self.failing + 1 :]


@dataclass
class _Chunk:
    """A top-level statement (or run of statements on shared lines) and its source text."""

    first: int  # the first original line it covers (decorators, leading comments)
    last: int
    text: str
    kind: str  # import · def · code
    holds: bool = False  # holds the failing line
    statement: str = ""  # the holding statement's keyword when it is compound (for, while, with …)


def _main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _contains(node: ast.stmt, line: int) -> bool:
    start: int = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return start <= line <= (node.end_lineno or node.lineno)


def _inlinable(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Why ``fn``'s body cannot stand at the top level (empty: it can)."""
    if isinstance(fn, ast.AsyncFunctionDef):
        return "it is async"
    a = fn.args
    if a.vararg or a.kwarg or a.posonlyargs:
        return "it takes *args, **kwargs or positional-only parameters"

    def walk(nodes: list[ast.stmt]) -> str:
        for node in nodes:
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    continue  # their returns are their own (ast.walk still enters them: checked below)
                if isinstance(sub, ast.Return) and _outside_nested(node, sub):
                    return "it returns from inside its body"
                if isinstance(sub, (ast.Yield, ast.YieldFrom)) and _outside_nested(node, sub):
                    return "it is a generator"
                if isinstance(sub, ast.Nonlocal):
                    return "it declares nonlocal names"
        return ""

    body = fn.body
    if body and isinstance(body[-1], ast.Return) and body[-1].value is None:
        body = body[:-1]  # a bare return at the end changes nothing
    return walk(body)


def _outside_nested(root: ast.AST, target: ast.AST) -> bool:
    """Whether ``target`` belongs to ``root``'s own scope, not to a function or class inside it."""
    def search(node: ast.AST) -> bool | None:
        for child in ast.iter_child_nodes(node):
            if child is target:
                return True
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                if any(n is target for n in ast.walk(child)):
                    return False
                continue
            found = search(child)
            if found is not None:
                return found
        return None
    return root is target or bool(search(root))


class _Splitter:
    def __init__(self, source: str, name: str) -> None:
        self.lines = source.splitlines()
        self.tree = ast.parse(source, filename=name)
        self.name = name
        self.notes: list[str] = []
        self.holder: ast.stmt | None = None

    def segment(self, node: ast.stmt, indent: int) -> tuple[int, int, str]:
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        end = node.end_lineno or node.lineno
        return start, end, "\n".join(_unindent(line, indent) for line in self.lines[start - 1 : end])

    def statements(self, line: int | None) -> list[tuple[ast.stmt, int, str]]:
        """The top-level statements (with each one's indentation in the file and the parameter
        assignments an inlined call adds before its body), the rewrites applied."""
        out: list[tuple[ast.stmt, int, str]] = []
        for node in self.tree.body:
            if _main_guard(node):
                out += [(n, node.body[0].col_offset, "") for n in node.body]  # type: ignore[attr-defined]
            else:
                out.append((node, 0, ""))
        inlined: set[str] = set()
        for _ in range(MAX_INLINE):
            fn = self._holder(out, line, inlined)
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            # The line is in step(), called by train(), called by main() at the top level: main()
            # is inlined first, then train() (now called at the top level), then step().
            target = self._outermost(out, fn)
            replaced = self._inline(out, target)
            if not replaced:
                break
            inlined.add(target.name)
            out = replaced
        holder = self._holder(out, line, inlined)
        if isinstance(holder, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # Not brought up: the failure shows when the top-level statement calling into it runs.
            holder = self._caller_statement(out, holder) or holder
        self.holder = holder
        return out

    @staticmethod
    def _defs(out: list[tuple[ast.stmt, int, str]]) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        return [n for n, _, _ in out if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def _outermost(self, out: list[tuple[ast.stmt, int, str]], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.FunctionDef | ast.AsyncFunctionDef:
        """``fn``, or the function calling it (and so on up) that the top level calls."""
        seen = {fn.name}
        while not any(_uses(n, fn.name) for n, _, _ in out if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))):
            caller = next((d for d in self._defs(out) if d.name not in seen and _uses(d, fn.name)), None)
            if caller is None:
                break
            seen.add(caller.name)
            fn = caller
        return fn

    def _caller_statement(self, out: list[tuple[ast.stmt, int, str]], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.stmt | None:
        """The first top-level statement that calls ``fn``, directly or through other functions."""
        reach = {fn.name}
        grew = True
        while grew:
            more = {d.name for d in self._defs(out) if d.name not in reach and any(_uses(d, name) for name in reach)}
            grew, reach = bool(more), reach | more
        return next((n for n, _, _ in out if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and any(_uses(n, name) for name in reach)), None)

    @staticmethod
    def _holder(out: list[tuple[ast.stmt, int, str]], line: int | None, inlined: set[str]) -> ast.stmt | None:
        """The statement holding ``line``: a function already inlined no longer counts (its body,
        now at the top level, holds the line)."""
        if line is None:
            return None
        return next((n for n, _, _ in out if _contains(n, line)
                     and not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in inlined)), None)

    def _inline(self, out: list[tuple[ast.stmt, int, str]], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.stmt, int, str]] | None:
        calls = [i for i, (n, _, _) in enumerate(out) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                 and isinstance(n.value.func, ast.Name) and n.value.func.id == fn.name]
        if len(calls) != 1:
            where = "is not called at the top level as a statement" if not calls else f"is called {len(calls)} times at the top level"
            self.notes.append(f"{fn.name}() leads to the failing line but {where}: the cell that calls it holds the failure")
            return None
        why = _inlinable(fn)
        if why:
            self.notes.append(f"{fn.name}() leads to the failing line but {why}: the cell that calls it holds the failure")
            return None
        i = calls[0]
        call = out[i][0].value  # type: ignore[attr-defined]
        bound = _bind(fn, call, self.lines)
        if bound is None:
            self.notes.append(f"the call {fn.name}(…) passes arguments distnb cannot bind to its parameters: the cell that calls it holds the failure")
            return None
        body = fn.body[:-1] if isinstance(fn.body[-1], ast.Return) and fn.body[-1].value is None else fn.body
        self.notes.append(f"{fn.name}()'s body is inlined where it was called (line {call.lineno}), so the failing call can have a cell of its own")
        inlined = [*out[:i], *((n, body[0].col_offset, bound if j == 0 else "") for j, n in enumerate(body)), *out[i + 1 :]]
        uses = sum(isinstance(n, ast.Name) and n.id == fn.name for n in ast.walk(self.tree))
        # Called only there, its definition would be a cell that nothing uses.
        return [x for x in inlined if x[0] is not fn] if uses == 1 else inlined

    def chunks(self, line: int | None) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        previous_end = last_line = 0
        for node, indent, prefix in self.statements(line):
            start, end, text = self.segment(node, indent)
            shares, last_line = chunks and node.lineno == last_line, end
            if shares:  # statements sharing a line (a; b) stay together
                chunks[-1].last = max(chunks[-1].last, end)
                if node is self.holder:
                    chunks[-1].holds, chunks[-1].statement = True, _compound(node)
                continue
            # Comments and blank lines between two statements go with the next one.
            gap = [_unindent(x, indent) for x in self.lines[previous_end:start - 1] if not x.strip() or x.strip().startswith("#")]
            while gap and not gap[0].strip():
                gap.pop(0)
            kind = "import" if isinstance(node, (ast.Import, ast.ImportFrom)) else (
                "def" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else "code")
            body = "\n".join([*gap, *([prefix] if prefix else []), text])
            holds = node is self.holder
            chunks.append(_Chunk(start, end, body, kind, holds, _compound(node) if holds else ""))
            previous_end = max(previous_end, end)
        return chunks


def _uses(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


_COMPOUND = {ast.For: "for loop", ast.AsyncFor: "for loop", ast.While: "while loop", ast.With: "with block",
             ast.AsyncWith: "with block", ast.Try: "try block", ast.If: "if block"}


def _compound(node: ast.stmt) -> str:
    return next((words for t, words in _COMPOUND.items() if isinstance(node, t)), "")


def _unindent(line: str, indent: int) -> str:
    return line[indent:] if line[:indent].strip() == "" else line.lstrip()


def _bind(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, lines: list[str]) -> str | None:
    """The call's arguments as assignments to the function's parameters (defaults where not passed)."""
    params = [a.arg for a in fn.args.args]
    defaults = dict(zip(params[len(params) - len(fn.args.defaults):], fn.args.defaults))
    kwdefaults = {a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None}
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords) or len(call.args) > len(params):
        return None
    source = "\n".join(lines)
    given: dict[str, ast.expr] = dict(zip(params, call.args))
    for k in call.keywords:
        if k.arg in given or k.arg not in (*params, *(a.arg for a in fn.args.kwonlyargs)):
            return None
        given[str(k.arg)] = k.value
    out = []
    for name in [*params, *(a.arg for a in fn.args.kwonlyargs)]:
        value = given.get(name) or defaults.get(name) or kwdefaults.get(name)
        if value is None:
            return None
        out.append(f"{name} = {ast.get_source_segment(source, value)}")
    return "\n".join(out)


def split_script(source: str, line: int | None = None, name: str = "script.py") -> ScriptCells:
    """Cut ``source`` into cells; the statement holding ``line`` (after the rewrites) alone in its
    cell. Imports run together, each definition is a cell, and the plain statements between them
    one cell per run. SyntaxError (with the file's name) when the source does not parse."""
    splitter = _Splitter(source, name)
    chunks = splitter.chunks(line)
    cells: list[str] = []
    failing = None
    kinds: list[str] = []
    for c in chunks:
        alone = c.holds or (kinds and kinds[-1] == "failing")
        if cells and not alone and c.kind != "def" and kinds[-1] == c.kind:
            cells[-1] += "\n" + c.text
            continue
        cells.append(c.text)
        kinds.append("failing" if c.holds else c.kind)
        if c.holds:
            failing = len(cells) - 1
    if line is not None and failing is None:
        splitter.notes.append(f"line {line} is not in a statement of {name}: no cell stands out as the failing one")
    else:
        holder = next((c for c in chunks if c.holds), None)
        if holder is not None and holder.statement and holder.statement != "if block":
            splitter.notes.append(f"line {line} is inside the {holder.statement} at line {holder.first}: the whole statement is its cell")
    return ScriptCells([c.strip("\n") for c in cells], failing, splitter.notes)
