"""How one collective entry reads in every view: ``all_reduce [3] f32 src=1 ⏳`` — its op, the
shapes and dtypes of its inputs, the arguments the call was given, and whether it completed."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["args_text", "describe", "state_mark"]

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


def state_mark(entry: Mapping[str, Any]) -> str:
    """`` ⏳`` for an entry not completed, `` ⏸`` for an NCCL one still queued behind other GPU
    work (its kernel has not started: the stream is busy before it), ``""`` when done."""
    if entry["done"]:
        return ""
    return " ⏸" if entry.get("queued") else " ⏳"
