"""Tensor checksums, computed where the tensor lives (rank side; the controller compares them).

``checksum(obj)`` summarises a tensor, module, state dict, optimizer or container as a small,
picklable, JSON-able dict: shape, dtype, device, DTensor placement, sum, norm, min, max, NaN/Inf
counts and a bitwise ``fingerprint``. Only a handful of scalars leave the device.

The fingerprint reads the tensor's bytes as int32 words laid out in rows of ``_WIDTH`` and takes,
per row, the plain sum and two weighted sums with small distinct integer weights. Those are
float64 matrix products (``words @ W``) whose every partial sum stays below 2**53, so they are
*exact* integers: no rounding, no dependence on summation order, the same on CPU and GPU, and
fast (one int32→float64 copy and one GEMM per block, both in cache). The per-row results are then
combined with per-row int64 weights, wrapping mod 2**64, and hashed with shape and dtype.
What that guarantees (not merely makes likely):
  * any change of one word (a flipped bit, an element off by one ulp) changes the plain sum;
  * two words swapped within a row change the weighted row sums (the weights are distinct), and
    the row multiplier is odd, so the change survives mod 2**64;
  * two words swapped across rows r1, r2 change ``sum((2r+1) * rowsum)`` by ``2(r1-r2)δ``, which
    is non-zero mod 2**64 for any tensor under 2**32 rows (16 TiB).
Wider changes (elements of 8+ bytes swapped, many edits) are caught by the pseudo-random row
weights with probability about 1 - 2**-60. This module never imports controller code, and
imports torch only when called (``import distnb`` and the rank's start must not pull it in).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import sys
from typing import Any

__all__ = ["checksum", "fingerprint", "tensor_summary", "WIDTH"]

WIDTH = _WIDTH = 1024  # int32 words per row; weights are < 4096, so a row's dot product is < 2**53
_CPU_BLOCK_ROWS = 64  # per thread: 64 × 1024 float64 = 512 KiB, the converted block stays in L2
_GPU_BLOCK_ROWS = 4096  # 32 MiB float64 per block on a GPU: few launches, bounded scratch memory
_SPAN_ROWS = 1 << 16  # rows whose results are combined at once (bounds the per-row scratch)
_PAD_WHOLE_BYTES = 1 << 16  # smaller tensors are padded in one copy: one block, fewest ops
_MASK = (1 << 64) - 1
_REPR_CAP = 200
_MAX_ENTRIES = 100_000  # a container with more leaves is cut off (noted), not walked forever
_MAX_DEPTH = 16

_col_weights: dict[str, Any] = {}  # device → (WIDTH, 4) float64: ones, ones, w1, w2
_row_weights: dict[str, Any] = {}  # device → (_SPAN_ROWS, 4) int64 for the first span


# -- weights ------------------------------------------------------------------------------------
def _splitmix(seed: int):
    """A tiny, fixed PRNG: weights must be identical on every rank, torch version and device."""
    state = seed & _MASK
    while True:
        state = (state + 0x9E3779B97F4A7C15) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        yield z ^ (z >> 31)


def _distinct_weights(seed: int) -> list[int]:
    # Distinct magnitudes from 1..4095 with random signs: a swap inside a row always changes the
    # dot product, and sum(|w|) < 2**22 keeps every partial sum of int32 × w exact in float64.
    rng = _splitmix(seed)
    pool = list(range(1, 4096))
    for i in range(len(pool) - 1, 0, -1):  # Fisher-Yates
        j = next(rng) % (i + 1)
        pool[i], pool[j] = pool[j], pool[i]
    return [w if next(rng) & 1 else -w for w in pool[:_WIDTH]]


def _columns(device: Any) -> Any:
    """(WIDTH, 4) float64 [1, 1, w1, w2]: the plain row sum twice (it gets two row weightings)."""
    import torch

    key = str(device)
    cols = _col_weights.get(key)
    if cols is None:
        ones = [1] * _WIDTH
        w = torch.tensor([ones, ones, _distinct_weights(1), _distinct_weights(2)], dtype=torch.float64)
        cols = _col_weights[key] = w.t().contiguous().to(device)
    return cols


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


_G, _M1, _M2 = (_signed(v) for v in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _mix_rows(start: int, stop: int, device: Any) -> Any:
    """(stop-start, 4) int64 row weights [1, 2r+1, m1(r), m2(r)]: m odd, pseudo-random.

    int64 tensor arithmetic wraps the same way on every device, so any device computes them.
    """
    import torch

    r = torch.arange(start, stop, dtype=torch.int64, device=device)
    out = [torch.ones_like(r), 2 * r + 1]
    for salt in (1, 2):
        z = (r + salt * 0x51ED27) * _G
        z = (z ^ (z >> 30)) * _M1
        z = (z ^ (z >> 27)) * _M2
        out.append((z ^ (z >> 31)) | 1)
    return torch.stack(out, 1)


def _rows(start: int, stop: int, device: Any) -> Any:
    if stop <= _SPAN_ROWS:
        key = str(device)
        table = _row_weights.get(key)
        if table is None:
            table = _row_weights[key] = _mix_rows(0, _SPAN_ROWS, "cpu").to(device)
        return table[start:stop]
    return _mix_rows(start, stop, device)


# -- fingerprint --------------------------------------------------------------------------------
def _words(t: Any) -> tuple[Any, Any, int]:
    """(main rows as an (R, WIDTH) int32 view or None, padded tail (k, WIDTH) int32 or None, nbytes).

    The main part is a view of the tensor's own memory; only the tail (< 4 KiB, or a whole tensor
    under 64 KiB) is copied.
    """
    import torch

    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    nbytes = raw.numel()
    row = 4 * _WIDTH
    if raw.storage_offset() % 4:  # an odd slice of a larger buffer: int32 views need alignment
        raw = raw.clone()
    main_rows = nbytes // row if nbytes > _PAD_WHOLE_BYTES else 0
    main = raw[: main_rows * row].view(torch.int32).view(main_rows, _WIDTH) if main_rows else None
    rest = nbytes - main_rows * row
    tail = None
    if rest:
        rest_bytes = raw[main_rows * row :] if main_rows else raw
        padded = torch.constant_pad_nd(rest_bytes, [0, -rest % row])  # zeros; nbytes goes into the digest
        tail = padded.view(torch.int32).view(-1, _WIDTH)
    return main, tail, nbytes


def _sum_tensor(t: Any) -> tuple[Any, int]:
    """The fingerprint's four wrapping int64 sums as a device tensor (no host sync), and nbytes."""
    import torch

    if t.device.type == "mps":  # MPS has no float64: the one case that reads the tensor on the host
        t = t.cpu()
    main, tail, nbytes = _words(t)
    dev = t.device
    cols = _columns(dev)
    block = _GPU_BLOCK_ROWS if dev.type != "cpu" else _CPU_BLOCK_ROWS * max(1, torch.get_num_threads())
    totals = []
    row0 = 0
    buf = None
    for part in (p for p in (main, tail) if p is not None):
        for s0 in range(0, part.shape[0], _SPAN_ROWS):
            span = part[s0 : s0 + _SPAN_ROWS]
            n = span.shape[0]
            if n <= block:  # one block: let torch allocate, fewer ops
                y = span.to(torch.float64) @ cols  # int32 → float64 is exact; partial sums < 2**53
            else:  # reuse one cache-sized float64 block; results go straight into y
                y = torch.empty(n, 4, dtype=torch.float64, device=dev)
                if buf is None:
                    buf = torch.empty(block, _WIDTH, dtype=torch.float64, device=dev)
                for b0 in range(0, n, block):
                    words = span[b0 : b0 + block]
                    scratch = buf[: words.shape[0]]
                    scratch.copy_(words)
                    torch.mm(scratch, cols, out=y[b0 : b0 + words.shape[0]])
            rows = _rows(row0 + s0, row0 + s0 + n, dev)
            totals.append((y.to(torch.int64) * rows).sum(0))  # int64 arithmetic wraps mod 2**64
        row0 += part.shape[0]
    if not totals:
        return torch.zeros(4, dtype=torch.int64, device=dev), nbytes
    return (totals[0] if len(totals) == 1 else torch.stack(totals).sum(0)), nbytes


