"""The house rules, pinned: no import cycle, nothing imports a layer above it, the worker side
speaks to the controller only through the shared modules, and the public surface is what it says."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import distnb

PACKAGE = Path(distnb.__file__).parent

#: The rooms, lowest first. A folder is one room; the root's modules are placed one by one (its
#: helpers sit at the bottom, its public types above the analyses they name, the Pool above the
#: services it composes). A module may import its own room (without a cycle) and rooms below it.
LAYERS: list[set[str]] = [
    {"_text", "_processes", "ranks", "cell_names", "errors", "config", "states"},  # shared helpers and settings
    {"wire"},  # what both sides speak
    {"worker"},  # the rank side: supervisors and rank processes
    {"analysis"},  # pure: data in, findings out
    {"results", "status"},  # the public result types, whose text names the analyses' findings
    {"launching"},  # torchrun, addresses, node agents and how they start
    {"controller"},  # the controller's live state
    {"transport"},  # the seam under the Pool: a launch's ranks and the wire to them (real, or replayed in tests)
    {"services"},  # built from the controller's parts, never from the Pool
    # the public face (its read-only views a base of its own); the registry of live pools, an attached or loaded job
    {"pool", "pool_views", "jobs"},
    {"display"},
    {"magics", "__main__", "__init__", "node"},
]
#: What the rank side (supervisors, ranks) may import from the rest of distnb: it runs without the
#: controller's code, and speaks to it only through the wire.
WORKER_MAY_IMPORT = {"wire", "_text", "_processes"}
#: The wire is the bottom of both sides: it may import only these.
WIRE_MAY_IMPORT = {"_text"}
#: The root keeps the public face and a few shared helpers, no more.
ROOT_MODULES = {"__init__", "__main__", "_processes", "_text", "cell_names", "config", "errors", "node", "pool",
                "pool_views", "ranks", "results", "states", "status"}


def _room(name: str) -> str:
    """A module's room: its folder under distnb/, or its own name at the root."""
    return name.split(".")[0]


def _layer(name: str) -> int:
    room = _room(name)
    return next(i for i, layer in enumerate(LAYERS) if room in layer)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


@functools.cache
def _modules() -> frozenset[str]:
    return frozenset(_module_name(p) for p in PACKAGE.rglob("*.py"))


@functools.cache
def _parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for every rule here."""
    return ast.parse(path.read_text())


def _top_level_imports(path: Path, functions: bool = False) -> set[str]:
    """distnb modules imported when ``path`` is imported: module level, not under TYPE_CHECKING;
    with ``functions``, the imports inside functions too (they load on first use, but hide a
    dependency all the same: they obey the layers, and form no cycle)."""
    found: set[str] = set()
    modules = _modules()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", []) +
                      [s for h in getattr(node, "handlers", []) for s in h.body])
            elif functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With, ast.For, ast.While)):
                visit(node.body + getattr(node, "orelse", []))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distnb"):
                base = node.module[len("distnb."):] if node.module != "distnb" else ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    found.add(sub if sub in modules else base or "__init__")
            elif isinstance(node, ast.Import):
                found.update(a.name[len("distnb."):] for a in node.names if a.name.startswith("distnb."))

    visit(_parsed(path).body)
    found.discard(_module_name(path))
    return found


def _graph(functions: bool = True) -> dict[str, set[str]]:
    return {_module_name(p): _top_level_imports(p, functions) for p in PACKAGE.rglob("*.py")}


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [node, dep]))
            if dep not in state:
                walk(dep, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])


def test_nothing_imports_a_layer_above_it() -> None:
    wrong = [f"{m} imports {d}" for m, deps in _graph().items() for d in deps if _layer(d) > _layer(m)]
    assert not wrong, "\n".join(wrong)


#: analysis/'s rooms: the agreement model below the verdicts and the reports, which don't import
#: each other.
ANALYSIS_BELOW = {"agreement": set(), "reports": {"agreement"}, "verdicts": {"agreement"}}


def test_analysis_rooms_keep_their_order() -> None:
    for module, deps in _graph().items():
        parts = module.split(".")
        if parts[0] != "analysis" or len(parts) < 3:
            continue
        room = parts[1]
        for dep in deps:
            sub = dep.split(".")
            if sub[0] == "analysis" and len(sub) >= 3 and sub[1] != room:
                assert sub[1] in ANALYSIS_BELOW[room], f"{module} imports {dep}: analysis.{room} may import only {sorted(ANALYSIS_BELOW[room])}"
        assert room in ANALYSIS_BELOW, f"{module}: a room of analysis/ not in ANALYSIS_BELOW"


def test_the_worker_side_speaks_only_through_the_wire() -> None:
    for module, deps in _graph().items():
        if _room(module) == "worker":
            outside = {_room(d) for d in deps} - {"worker"} - WORKER_MAY_IMPORT
            assert not outside, f"{module} imports {sorted(outside)}: the rank side may import only {sorted(WORKER_MAY_IMPORT)}"


def test_the_wire_stands_alone() -> None:
    for module, deps in _graph().items():
        if _room(module) == "wire":
            outside = {_room(d) for d in deps} - {"wire"} - WIRE_MAY_IMPORT
            assert not outside, f"{module} imports {sorted(outside)}"


def test_analyses_are_pure() -> None:
    """Data in, findings out: no analysis starts a process, opens a socket or a thread, or imports
    torch, ZMQ or IPython (the controller only for type checking: see the layer test)."""
    for path in (PACKAGE / "analysis").rglob("*.py"):
        tree = _parsed(path)
        imported = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
        banned = imported & {"torch", "zmq", "IPython", "ipywidgets", "subprocess", "socket", "threading"}
        assert not banned, f"analysis/{path.name} imports {sorted(banned)}: that belongs in a service"


def test_the_root_keeps_the_public_face_and_a_few_helpers() -> None:
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES, f"modules at the root that belong in a room: {sorted(root - ROOT_MODULES)}"


def test_one_home_per_name() -> None:
    """A public name is defined in one module only (re-exports through ``__all__`` aside, for the
    package's own face)."""
    homes: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in _parsed(path).body:
            names: list[str] = []
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            for name in names:
                # ``main`` (an entry point) and ``install`` (a module's one hook, called as
                # ``call_log.install()``) are verbs qualified by their module, not names to import.
                if not name.startswith("_") and name not in ("main", "install", "T"):
                    homes.setdefault(name, set()).add(_module_name(path))  # overloads: one home
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    # And no module hands on, in its __all__, a name another module defines (the package's face
    # and the ``python -m distnb.node`` shim aside).
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" or path == PACKAGE / "node.py":
            continue
        tree = _parsed(path)
        exported = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                         and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), [])
        foreign = [name for name in exported if _module_name(path) not in homes.get(name, {_module_name(path)})]
        assert not foreign, f"{_module_name(path)} re-exports {foreign}: import them from their home"
    assert not twice, "defined in more than one module: " + "; ".join(f"{n}: {', '.join(sorted(w))}" for n, w in sorted(twice.items()))


