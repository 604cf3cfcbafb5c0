"""What a failure needs of the cells, read from their code before a single try: a backward slice.

``%dist_minimize`` cut by trying alone — every try a fresh set of ranks and a run of the cells —
and on a session of many statements most tries removed something the failure never needed. The
cells' code says much of it: the failing statement (the line a rank raised at, or waits at) needs
the statements that define or change the names it reads, and those in turn theirs; a call into
``torch.distributed`` anywhere (or into a function of the cells that makes one) moves the groups'
sequence numbers, so it stays whatever names it touches; so does one that sets what the process
shares (a seed, an environment variable, torch's defaults). Everything else is one try's guess: the
slice is tried once, and kept only when it still fails as the session did.

Read conservatively, as it must be to lose nothing: any call may change the names it is given and
the object whose method it calls (``dist.all_reduce(loss)`` changes ``loss``, ``opt.step()`` changes
``opt``); a name once needed stays needed above a statement that sets it (a change may be partial);
a function needs every name its body reads.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass

from distnb.analysis.cell_parts import first_line, top_level
from distnb.analysis.names import imported

__all__ = ["Statement", "read_statements", "slice_cells"]

#: Names through which a statement reaches torch.distributed: the pool's own ``dist``, and the
#: module by its path.
_DIST_NAMES = frozenset({"dist", "distributed", "c10d", "funcol"})
#: Names a call can't be said to change: modules (``torch.tensor(x)`` makes a tensor, it does not
#: change torch; every rank starts with ``torch`` and ``dist``), the numbers every rank starts with,
#: and Python's builtins.
_NOT_CHANGED = frozenset({"torch", "dist", "rank", "local_rank", "world_size", "device", *dir(builtins)})
#: Builtins that change what they are given.
_CHANGING_BUILTINS = frozenset({"setattr", "delattr", "next", "exec", "vars"})
#: Methods that only read their object (``model.parameters()`` hands the optimizer the model's
#: tensors, it does not change the model): a call of one changes nothing by itself. Not ``to``,
#: ``cuda``, ``train``, ``eval``: on a module those change it in place.
_READING_METHODS = frozenset({
    "parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children",
    "named_children", "state_dict", "size", "dim", "numel", "item", "tolist", "clone", "detach", "numpy", "keys",
    "values", "items", "get", "count", "index", "format", "join", "split", "strip", "startswith", "endswith",
})
#: A module's function that sets process-wide state the cells read without naming it: the random
#: generators' seeds, torch's defaults and modes (``torch.manual_seed``, ``set_default_dtype``,
#: ``use_deterministic_algorithms``, ``set_num_threads``).
_GLOBAL_SETTER = re.compile(r"(^|_)seed($|_)|^set_|^use_|^enable_|^disable_")


@dataclass(frozen=True)
class Statement:
    """One top-level statement of a cell: its source, its lines in the cell, the names it may set
    or change and those it reads, and whether it reaches torch.distributed."""

    source: str
    first: int
    last: int
    sets: frozenset[str]
    reads: frozenset[str]
    collective: bool
    #: Of ``sets``, the names it only binds (``x = …``, a loop's target): it changes no object
    #: another name may share, so it matters only where that name itself is read after.
    binds: frozenset[str] = frozenset()
    #: Names an assignment may make share one object (``opt = SGD(model.parameters())``: a later
    #: ``opt.step()`` changes ``model``): the target and the names its value reads.
    links: frozenset[str] = frozenset()
    #: It sets state the process shares (a seed, ``os.environ[…] = …``, torch's defaults): later
    #: statements may read it without naming it, so it stays.
    shared: bool = False


def _root(node: ast.AST) -> str | None:
    """``x`` of ``x``, ``x.a.b``, ``x[i].c``, ``x.f()``."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _may_change_arguments(func: ast.expr, modules: set[str]) -> bool:
    """Whether a call may change what it is given: not a builtin that only reads (``print(x)``,
    ``len(x)``), nor a module's function that makes something new (``os.path.join``,
    ``torch.tensor``); a function of torch.distributed does (a collective writes its tensors), and
    so does one named in place (``torch.nn.init.zeros_(w)``)."""
    if isinstance(func, ast.Name):
        return func.id not in builtins.__dict__ or func.id in _CHANGING_BUILTINS
    if isinstance(func, ast.Attribute) and _root(func) in modules:
        return _root(func) in _DIST_NAMES or func.attr.endswith("_") or any(
            isinstance(n, ast.Attribute) and n.attr == "distributed" for n in ast.walk(func))
    return True


