"""Bitwise tensor fingerprints, computed where the tensor lives (no full copy, on any device).

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
import struct
from typing import Any, Iterator

__all__ = ["fingerprint", "dense", "dtype_name", "digest", "fetch", "pieces", "sum_tensor", "sums", "WIDTH", "MASK", "PIECE_BYTES"]

WIDTH = _WIDTH = 1024  # int32 words per row; weights are < 4096, so a row's dot product is < 2**53
_CPU_BLOCK_ROWS = 64  # per thread: 64 × 1024 float64 = 512 KiB, the converted block stays in L2
_GPU_BLOCK_ROWS = 4096  # 32 MiB float64 per block on a GPU: few launches, bounded scratch memory
_SPAN_ROWS = 1 << 16  # rows whose results are combined at once (bounds the per-row scratch)
_PAD_WHOLE_BYTES = 1 << 16  # smaller tensors are padded in one copy: one block, fewest ops
MASK = _MASK = (1 << 64) - 1

_col_weights: dict[str, Any] = {}  # device → (WIDTH, 4) float64: ones, ones, w1, w2
_row_weights: dict[str, Any] = {}  # device → (_SPAN_ROWS, 4) int64 for the first span


# -- weights ------------------------------------------------------------------------------------
def _splitmix(seed: int) -> Iterator[int]:
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
PIECE_BYTES = 16 << 20  # a non-contiguous tensor is copied this much at a time, never whole


def pieces(t: Any, budget: int | None = None) -> Any:
    """Views of ``t`` along its leading dims, in memory order of ``t.contiguous()``, each at most
    ``budget`` bytes (or one innermost row): a transposed, sliced or expanded tensor is walked
    without materialising it (an expanded one can be far larger than its storage)."""
    budget = PIECE_BYTES if budget is None else budget
    size = t.numel() * t.element_size()
    if size <= budget or t.dim() <= 1:
        yield t
        return
    per = max(1, budget // max(1, size // t.shape[0]))
    for i in range(0, t.shape[0], per):
        piece = t[i : i + per]
        if piece.shape[0] == 1 and piece.numel() * piece.element_size() > budget:
            yield from pieces(piece[0], budget)
        else:
            yield piece


def _byte_chunks(t: Any) -> Any:
    """The tensor's bytes in ``t.contiguous()`` order as 1-D uint8 tensors: views when ``t`` is
    contiguous, bounded copies of its pieces otherwise."""
    import torch

    if t.is_contiguous():
        yield t.reshape(-1).view(torch.uint8)
        return
    for piece in pieces(t):
        yield piece.contiguous().reshape(-1).view(torch.uint8)


def _words(t: Any) -> Any:
    """``(rows, first row index)``: the tensor's bytes as (R, WIDTH) int32 row blocks in order,
    the last one zero-padded (nbytes goes into the digest). Views of the tensor's own memory when
    it is contiguous and aligned; otherwise bounded copies, a partial row carried to the next."""
    import torch

    row = 4 * _WIDTH
    carry = None
    row0 = 0
    for raw in _byte_chunks(t):
        if raw.storage_offset() % 4:  # an odd slice of a larger buffer: int32 views need alignment
            raw = raw.clone()
        if carry is not None:
            raw = torch.cat([carry, raw])
        full = raw.numel() // row if raw.numel() > _PAD_WHOLE_BYTES or carry is not None else 0
        if full:
            yield raw[: full * row].view(torch.int32).view(full, _WIDTH), row0
            row0 += full
        carry = raw[full * row :] if raw.numel() > full * row else None
    if carry is not None:
        padded = torch.constant_pad_nd(carry, [0, -carry.numel() % row])
        yield padded.view(torch.int32).view(-1, _WIDTH), row0


def sum_tensor(t: Any) -> tuple[Any, int]:
    """The fingerprint's four wrapping int64 sums as a device tensor (no host sync), and nbytes."""
    import torch

    if t.device.type == "mps":  # MPS has no float64: the one case that reads the tensor on the host
        t = t.cpu()
    nbytes = t.numel() * t.element_size()
    dev = t.device
    cols = _columns(dev)
    block = _GPU_BLOCK_ROWS if dev.type != "cpu" else _CPU_BLOCK_ROWS * max(1, torch.get_num_threads())
    totals = []
    buf = None
    for part, row0 in _words(t):
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
            if len(totals) > 64:  # keep the pending partial sums bounded
                totals = [torch.stack(totals).sum(0)]
    if not totals:
        return torch.zeros(4, dtype=torch.int64, device=dev), nbytes
    return (totals[0] if len(totals) == 1 else torch.stack(totals).sum(0)), nbytes


def fetch(ints: list[Any], floats: list[Any]) -> tuple[list[int], list[float]]:
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


def digest(*fields: Any) -> str:
    return hashlib.blake2b(repr(fields).encode(), digest_size=16).hexdigest()


def sums(t: Any) -> tuple[list[int], int]:
    """The four sums as Python ints (one host sync)."""
    acc, nbytes = sum_tensor(t)
    return [v & _MASK for v in fetch([acc], [])[0]], nbytes


def fingerprint(t: Any) -> str:
    """Hex digest of a dense tensor's exact bits, shape and dtype, computed on its device.

    Equal bits (and shape and dtype) give equal fingerprints; -0.0 and 0.0, or two NaN payloads,
    differ, since this is about bits, not values.
    """
    t = dense(t.detach())
    words, nbytes = sums(t)
    return digest(dtype_name(t), tuple(t.shape), nbytes, words)


def dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def dense(t: Any) -> Any:
    """The tensor with lazy conjugation/negation resolved: its bits as its values read."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t
