"""The house rules, pinned: no import cycle, nothing imports a layer above it, the worker side
speaks to the controller only through the shared modules, and the public surface is what it says."""

from __future__ import annotations

import ast
from pathlib import Path

import distnb

PACKAGE = Path(distnb.__file__).parent

#: Lowest first; a module may import its own layer (without a cycle) and the ones below it.
LAYERS: list[set[str]] = [
    {"_text", "_processes", "_zmq_io", "protocol", "security", "ranks", "errors", "config", "network", "cell_code"},
    {"results", "worker", "nccl_report", "pool_status", "env_report"},  # the worker package: rank processes and supervisors
    {"collective_log", "diagnose", "position", "p2p", "group_creation", "steps", "stragglers", "profile_report", "sync_check",
     "stacks", "check_report", "memory_report", "cluster", "launcher", "channel",
     "requests", "records", "export", "session", "node", "prompts", "liveness", "deaths"},
    {"tracker", "values"},
    {"diagnostics", "multinode", "startup", "debugger"},
    {"waiting"},
    {"pool"},
    {"display", "magics", "magic_support", "inspect_magics", "__main__", "__init__"},
]
#: What the worker package (and the node agent's rank side) may import from the rest of distnb.
WORKER_MAY_IMPORT = {"_text", "_processes", "_zmq_io", "protocol", "security", "cell_code"}


def _layer(name: str) -> int:
    top = name.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _top_level_imports(path: Path) -> set[str]:
    """distnb modules imported when ``path`` is imported: module level, not under TYPE_CHECKING,
    not inside functions (those load on first use and can't form an import-time cycle)."""
    found: set[str] = set()
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", []) +
                      [s for h in getattr(node, "handlers", []) for s in h.body])
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distnb"):
                base = node.module[len("distnb."):] if node.module != "distnb" else ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    found.add(sub if sub in modules else base)
            elif isinstance(node, ast.Import):
                found.update(a.name[len("distnb."):] for a in node.names if a.name.startswith("distnb."))

    visit(ast.parse(path.read_text()).body)
    found.discard("")
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _top_level_imports(p) for p in PACKAGE.rglob("*.py")}


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


def test_the_worker_side_speaks_only_through_the_shared_modules() -> None:
    for module, deps in _graph().items():
        if module.startswith("worker"):
            outside = {d for d in deps if not d.startswith("worker")} - WORKER_MAY_IMPORT
            assert not outside, f"{module} imports controller modules {sorted(outside)}"


def test_every_module_is_placed_in_a_layer_and_small() -> None:
    for path in PACKAGE.rglob("*.py"):
        _layer(_module_name(path))  # raises StopIteration for a module nobody placed
        lines = len(path.read_text().splitlines())
        assert lines <= 500, f"{path.name} has {lines} lines: split it by job"


def test_public_surface_is_pinned_and_loads() -> None:
    assert distnb.__all__ == sorted(distnb.__all__)
    assert distnb.__all__ == [
        "CellEvents", "CellResult", "Debugger", "Diagnosis", "DistnbError", "LaunchConfig", "LaunchError", "NoAnswerError",
        "NoCellError", "NoPoolError", "Pool", "PoolBrokenError", "PoolBusyError", "PoolState", "PoolStatus", "Prompt", "RankResult",
        "RankState", "RankStatus", "RemoteError", "ShutdownError", "checksum", "current_pool", "launch",
        "load_ipython_extension", "unload_ipython_extension",
    ]
    for name in distnb.__all__:
        assert getattr(distnb, name) is not None


def test_pool_and_launch_spell_out_their_options() -> None:
    import inspect

    import pytest

    options = set(inspect.signature(distnb.Pool).parameters) - {"config"}
    fields = set(distnb.LaunchConfig.__dataclass_fields__)
    assert options == fields, f"Pool's options and LaunchConfig's fields differ: {sorted(options ^ fields)}"
    assert set(inspect.signature(distnb.launch).parameters) == options | {"config", "on_progress"}
    with pytest.raises(TypeError, match="either a LaunchConfig or keyword options"):
        distnb.Pool(distnb.LaunchConfig(nproc=1), nproc=2)
    with pytest.raises(TypeError):
        distnb.Pool(nprocs=2)  # type: ignore[call-arg]
    pool = distnb.Pool(nproc=3, backend="gloo", hang_after=2.0)
    assert pool.config == distnb.LaunchConfig(nproc=3, backend="gloo", hang_after=2.0)
    with pytest.raises(AttributeError):
        pool.state = distnb.PoolState.READY  # type: ignore[misc]
