"""Tensor checksums, computed where the tensor lives.

``checksum(obj)`` summarises a tensor, module, state dict or optimizer: shape, dtype, device,
DTensor placement, sum, norm, min, max, NaN/Inf counts and a bitwise fingerprint. Only scalars
leave the device: the fingerprint is two wrapping int64 reductions over the tensor's raw bytes
(a plain sum and a position-weighted sum), so equal bits give equal fingerprints and a flipped bit
or two swapped elements change it.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["checksum", "fingerprint", "tensor_summary"]

_WIDTH = 4096  # weights per row of the position-weighted sum
_CHUNK_ROWS = 256  # rows per step: bounds the temporary to _WIDTH * _CHUNK_ROWS int64 (8 MB)
_weights: dict[Any, Any] = {}


def _weights_for(device: Any) -> tuple[Any, Any]:
    """(column weights, row weights): fixed pseudo-random odd int64s, cached per device."""
    import torch

    pair = _weights.get(device)
    if pair is None:
        gen = torch.Generator().manual_seed(0x5EED)
        cols = torch.randint(-(2**62), 2**62, (_WIDTH,), generator=gen, dtype=torch.int64) | 1
        rows = torch.randint(-(2**62), 2**62, (_CHUNK_ROWS,), generator=gen, dtype=torch.int64) | 1
        pair = _weights[device] = (cols.to(device), rows.to(device))
    return pair


def fingerprint(t: Any) -> str:
    """Hex digest of the tensor's exact bits, shape and dtype (computed on its device)."""
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n8 = flat.numel() // 8
    words = flat[: n8 * 8].view(torch.int64)
    tail = bytes(flat[n8 * 8 :].cpu().tolist())
    plain = int(words.sum().item()) if n8 else 0
    weighted = 0
    rows = n8 // _WIDTH
    cols_w, rows_w = _weights_for(words.device)
    if rows:
        body = words[: rows * _WIDTH].view(rows, _WIDTH)
        acc = torch.zeros((), dtype=torch.int64, device=words.device)
        for start in range(0, rows, _CHUNK_ROWS):
            chunk = body[start : start + _CHUNK_ROWS]
            # Every (row, column) position gets its own weight: swapped elements change the sum.
            per_row = (chunk * cols_w).sum(dim=1)
            acc = acc * 6364136223846793005 + (per_row * rows_w[: per_row.numel()]).sum()
        weighted = int(acc.item())
    rest = words[rows * _WIDTH :]
    if rest.numel():
        weighted = weighted * 1442695040888963407 + int((rest * cols_w[: rest.numel()]).sum().item())
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((tuple(t.shape), str(t.dtype), plain & (2**64 - 1), weighted & (2**64 - 1))).encode())
    h.update(tail)
    return h.hexdigest()


def _num(x: Any) -> Any:
    if isinstance(x, complex):
        return repr(x)
    return float(x) if isinstance(x, float) else x


def tensor_summary(t: Any) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"kind": "tensor"}
    placement = None
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            placement = ", ".join(str(p) for p in t.placements)
            out["global_shape"] = list(t.shape)
            t = t.to_local()
    except ImportError:
        pass
    t = t.detach()
    if t.is_sparse:
        t = t.coalesce()
        out["note"] = "sparse: values and indices compared"
        out["fingerprint"] = fingerprint(t.values()) + fingerprint(t.indices())[:8]
        t = t.values()
    out.update(shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""), device=str(t.device), placement=placement)
    out.setdefault("fingerprint", fingerprint(t))
    n = t.numel()
    out.update(numel=n, nan=0, inf=0, sum=None, norm=None, min=None, max=None)
    if n == 0:
        return out
    if t.dtype == torch.bool:
        out.update(sum=int(t.sum().item()), min=int(t.min().item()), max=int(t.max().item()))
        return out
    if t.is_complex():
        out.update(sum=_num(complex(t.sum().item())), norm=float(torch.linalg.vector_norm(t).item()),
                   nan=int(torch.isnan(t).sum().item()), inf=int(torch.isinf(t).sum().item()))
        return out
    if t.is_floating_point():
        work = t.float() if t.element_size() < 4 else t
        nan = int(torch.isnan(work).sum().item())
        inf = int(torch.isinf(work).sum().item())
        finite = work if not (nan or inf) else work[torch.isfinite(work)]
        out.update(nan=nan, inf=inf, sum=float(work.sum(dtype=torch.float64).item()))
        if finite.numel():
            out.update(norm=float(torch.linalg.vector_norm(finite).item()), min=float(finite.min().item()), max=float(finite.max().item()))
        return out
    out.update(sum=int(t.sum().item()), min=int(t.min().item()), max=int(t.max().item()),
               norm=float(torch.linalg.vector_norm(t.double()).item()) if n <= (1 << 24) else None)
    return out


def _flatten(obj: Any, prefix: str, out: dict[str, Any], depth: int = 0) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = tensor_summary(obj)
    elif depth < 8 and isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out, depth + 1)
    else:
        text = repr(obj)
        out[prefix] = {"kind": "value", "repr": text if len(text) <= 200 else text[:200] + "…"}


def checksum(obj: Any, name: str = "") -> dict[str, Any]:
    """A small, picklable summary of ``obj`` for comparing ranks (see the module doc)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return tensor_summary(obj)
    if isinstance(obj, torch.nn.Module):
        return {
            "kind": "module",
            "params": {n: tensor_summary(p) for n, p in obj.named_parameters()},
            "grads": {n: tensor_summary(p.grad) for n, p in obj.named_parameters() if p.grad is not None},
            "buffers": {n: tensor_summary(b) for n, b in obj.named_buffers()},
        }
    if isinstance(obj, torch.optim.Optimizer):
        obj = obj.state_dict()
    if isinstance(obj, (dict, list, tuple)):
        items: dict[str, Any] = {}
        _flatten(obj, "", items)
        return {"kind": "mapping" if isinstance(obj, dict) else "sequence", "items": items}
    text = repr(obj)
    return {"kind": "value", "repr": text if len(text) <= 200 else text[:200] + "…"}
