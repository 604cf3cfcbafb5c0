"""Wrapping ``torch.distributed`` functions where both user code and torch itself find them."""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["wrap_c10d"]


def wrap_c10d(names: Iterable[str], wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]], marker: str) -> None:
    """Replace each of ``names`` by ``wrap(name, original)`` in ``distributed_c10d`` (torch's own
    calls read those) and in ``torch.distributed`` where it is the same function (``dist.x``).
    ``marker`` names the attribute a wrapper carries (the original), so installing twice wraps once."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in names:
        original = getattr(c10d, name, None)
        if original is None or hasattr(original, marker):
            continue
        wrapped = wrap(name, original)
        setattr(wrapped, marker, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
