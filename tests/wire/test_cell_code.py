"""Cells compiled once in the notebook and loaded by the ranks (distnb/cell_code.py)."""

from __future__ import annotations

import linecache
import marshal

import pytest

from distnb.wire import cell_code
from distnb.wire.cell_code import cell_filename, compile_cell, compile_source, exec_request, pack, renamed, unpack
from distnb.wire.protocol import Msg
from distnb.worker.process.execute import Executor


def run_as_rank(msg: dict, ns: dict | None = None) -> dict:
    """What a rank does with an EXEC: load its code objects (or compile the source) and run them."""
    executor = Executor({} if ns is None else ns, lambda cell, bundle: None)
    return executor.run(msg["cell"], msg["code"], compiled=unpack(msg.get("compiled")))


def test_the_last_expression_is_the_value_unless_a_semicolon_ends_it() -> None:
    assert compile_cell("x = 1\nx + 1", "<cell-1>").last is not None
    assert compile_cell("x = 1\nx + 1;", "<cell-1>").last is None
    assert compile_cell("x = 1", "<cell-1>").last is None
    assert compile_cell("", "<cell-1>").last is None and compile_cell("# nothing\n", "<cell-1>").last is None
    reply = run_as_rank(exec_request(3, "y = 20\ny + 1", compile_source("y = 20\ny + 1"), {}))
    assert reply["status"] == "ok" and reply["value"]["text/plain"] == "21"


def test_code_compiled_before_its_number_is_known_names_the_cell_everywhere() -> None:
    """Nested code (a function's) is renamed too: tracebacks and the debugger name the cell."""
    source = "def inner():\n    raise ValueError('x')\n\ninner()\n"
    msg = exec_request(42, source, compile_source(source), {})
    loaded = unpack(msg["compiled"])
    assert loaded is not None and loaded.body.co_filename == cell_filename(42)
    nested = [c for c in loaded.body.co_consts if hasattr(c, "co_filename")]
    assert nested and all(c.co_filename == cell_filename(42) for c in nested)
    reply = run_as_rank(msg)
    assert reply["status"] == "error" and reply["error"]["line"] == 2
    assert "raise ValueError('x')" in reply["error"]["traceback"]
    linecache.cache.pop(cell_filename(42), None)


def test_the_same_source_is_compiled_once_and_each_cell_gets_its_own_name() -> None:
    compile_source.cache_clear()
    a, b = exec_request(1, "z = 3", compile_source("z = 3"), {}), exec_request(2, "z = 3", compile_source("z = 3"), {})
    assert compile_source.cache_info().hits == 1
    assert unpack(a["compiled"]).body.co_filename == "<cell-1>" and unpack(b["compiled"]).body.co_filename == "<cell-2>"


def test_a_syntax_error_is_raised_in_the_notebook_and_not_remembered() -> None:
    with pytest.raises(SyntaxError):
        compile_source("x = (")
    with pytest.raises(SyntaxError):
        compile_source("x = (")
    # Compiler errors (not the parser's) are raised there too, before anything runs anywhere.
    with pytest.raises(SyntaxError, match="outside function"):
        compile_source("x = 1\nreturn x")


def test_code_from_another_interpreter_or_none_is_compiled_from_source() -> None:
    blob = pack(renamed(compile_source("w = 5\nw * 2"), "<cell-7>"))
    assert blob is not None and unpack(blob) is not None
    foreign = b"distnb-code/\x00\x00\r\n" + blob[len(cell_code._TAG):]
    for bad in (None, b"", foreign, blob[:20], cell_code._TAG + b"not marshal", cell_code._TAG + marshal.dumps(5)):
        assert unpack(bad) is None
        reply = run_as_rank({"t": Msg.EXEC, "cell": 7, "code": "w = 5\nw * 2", "compiled": bad})
        assert reply["status"] == "ok" and reply["value"]["text/plain"] == "10"


def test_a_huge_cell_travels_as_source_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cell_code, "_PACK_MAX", 64)
    source = "\n".join(f"v{i} = {i}" for i in range(50))
    msg = exec_request(9, source, compile_source(source), {"profile": True, "pdb": False})
    assert "compiled" not in msg and msg["profile"] is True and "pdb" not in msg
    ns: dict = {}
    assert run_as_rank(msg, ns)["status"] == "ok" and ns["v49"] == 49


def test_cells_do_not_inherit_distnbs_future_imports() -> None:
    """As IPython compiles them: annotations are evaluated unless the cell imports the future."""
    ns: dict = {}
    run_as_rank(exec_request(11, "def f(a: int) -> int: return a", compile_source("def f(a: int) -> int: return a"), {}), ns)
    assert ns["f"].__annotations__ == {"a": int, "return": int}
    source = "from __future__ import annotations\ndef g(a: int): return a"
    run_as_rank(exec_request(12, source, compile_source(source), {}), ns)
    assert ns["g"].__annotations__ == {"a": "int"}