def _fetch(ints: list[Any], floats: list[Any]) -> tuple[list[int], list[float]]:
    """All of a summary's scalars in one device→host copy (each .item() is a sync on a GPU).

    Floats travel as their int64 bit patterns so one int64 tensor carries both kinds exactly.
    """
    import torch

    parts = []
    if ints:  # cat promotes mixed integer dtypes (an int64 sum, a uint8 min) to int64
        parts.append(torch.cat([x.reshape(-1) for x in ints]).to(torch.int64))
    if floats:
        parts.append(torch.cat([x.reshape(-1) for x in floats]).to(torch.float64).view(torch.int64))
    if not parts:
        return [], []
    vals = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    n_int = parts[0].numel() if ints else 0
    n_float = len(vals) - n_int
    as_floats = list(struct.unpack(f"<{n_float}d", struct.pack(f"<{n_float}q", *vals[n_int:])))
    return vals[:n_int], as_floats


def _digest(*fields: Any) -> str:
    return hashlib.blake2b(repr(fields).encode(), digest_size=16).hexdigest()


def _sums(t: Any) -> tuple[list[int], int]:
    """The four sums as Python ints (one host sync)."""
    acc, nbytes = _sum_tensor(t)
    return [v & _MASK for v in _fetch([acc], [])[0]], nbytes


def fingerprint(t: Any) -> str:
    """Hex digest of a dense tensor's exact bits, shape and dtype, computed on its device.

    Equal bits (and shape and dtype) give equal fingerprints; -0.0 and 0.0, or two NaN payloads,
    differ, since this is about bits, not values.
    """
    t = _dense(t.detach())
    sums, nbytes = _sums(t)
    return _digest(_dtype_name(t), tuple(t.shape), nbytes, sums)


def _dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _dense(t: Any) -> Any:
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


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
    return [], _float_parts(_float_work(t))


def _float_work(t: Any) -> Any:
    return t if str(t.dtype) in _NATIVE_FLOATS else t.float()  # float8 & co. lack reductions


def _float_parts(work: Any) -> list[Any]:
    import torch

    # Half types accumulate in float32 (their own range overflows at 65504).
    acc = torch.float32 if work.element_size() < 4 else None
    mn, mx = torch.aminmax(work)
    return [work.sum(dtype=acc), torch.linalg.vector_norm(work, dtype=acc), mn, mx]


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
        work = _float_work(t)
        nan, inf = int(torch.isnan(work).sum().item()), int(torch.isinf(work).sum().item())
        out.update(zip(_STAT_NAMES, floats), nan=nan, inf=inf)
        if nan or inf:  # then the figures describe the finite elements; the counts say what was left out
            finite = work[torch.isfinite(work)]
            values = _fetch([], _float_parts(finite))[1] if finite.numel() else [None] * 4
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
    mod = sys.modules.get("torch.distributed.tensor")
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
        ints, floats = _stat_tensors(t)
        ivals, fvals = _fetch([acc, *ints], floats)  # one sync for everything
        sums = [v & _MASK for v in ivals[:4]]
        out["fingerprint"] = _digest(_dtype_name(t), tuple(t.shape), nbytes, sums)  # as fingerprint(t)
        out.update(_stats_from(t, ivals[4:], fvals))
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
