"""Small text helpers shared by the controller and the workers (standard library only)."""

from __future__ import annotations

__all__ = ["mib"]


def mib(n_bytes: float) -> str:
    """A size in binary megabytes, the one unit distnb's limits are stated in: ``"256.0 MiB"``."""
    return f"{n_bytes / (1 << 20):,.1f} MiB"