def _names(node: ast.stmt, modules: set[str]) -> tuple[set[str], set[str], set[str]]:
    """The names ``node`` changes (an object another name may share), binds, and reads."""
    sets: set[str] = set()
    binds: set[str] = set()
    reads: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        binds.add(node.name)
    for sub in ast.walk(node):
        if isinstance(sub, ast.AugAssign) and (root := _root(sub.target)) is not None:
            reads.add(root)  # n += 1 reads n
            sets.add(root)  # and changes it in place where it can (a list, a tensor)
        if isinstance(sub, ast.Name):
            (binds if isinstance(sub.ctx, (ast.Store, ast.Del)) else reads).add(sub.id)
        elif isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            if (root := _root(sub)) is not None and root not in modules:
                sets.add(root)  # x.a = … and x[i] = … change x (a module's, os.environ[…] = …, sets shared state: `shared`)
        elif isinstance(sub, ast.Call):
            changed = [sub.func.value] if isinstance(sub.func, ast.Attribute) and sub.func.attr not in _READING_METHODS else []  # opt.step()
            if _may_change_arguments(sub.func, modules):
                changed += [*sub.args, *(k.value for k in sub.keywords)]  # dist.all_reduce(loss) changes loss
            sets.update(root for arg in changed if (root := _root(arg)) is not None and root not in modules)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            binds.update(imported(sub))
        elif isinstance(sub, ast.Global):
            sets.update(sub.names)
    return sets, binds, reads


def _called(node: ast.AST) -> set[str]:
    """The names ``node`` calls by name (``step()``, ``helper(x)``)."""
    return {sub.func.id for sub in ast.walk(node) if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name)}


def _local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """A function's parameters and the names its body binds, but those it declares global: what it
    changes of them is its own (a parameter's object is changed through the call's arguments)."""
    args = fn.args
    params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, *(x for x in (args.vararg, args.kwarg) if x)]}
    bound = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    declared = {name for n in ast.walk(fn) if isinstance(n, (ast.Global, ast.Nonlocal)) for name in n.names}
    return (params | bound) - declared


