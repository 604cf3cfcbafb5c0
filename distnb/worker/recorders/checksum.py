"""Tensor checksums, computed where the tensor lives (rank side; the controller compares them).

``checksum(obj)`` summarises a tensor, module, state dict, optimizer or container as a small,
picklable, JSON-able dict: shape, dtype, device, DTensor placement, sum, norm, min, max, NaN/Inf
counts and a bitwise ``fingerprint``. Only a handful of scalars leave the device.

The fingerprint is :mod:`distnb.worker.recorders.fingerprint`'s. This module never imports controller code, and
imports torch only when called (``import distnb`` and the rank's start must not pull it in).
"""

from __future__ import annotations

import math
import re
from typing import Any

from distnb.worker.recorders import fingerprint as _fp
from distnb.worker.recorders.fingerprint import MASK as _MASK
from distnb.worker.recorders.fingerprint import dense as _dense
from distnb.worker.recorders.fingerprint import digest as _digest
from distnb.worker.recorders.fingerprint import dtype_name as _dtype_name
from distnb.worker.recorders.fingerprint import fetch as _fetch
from distnb.worker.recorders.fingerprint import pieces as _pieces
from distnb.worker.recorders.fingerprint import sum_tensor as _sum_tensor
from distnb.worker.recorders.fingerprint import sums as _sums
from distnb.worker.torch_hooks.imported import imported_module

__all__ = ["checksum", "tensor_summary"]

_REPR_CAP = 200
_MAX_ENTRIES = 100_000  # a container with more leaves is cut off (noted), not walked forever
_MAX_DEPTH = 16

# -- statistics ---------------------------------------------------------------------------------
_NATIVE_FLOATS = ("torch.float32", "torch.float64", "torch.float16", "torch.bfloat16")
_STAT_NAMES = ("sum", "norm", "min", "max")


def _stat_tensors(t: Any) -> tuple[list[Any], list[Any]]:
    """The statistics as 0-dim device tensors (ints, floats), to be fetched with the fingerprint."""
    import torch

    if t.numel() == 0:
        return [], []
    if t.dtype == torch.bool:
        return [torch.count_nonzero(t)], []
    if t.is_complex():
        s = t.sum()
        return [], [s.real, s.imag, torch.linalg.vector_norm(t)]
    if not t.is_floating_point():  # integers: exact sum and extremes
        sq = torch.zeros((), dtype=torch.float64, device=t.device)
        for chunk in t.reshape(-1).split(1 << 22):  # bounded float64 scratch, even for a huge tensor
            sq += chunk.double().square().sum()
        try:
            mn, mx = torch.aminmax(t)
        except (RuntimeError, NotImplementedError):  # e.g. uint64 on CPU
            return [t.sum()], [sq]
        return [t.sum(), mn, mx], [sq]
    return [], _float_stats(t) or []


def _float_parts(work: Any) -> list[Any]:
    import torch

    # Half types accumulate in float32 (their own range overflows at 65504).
    acc = torch.float32 if work.element_size() < 4 else None
    mn, mx = torch.aminmax(work)
    return [work.sum(dtype=acc), torch.linalg.vector_norm(work, dtype=acc), mn, mx]