def test_every_module_is_placed_in_a_layer_and_small() -> None:
    for path in PACKAGE.rglob("*.py"):
        _layer(_module_name(path))  # raises StopIteration for a module in no room
        lines = len(path.read_text().splitlines())
        assert lines <= 500, f"{path.name} has {lines} lines: split it by job"


def test_public_surface_is_pinned_and_loads() -> None:
    assert distnb.__all__ == sorted(distnb.__all__)
    assert distnb.__all__ == [
        "AttachError", "AttachedJob",
        "CellEvents", "CellFailed", "CellResult", "CellStatus", "Certainty", "Debugger", "DistnbError", "Evidence", "Kind", "LaunchConfig", "LaunchError",
        "LoadError", "LoadedJob",
        "NoAnswerError", "NoCellError", "NoPoolError", "Pool", "PoolBrokenError", "PoolBusyError", "PoolState", "PoolStatus", "Prompt",
        "RankResult", "RankState", "RankStatus", "RemoteError", "RootCause", "ShutdownError", "Site", "Verdict", "VerdictState", "attach",
        "checksum",
        "current_pool", "detach", "launch", "live_pools", "load",
        "load_ipython_extension", "unload_ipython_extension",
    ]
    for name in distnb.__all__:
        assert getattr(distnb, name) is not None


def test_pool_and_launch_spell_out_their_options() -> None:
    import inspect

    import pytest

    options = set(inspect.signature(distnb.Pool).parameters) - {"config", "transport"}
    fields = set(distnb.LaunchConfig.__dataclass_fields__)
    assert options == fields, f"Pool's options and LaunchConfig's fields differ: {sorted(options ^ fields)}"
    assert set(inspect.signature(distnb.launch).parameters) == options | {"config", "on_progress", "transport"}
    with pytest.raises(TypeError, match="either a LaunchConfig or keyword options"):
        distnb.Pool(distnb.LaunchConfig(nproc=1), nproc=2)
    with pytest.raises(TypeError):
        distnb.Pool(nprocs=2)  # type: ignore[call-arg]
    pool = distnb.Pool(nproc=3, backend="gloo", hang_after=2.0)
    assert pool.config == distnb.LaunchConfig(nproc=3, backend="gloo", hang_after=2.0)
    with pytest.raises(AttributeError):
        pool.state = distnb.PoolState.READY  # type: ignore[misc]


def test_rooms_stay_small_enough_to_read() -> None:
    """At most 12 modules at the root (besides ``__init__`` and ``__main__``), at most 20 in a room:
    past that a room holds more than one idea and is split by idea."""
    assert len(ROOT_MODULES - {"__init__", "__main__"}) <= 12, sorted(ROOT_MODULES)
    for folder in [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 20, f"{folder.relative_to(PACKAGE)} holds {len(modules)} modules: split it by idea"