def _reaches_dist(node: ast.AST, collective_functions: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and (sub.id in _DIST_NAMES or sub.id in collective_functions):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "distributed":
            return True
        if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("torch.distributed"):
            return True
    return False


def _links(node: ast.stmt, modules: set[str]) -> frozenset[str]:
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        targets, value = [node.target], node.iter
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        pairs = [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars is not None]
        return frozenset(n for t, v in pairs for part in (t, v) for n in _all_names(part) if n not in modules)
    else:
        return frozenset()
    if value is None:
        return frozenset()
    return frozenset(n for part in [*targets, value] for n in _all_names(part) if n not in modules)


def _all_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _Classes:
    """Names that may share an object, as union-find over the statements' links."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        parent = self._parent.setdefault(name, name)
        if parent != name:
            parent = self._parent[name] = self.find(parent)
        return parent

    def join(self, names: frozenset[str]) -> None:
        first, *rest = sorted(names)
        for name in rest:
            self._parent[self.find(name)] = self.find(first)


def _sets_shared_state(node: ast.stmt, modules: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and _root(sub.func) in modules \
                and _GLOBAL_SETTER.search(sub.func.attr):
            return True
        if isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, ast.Store) and _root(sub) in modules:
            return True  # os.environ['X'] = …, torch.backends.cudnn.benchmark = …
    return False


def read_statements(cells: list[str]) -> list[list[Statement]] | None:
    """Each cell's top-level statements as :class:`Statement`; None when a cell does not parse
    (then nothing is sliced: the tries alone cut it)."""
    out: list[list[Statement]] = []
    collective_functions: set[str] = set()  # functions of the cells, or torch.distributed's, that reach it
    effects: dict[str, frozenset[str]] = {}  # a function of the cells → the names outside it a call of it may change
    global_reads: dict[str, frozenset[str]] = {}  # … and those it reads
    modules = set(_NOT_CHANGED)
    for code in cells:
        parsed = top_level(code)
        if parsed is None:
            return None
        stmts = []
        for node, text in parsed:
            if isinstance(node, ast.Import):
                modules.update(imported(node))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                collective_functions.update(a.asname or a.name for a in node.names)  # init_device_mesh, new_group …
            sets, binds, reads = _names(node, modules)
            # A call of a function of the cells changes and reads, outside the function, what its
            # body does, there and then: the calling statement's changes and reads, not the def's.
            called = _called(node)
            sets |= {n for f in called for n in effects.get(f, ())}
            reads |= {n for f in called for n in global_reads.get(f, ())}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local = _local_names(node)
                effects[node.name], global_reads[node.name] = frozenset(sets - local), frozenset(reads - local)
                sets, binds = set(), {node.name}  # its body's names are its own until it is called
            # An import at the top calls nothing: it is kept where its names are read (inside a
            # function, one marks the function as reaching torch.distributed).
            collective = not isinstance(node, ast.ImportFrom) and _reaches_dist(node, collective_functions)
            if collective and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                collective_functions.add(node.name)
                collective = False  # defining it calls nothing; a statement that calls it does
            stmts.append(Statement(text, first_line(node), node.end_lineno or node.lineno,
                                   frozenset(sets | binds), frozenset(reads), collective, frozenset(binds - sets),
                                   _links(node, modules), _sets_shared_state(node, modules)))
        out.append(stmts)
    return out


def slice_cells(cells: list[str], lines: set[int], keep_shared: bool = True) -> list[list[int]] | None:
    """For each cell, the indices of the statements the last cell's failing ``lines`` need (all of
    the last cell's statements when ``lines`` is empty or names none of them); None when the code
    can't be read. The last cell keeps its statements at those lines and every one that reaches
    torch.distributed (another rank may wait in it); every cell keeps what those read, back to
    where it was set. ``keep_shared=False``: a statement that sets process-wide state (a seed,
    torch's defaults) stays only where something needs it by name — the minimizer's second guess."""
    parsed = read_statements(cells)
    if parsed is None or not parsed or not parsed[-1]:
        return None
    last = parsed[-1]
    seeds = {i for i, s in enumerate(last) if any(s.first <= line <= s.last for line in lines)}
    if not seeds:
        seeds = set(range(len(last)))
    seeds |= {i for i, s in enumerate(last) if s.collective}
    classes = _Classes()
    for stmt in (s for cell in parsed for s in cell if s.links):
        classes.join(stmt.links)
    kept: list[set[int]] = [set() for _ in parsed]
    needed: set[str] = set()  # as classes: a change to any name of one may change them all
    read: set[str] = set()  # the names themselves: binding one matters only where it is read
    for c in range(len(parsed) - 1, -1, -1):
        for i in range(len(parsed[c]) - 1, -1, -1):
            s = parsed[c][i]
            seed = c == len(parsed) - 1 and i in seeds
            changes = s.sets - s.binds
            if seed or s.collective or (s.shared and keep_shared) or any(classes.find(n) in needed for n in changes) or s.binds & read:
                kept[c].add(i)
                needed |= {classes.find(n) for n in s.reads}
                read |= s.reads
    return [sorted(k) for k in kept]
