"""How one collective entry reads in every view: ``all_reduce [3] f32 src=1 ⏳`` — its op, the
shapes and dtypes of its inputs, the arguments the call was given, and whether it completed."""

from __future__ import annotations

from typing import Any, Mapping

from distnb.cell_names import cell_name
from distnb.wire.record_types import CollectiveEntry, issued_in

__all__ = ["args_text", "describe", "line_words", "state_mark"]

_DTYPE_SHORT = {"Float": "f32", "Double": "f64", "Half": "f16", "BFloat16": "bf16", "Long": "i64", "Int": "i32",
                "Byte": "u8", "Bool": "bool", "Char": "i8", "Short": "i16"}


def args_text(args: dict[str, Any] | None) -> str:
    """``src=1``, ``op=MAX``: the arguments a call was given, the usual reduce op (SUM) left out."""
    return " ".join(f"{k}={v}" for k, v in (args or {}).items() if v is not None and not (k == "op" and v == "SUM"))


def describe(entry: Mapping[str, Any], with_op: bool = True) -> str:
    """``all_reduce [3] f32`` (shapes and dtypes of the inputs), ``broadcast [2] f32 src=1``."""
    shapes = " ".join("[" + ",".join(map(str, s)) + "]" for s in entry.get("sizes", [])[:4])
    if len(entry.get("sizes", [])) > 4:
        shapes += f" +{len(entry['sizes']) - 4}"
    dtypes = sorted({_DTYPE_SHORT.get(d, d) for d in entry.get("dtypes", [])})
    args = args_text(entry.get("args"))
    parts = ([entry["op"]] if with_op else []) + ([shapes] if shapes else []) + ([",".join(dtypes)] if dtypes else []) + ([args] if args else [])
    return " ".join(parts)


def line_words(entry: CollectiveEntry) -> str:
    """``, line 7`` (of the cell that issued it), or for a call inside a function an earlier cell
    defined ``, line 4, in step() (cell 1 line 7)``; ``""`` where the call log did not see it."""
    site = entry.get("call_cell")
    if not entry.get("line") or site is None:
        return ""
    if site == issued_in(entry):
        return f", line {entry['line']}"
    called = f"line {entry['in_line']}, " if entry.get("in_line") else ""
    return f", {called}in {entry.get('func') or 'a function'}() ({cell_name(site)} line {entry['line']})"


def state_mark(entry: Mapping[str, Any]) -> str:
    """`` ⏳`` for an entry not completed, `` ⏸`` for an NCCL one still queued behind other GPU
    work (its kernel has not started: the stream is busy before it), ``""`` when done."""
    if entry["done"]:
        return ""
    return " ⏸" if entry.get("queued") else " ⏳"