def _float_stats(t: Any, finite_only: bool = False) -> list[Any] | None:
    """[sum, norm, min, max] as 0-dim device tensors (None: no element). float8 & co. have no
    reductions: they are converted to float32 a piece at a time (bounded scratch), and the
    pieces' figures combined."""
    import torch

    native = str(t.dtype) in _NATIVE_FLOATS
    parts = []
    for piece in [t] if native else _pieces(t, _fp.PIECE_BYTES // 4):
        work = piece if native else piece.float()
        if finite_only:
            work = work[torch.isfinite(work)]
        if work.numel():
            parts.append(_float_parts(work))
    if len(parts) <= 1:
        return parts[0] if parts else None
    cols = list(zip(*parts))
    return [torch.stack([x.double() for x in cols[0]]).sum(), torch.linalg.vector_norm(torch.stack([x.double() for x in cols[1]])),
            torch.stack([x.float() for x in cols[2]]).min(), torch.stack([x.float() for x in cols[3]]).max()]


def _nonfinite(t: Any) -> tuple[int, int]:
    """NaN and ±Inf counts, piece by piece for the types that must be converted first."""
    import torch

    native = str(t.dtype) in _NATIVE_FLOATS
    nan = inf = 0
    for piece in [t] if native else _pieces(t, _fp.PIECE_BYTES // 4):
        work = piece if native else piece.float()
        nan += int(torch.isnan(work).sum().item())
        inf += int(torch.isinf(work).sum().item())
    return nan, inf


def _stats_from(t: Any, ints: list[int], floats: list[float]) -> dict[str, Any]:
    """The statistics' dict from fetched values; counts NaN/Inf (extra passes) only if needed."""
    import torch

    out: dict[str, Any] = {"sum": None, "norm": None, "min": None, "max": None, "nan": 0, "inf": 0}
    n = t.numel()
    if n == 0:
        return out
    if t.dtype == torch.bool:
        count = ints[0]
        out.update(sum=count, norm=math.sqrt(count), min=int(count == n), max=int(count > 0))
    elif t.is_complex():
        out.update(sum=floats[:2], norm=floats[2])
        if not all(map(math.isfinite, floats)):
            out.update(nan=int(torch.isnan(t).sum().item()), inf=int(torch.isinf(t).sum().item()))
    elif not t.is_floating_point():
        out.update(sum=ints[0], norm=math.sqrt(floats[0]))
        if len(ints) == 3:
            out.update(min=ints[1], max=ints[2])
    elif all(map(math.isfinite, floats)):
        out.update(zip(_STAT_NAMES, floats))
    else:
        nan, inf = _nonfinite(t)
        out.update(zip(_STAT_NAMES, floats), nan=nan, inf=inf)
        if nan or inf:  # then the figures describe the finite elements; the counts say what was left out
            finite = _float_stats(t, finite_only=True)
            values = _fetch([], finite)[1] if finite else [None] * 4
            out.update(zip(_STAT_NAMES, values))
    # Strict JSON: a figure that is still not finite (complex NaN, a float32 norm that overflowed)
    # becomes None; the NaN/Inf counts say why.
    for k in _STAT_NAMES:
        v = out[k]
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif isinstance(v, list):
            out[k] = [x if math.isfinite(x) else None for x in v]
    return out


def _stats(t: Any) -> dict[str, Any]:
    """sum, norm, min, max, nan, inf of a dense tensor (one host sync unless there are NaN/Inf)."""
    ints, floats = _stat_tensors(t)
    return _stats_from(t, *_fetch(ints, floats))


# -- summaries ----------------------------------------------------------------------------------
def _dtensor_class() -> Any:
    # No DTensor can exist unless its module was imported, so never import it here (it is slow).
    mod = imported_module("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def _placement(p: Any) -> str:
    name = type(p).__name__
    if "Shard" in name and hasattr(p, "dim"):
        return f"{name.lstrip('_')}({p.dim})"
    if name == "Replicate":
        return "Replicate()"
    if hasattr(p, "reduce_op"):
        return f"Partial({p.reduce_op})"
    return str(p)


def tensor_summary(t: Any) -> dict[str, Any]:
    """The summary of one tensor (see :func:`checksum`); never raises for an odd tensor."""
    out: dict[str, Any] = {
        "kind": "tensor",
        "shape": list(t.shape),
        "dtype": _dtype_name(t),
        "device": str(t.device),
        "placement": None,
        "placements": None,
    }
    try:
        dtensor = _dtensor_class()
        if dtensor is not None and isinstance(t, dtensor):
            out["placements"] = [_placement(p) for p in t.placements]
            out["placement"] = ", ".join(out["placements"])
            out["mesh_shape"] = list(t.device_mesh.shape)
            coord = t.device_mesh.get_coordinate()  # where this rank sits: replicas of one shard share it on the sharded dims
            if coord is not None:
                out["mesh_coord"] = list(coord)
            t = t.to_local()  # this rank's shard: no communication
            out["local_shape"] = list(t.shape)
        t = _dense(t.detach())
        out["numel"] = t.numel()
        if t.is_meta:
            out.update(fingerprint=None, note="meta tensor: no data", **_stats_none())
            return out
        if t.is_quantized:
            out["note"] = f"quantized ({t.qscheme()}): stats and fingerprint over the integer representation"
            t = t.int_repr()
        if t.layout != _strided():
            return _sparse_summary(t, out)
        acc, nbytes = _sum_tensor(t)
        try:
            ints, floats = _stat_tensors(t)
        except Exception as exc:  # a dtype without some reduction: the fingerprint still stands
            ints, floats = [], []
            out.update(_stats_none(), stats_error=f"statistics failed: {type(exc).__name__}: {exc}"[:_REPR_CAP])
        ivals, fvals = _fetch([acc, *ints], floats)  # one sync for everything
        sums = [v & _MASK for v in ivals[:4]]
        out["fingerprint"] = _digest(_dtype_name(t), tuple(t.shape), nbytes, sums)  # as fingerprint(t)
        if "stats_error" not in out:
            try:
                out.update(_stats_from(t, ivals[4:], fvals))
            except Exception as exc:
                out.update(_stats_none(), stats_error=f"statistics failed: {type(exc).__name__}: {exc}"[:_REPR_CAP])
    except Exception as exc:  # a tensor subclass or device we cannot read: say so, keep the rest
        out.setdefault("fingerprint", None)
        out["error"] = f"{type(exc).__name__}: {exc}"[:_REPR_CAP]
    return out


def _strided() -> Any:
    import torch

    return torch.strided


def _stats_none() -> dict[str, Any]:
    return {"sum": None, "norm": None, "min": None, "max": None, "nan": 0, "inf": 0}


def _sparse_summary(t: Any, out: dict[str, Any]) -> dict[str, Any]:
    import torch

    layout = str(t.layout).replace("torch.", "")
    coo = t if t.layout == torch.sparse_coo else t.to_sparse_coo()
    coo = coo.coalesce()  # one canonical form: the same matrix gives the same indices and values
    idx, vals = coo.indices(), _dense(coo.values())
    out["layout"] = layout
    out["nnz"] = vals.shape[0]
    out["note"] = f"{layout}: stats over the stored values; fingerprint over indices and values"
    out["fingerprint"] = _digest(out["dtype"], tuple(coo.shape), layout, _sums(idx), _sums(vals))
    out.update(_stats(vals))
    return out


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception as exc:
        text = f"<unrepresentable {type(obj).__name__}: {type(exc).__name__}>"
    # Addresses differ from rank to rank and would make every plain object look different.
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return text if len(text) <= _REPR_CAP else text[: _REPR_CAP - 1] + "…"


def _value(obj: Any) -> dict[str, Any]:
    return {"kind": "value", "repr": _short_repr(obj)}


def _module_summary(m: Any) -> dict[str, Any]:
    params = list(m.named_parameters())
    return {
        "kind": "module",
        "type": type(m).__name__,
        "params": {n: tensor_summary(p) for n, p in params},
        "grads": {n: tensor_summary(p.grad) for n, p in params if p.grad is not None},
        "buffers": {n: tensor_summary(b) for n, b in m.named_buffers()},
    }


_SCALARS = (int, float, complex, str, bytes, bool, type(None))


def _flatten(obj: Any, prefix: str, out: dict[str, Any], path_ids: set[int], depth: int) -> None:
    import torch

    if len(out) >= _MAX_ENTRIES:
        return
    join = (lambda k: f"{prefix}.{k}") if prefix else str
    if isinstance(obj, torch.Tensor):
        out[prefix] = tensor_summary(obj)
    elif isinstance(obj, torch.nn.Module):
        m = _module_summary(obj)
        out.update({join(n): s for n, s in m["params"].items()})
        out.update({join(f"{n}.grad"): s for n, s in m["grads"].items()})
        out.update({join(n): s for n, s in m["buffers"].items()})
    elif isinstance(obj, torch.optim.Optimizer):
        _flatten(obj.state_dict(), prefix, out, path_ids, depth)
    elif isinstance(obj, (list, tuple)) and all(isinstance(v, _SCALARS) for v in obj):
        out[prefix] = _value(obj)  # e.g. param_groups' "params": [0, 1, 2] reads better whole
    elif isinstance(obj, (dict, list, tuple)) and depth < _MAX_DEPTH and id(obj) not in path_ids:
        path_ids.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            _flatten(v, join(k), out, path_ids, depth + 1)
        path_ids.discard(id(obj))
    else:
        out[prefix] = _value(obj)


def checksum(obj: Any, name: str = "") -> dict[str, Any]:
    """A small, picklable, JSON-able summary of ``obj`` for comparing ranks.

    Schema (every float is a Python float; NaN/Inf only appear as counts, see below):

    * tensor: ``{"kind": "tensor", "shape", "dtype", "device", "placement", "numel", "sum", "norm",
      "min", "max", "nan", "inf", "fingerprint"}``. ``placement`` is ``None`` or, for a DTensor,
      e.g. ``"Shard(0)"`` / ``"Replicate()"`` (comma-joined per mesh dimension), with
      ``"local_shape"`` and ``"mesh_shape"``; ``shape`` is then the global shape and everything
      else describes the local shard. Integers and bools give int ``sum``/``min``/``max``;
      complex gives ``sum`` as ``[re, im]`` and no min/max; an empty tensor gives ``None``s. If
      there are NaN/Inf, sum/norm/min/max cover the finite elements. Optional: ``"note"``
      (sparse, quantized, meta), ``"layout"``/``"nnz"`` (sparse), ``"error"`` (unreadable).
    * ``nn.Module``: ``{"kind": "module", "type", "params": {name: tensor}, "grads": {name:
      tensor} (parameters with a .grad), "buffers": {name: tensor}}``.
    * dict / list / tuple / optimizer (its ``state_dict()``): ``{"kind": "mapping" | "sequence",
      "items": {"state.0.exp_avg": tensor, "param_groups.0.lr": value, …}}`` — nested containers
      flattened into dotted paths; modules inside contribute ``path.param``, ``path.param.grad``
      and ``path.buffer``; lists of plain scalars stay one value; ``"truncated": True`` past
      100,000 leaves.
    * anything else: ``{"kind": "value", "repr": repr capped at 200 characters, addresses removed}``.

    ``name`` only labels errors. Runs on the tensor's device: nothing but scalars is copied to
    the host.
    """
    import torch

    try:
        if isinstance(obj, torch.Tensor):
            return tensor_summary(obj)
        if isinstance(obj, torch.nn.Module):
            return _module_summary(obj)
        kind = "mapping"
        if isinstance(obj, torch.optim.Optimizer):
            obj = obj.state_dict()
        elif isinstance(obj, (list, tuple)):
            kind = "sequence"
        elif not isinstance(obj, dict):
            return _value(obj)
        items: dict[str, Any] = {}
        _flatten(obj, "", items, set(), 0)
        out: dict[str, Any] = {"kind": kind, "items": items}
        if len(items) >= _MAX_ENTRIES:
            out["truncated"] = True
        return out
    except Exception as exc:  # never let one odd object fail the whole request
        return {"kind": "error", "error": f"checksum({name or type(obj).__name__}) failed: {type(exc).__name__}: {exc}"[:_REPR_CAP]}
