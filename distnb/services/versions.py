"""The versions distnb runs on, against the range its CI tested: what ``python -m distnb doctor``
says, so that a bug report carries the facts and a user outside the range knows it before a
verdict misleads them.

CI (``.ci/run``) builds its environments from nothing on every run: the *newest* leg with the newest
release every requirement allows, the *oldest* with every requirement at its lower bound in
``pyproject.toml``. ``TESTED`` is what those legs ran; a version outside it may work, but nobody
has seen it do so. Raise the upper bounds when CI's newest leg ran a newer release green.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from dataclasses import dataclass

__all__ = ["TESTED", "Installed", "installed", "untested"]

#: distribution -> (oldest, newest) release CI ran green, by major.minor.
TESTED: dict[str, tuple[str, str]] = {
    "python": ("3.11", "3.13"),
    "torch": ("2.11", "2.15"),
    "ipython": ("8.0", "9.18"),
    "ipykernel": ("6.25", "7.4"),
    "ipywidgets": ("8.0", "8.1"),
    "pyzmq": ("25.0", "27.3"),
    "matplotlib": ("3.8", "3.11"),
    "nbformat": ("5.7", "5.11"),
    "debugpy": ("1.8", "1.8"),
}


@dataclass(frozen=True)
class Installed:
    """One distribution as found here: its version, or None where it is not installed."""

    name: str
    version: str | None

    @property
    def outside(self) -> str | None:
        """Why this version is outside the tested range, or None when it is inside (or absent)."""
        if self.version is None or self.name not in TESTED:
            return None
        low, high = TESTED[self.name]
        here = _minor(self.version)
        if here < _minor(low):
            return f"older than {low}, the oldest CI tests"
        if here > _minor(high):
            return f"newer than {high}, the newest CI has run"
        return None


def _minor(version: str) -> tuple[int, int]:
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def installed() -> list[Installed]:
    """Python and each distribution of ``TESTED``, as installed in this environment."""
    out = [Installed("python", ".".join(map(str, sys.version_info[:3])))]
    for name in TESTED:
        if name == "python":
            continue
        try:
            out.append(Installed(name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            out.append(Installed(name, None))
    return out


def untested(found: list[Installed] | None = None) -> list[Installed]:
    """The distributions whose installed version is outside the tested range."""
    return [i for i in (installed() if found is None else found) if i.outside]
